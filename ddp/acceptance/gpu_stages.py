"""The stages of ``python -m ddp gpu-check``: each checks, on one GPU, a claim of the suite that
no CPU can, and prints its figure; each runs in a process of its own (``gpu_check.run_stage``).

A stage is a function of a ``Target`` (one GPU, or its CPU rehearsal at ``tiny`` sizes: the same
code, the same commands, other sizes and backends) and the folder it writes into; it returns the
stage's figure, one line, or raises ``CheckFailed`` with it. Timing figures are asserted on a GPU
and only reported in a rehearsal: two CPU cores shared with CI's other work do not time steps
to 2%. Most stages run the suite's own pytest benchmarks in a ddp-bench checkout and read the
pytest-benchmark JSON they write (``ddp.bench.results.records.load_run``), so that what is checked is
what a user runs.

What each stage holds the suite to on one GPU (docs/gpu-first-run.md has the first H100's figures):

- ``harness``: the harness's ``local`` step against a plain PyTorch loop of the same xl step,
  interleaved (``perf_tests/test_harness_cost.py``): the ratio's interval reaches below 1.02; both
  peaks within 2%.
- ``precision``: xl's ``local`` step at 4,096 tokens in tf32 and bf16: a step the GPU bounds,
  where bf16 must beat tf32, with its MFU.
- ``fit``: the largest batch ``ddp memory`` says fits (``largest_batch``) runs, the next is refused
  unbuilt, and the measured peak (CUDA's ``max_memory_allocated``; MemTracker's in a rehearsal)
  is within 10% of the predicted one.
- ``oom``: a step that takes every byte there is runs out of memory for real and is skipped with
  its figures; the next configuration, xl, runs on the same ranks with the memory back.
- ``traced``: the traced steps on CUDA (2 gloo ranks over CUDA tensors), ``local`` included: each
  step's window partitioned (``ddp.bench.collectives.timeline``) into parts that add up to it, each
  bucket named, the shares adding up to the exposed communication, a tail, what bounds the step;
  the timed rounds after a tracer's traced steps against those before (not slower); at world size
  1 with NCCL, no strategy launches an NCCL kernel, the partition adds up and the collectives
  without a kernel are named.
- ``layout``: the default run's processes on one GPU (two timing groups and the tracer, 2 gloo
  ranks over CUDA each), its steps paired and counted, configurations built from kept copies, and
  each process's memory sampled against what the fit decisions count per process.
- ``compile``: ``--compile on`` for xl with ``bucketed`` and ``torch``: both compile and run.
- ``correctness-gloo-cuda``, ``correctness-nccl``: the correctness suite with 2 gloo ranks over
  CUDA tensors and with one NCCL rank, cut to what fits the budget (``LEFT_OUT`` says what not),
  every step shape (accumulation, checkpointing) included; over CUDA also a model built from a
  kept copy against a fresh build (tests/test_reuse.py: weights, losses, step time and own peak).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import subprocess
import threading
import xml.etree.ElementTree as ElementTree
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ddp.analysis.profiles import read_traces
from ddp.bench.collectives.reading import kernel_kind
from ddp.bench.collectives.timeline import PARTS
from ddp.bench.config.options import RoundOptions
from ddp.bench.config.step_config import AXES, StepConfig
from ddp.bench.memory.predict import HEADROOM, PROCESS_BYTES, largest_batch, predict, size_text
from ddp.bench.results.records import StepRecord, load_run
from ddp.bench.results.stats import ratio_of_medians_ci
from ddp.bench.rounds.grid_measurer import GridMeasurer
from ddp.bench.rounds.loop import HARNESS_RATIO_BAR, NotRun, free, measure
from ddp.bench.rounds.profiling import ProfileConfig, profile_on
from ddp.bench.rounds.rank_state import allocated_bytes
from ddp.bench.rounds.summary import collective_trace
from ddp.bench.rounds.traced import trace
from ddp.launcher import RANK_PROCESS_NAME, RankGroup
from ddp.strategies.registry import FLOOR


class CheckFailed(AssertionError):
    """A stage's claim does not hold; the message is its figure and what failed."""


@dataclass(frozen=True)
class Target:
    """Where the stages run: one GPU, or the CPU rehearsal (``--rehearse``) of the same stages."""

    rehearse: bool

    @property
    def model(self) -> str:
        """The benchmark model: ``xl`` (2.0B parameters) on a GPU, ``tiny`` in a rehearsal."""
        return "tiny" if self.rehearse else "xl"

    def one_rank(self) -> list[str]:
        """Launch options of one NCCL rank (gloo on the CPU in a rehearsal)."""
        return ["--backend", "gloo", "--device", "cpu", "--world-size", "1"] if self.rehearse else \
            ["--backend", "nccl", "--world-size", "1"]

    def one_group(self) -> list[str]:
        """The stages time one configuration's GPU path, not a comparison between runs: one group of
        ranks (``--rank-groups 1``), so that a second group's builds do not double a stage's time
        (its limit is one group's) and its CUDA context does not take what the fit boundary needs."""
        return ["--rank-groups", "1"]

    def two_ranks_on_one_gpu(self) -> list[str]:
        """Launch options of 2 gloo ranks over CUDA tensors on the one GPU (CPU tensors in a rehearsal)."""
        return ["--backend", "gloo", "--device", "cpu" if self.rehearse else "cuda", "--world-size", "2"]

    def ranks(self, world_size: int) -> RankGroup:
        """A rank group of ``world_size`` ranks: NCCL alone, gloo over CUDA for two (gloo on the CPU in a rehearsal)."""
        if self.rehearse:
            return RankGroup(world_size, "gloo", "cpu")
        return RankGroup(1, "nccl") if world_size == 1 else RankGroup(world_size, "gloo", "cuda")

    def check(self, holds: bool, figure: str, timing: bool = False) -> None:
        """Raise ``CheckFailed`` unless ``holds``; a timing check only reports in a rehearsal."""
        if not holds and not (timing and self.rehearse):
            raise CheckFailed(figure)


def _pytest(suite: Path, out: Path, name: str, *args: str) -> tuple[int, Path]:
    """Run pytest in the suite with ``args``, in this stage's process (its own, killed whole past
    its limit: ``ddp.cli.gpu_check.run_stage``), which has already paid for importing torch and,
    on a GPU, for CUDA's first touch; a stage runs pytest once. Its output goes to this stage's log
    (our stdout), its outcomes to ``out/<name>.xml`` (JUnit XML: every skip with its reason)."""
    import pytest

    junit = out / f"{name}.xml"
    arguments = ["-q", "-rs", "-p", "no:cacheprovider", f"--junitxml={junit}", *args]
    print("$ python -m pytest", " ".join(arguments), flush=True)
    here = Path.cwd()
    os.chdir(suite)
    try:
        return int(pytest.main(arguments)), junit
    finally:
        os.chdir(here)


def _outcomes(junit: Path) -> dict[str, str]:
    """Each test's outcome by its name: ``passed``, ``failed`` or ``skipped: <reason>``; none where
    pytest wrote no report (a usage error, in the log)."""
    outcomes = {}
    if not junit.exists():
        return outcomes
    for case in ElementTree.parse(junit).iter("testcase"):
        # An Element without children is falsy: each is compared with None, never taken as a bool.
        skipped = case.find("skipped")
        failed = case.find("failure") is not None or case.find("error") is not None
        outcomes[case.get("name")] = (f"skipped: {skipped.get('message', '')}" if skipped is not None
                                      else "failed" if failed else "passed")
    return outcomes


def _steps(path: Path) -> dict[str, StepRecord]:
    """The step records of a pytest-benchmark JSON, by test id."""
    return {record.config.test_id: record for record in load_run(path).steps}


def _gib(size_bytes: float) -> str:
    return size_text(size_bytes)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


# ------------------------------------------------------------------------------------ stages


def harness(target: Target, out: Path, suite: Path) -> str:
    json_path = out / "harness.json"
    code, _ = _pytest(suite, out, "harness", "perf_tests/test_harness_cost.py", *target.one_rank(), *target.one_group(), "--model", target.model,
                      "--batch-sizes", "2" if target.rehearse else "4", "--seq-lens", "32" if target.rehearse else "128",
                      "--rounds", "10", "--max-rounds", "10", "--warmup-rounds", "2", "--benchmark-json", str(json_path))
    target.check(code == 0, f"perf_tests/test_harness_cost.py exited {code}")
    info = json.loads(json_path.read_text())["benchmarks"][0]["extra_info"]
    ratio, (low, high) = info["harness_over_plain"], info["harness_over_plain_ci95"]
    figure = f"harness / plain loop {ratio:.3f} [{low:.3f}, {high:.3f}] over {len(info['harness_round_seconds'])} rounds"
    if info.get("plain_peak_memory_bytes"):
        figure += f"; peaks {_gib(info['harness_peak_memory_bytes'])} and {_gib(info['plain_peak_memory_bytes'])} (plain)"
    target.check(low <= HARNESS_RATIO_BAR, f"{figure}: above the bar of {HARNESS_RATIO_BAR}", timing=True)
    return figure


# xl's step at 4,096 tokens (batch 4 x 1,024, the LM's context): where the GPU, not the host's
# ~6,000 launches, bounds a tf32 or bf16 step (at 1,024 tokens both sat on the host's floor on an
# H200, bf16 the slower; at 4,096 on the H200 on 2026-11-27: tf32 388.9 ms, bf16 225.2 ms, fp32
# 1,271 ms: docs/gpu.md). fp32 is left out: 10 s of an 8-minute budget for a row nothing checks.
PRECISION_BATCH, PRECISION_SEQ_LEN = 4, 1024


def precision(target: Target, out: Path, suite: Path) -> str:
    json_path = out / "precision.json"
    batch, seq_len = ("2", "32") if target.rehearse else (str(PRECISION_BATCH), str(PRECISION_SEQ_LEN))
    code, junit = _pytest(suite, out, "precision", "perf_tests/test_step.py", *target.one_rank(), *target.one_group(),
                          "--model", target.model, "--strategies", FLOOR, "--batch-sizes", batch, "--seq-lens", seq_len,
                          "--precision", "tf32,bf16", "--interleave", "off", "--rounds", "6", "--max-rounds", "6",
                          "--warmup-rounds", "1", "--traced-steps", "0", "--benchmark-json", str(json_path))
    outcomes = _outcomes(junit)
    target.check(code == 0, f"perf_tests/test_step.py exited {code}: {outcomes}")
    rows = {r.config.precision: r for r in _steps(json_path).values()}
    target.check({"tf32", "bf16"} <= set(rows), f"tf32 and bf16 not both measured: {outcomes}")
    parts = []
    for name, row in rows.items():
        low, high = row.step_seconds_ci95
        parts.append(f"{name} {_ms(row.step_seconds)} [{low * 1e3:.1f}, {high * 1e3:.1f}]"
                     + (f" MFU {row.mfu:.1%}" if row.mfu is not None else ""))
    figure = f"local {target.model} b{batch} x {seq_len}: " + ", ".join(parts)
    bf16, tf32 = rows["bf16"].step_seconds_ci95, rows["tf32"].step_seconds_ci95
    target.check(bf16[1] < tf32[0], f"{figure}: bf16 does not beat tf32 (a host-bound step?)", timing=True)
    return figure


class ProcessMemory:
    """Samples, every ``interval`` seconds while it is entered, the memory of every process of this
    stage's process group (the stage's pytest and its rank processes): on a GPU what
    ``nvidia-smi`` says each uses of it (the CUDA context, NCCL's buffers and the caching
    allocator's reserve: what no ``torch.cuda`` counter of another process shows), on the CPU each
    one's resident memory (/proc). Keeps each process's largest and smallest sample."""

    def __init__(self, gpu: bool, interval: float = 0.5) -> None:
        self.gpu, self.interval = gpu, interval
        self.largest: dict[int, int] = {}
        self.smallest: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.error: str | None = None
        self.host_pids = False
        """True where ``nvidia-smi`` gave the host's process ids (``ranks_of``)."""

    def __enter__(self) -> ProcessMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                sample = self._gpu_sample() if self.gpu else self._host_sample()
            except (OSError, ValueError, subprocess.SubprocessError) as error:
                self.error = f"{type(error).__name__}: {error}"
                return
            mine, self.host_pids = ranks_of(sample, self.gpu)
            for pid, used in mine.items():
                self.largest[pid] = max(used, self.largest.get(pid, 0))
                self.smallest[pid] = min(used, self.smallest.get(pid, used))

    @staticmethod
    def _gpu_sample() -> dict[int, int]:
        text = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10, check=True).stdout
        return {int(pid): int(mib) * 2**20 for pid, mib in (line.split(",") for line in text.strip().splitlines() if line)}

    @staticmethod
    def _host_sample() -> dict[int, int]:
        sample = {}
        for status in Path("/proc").glob("[0-9]*/status"):
            try:
                fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
            except OSError:
                continue
            if "VmRSS" in fields:
                sample[int(status.parent.name)] = int(fields["VmRSS"].split()[0]) * 1024
        return sample


def ranks_of(sample: dict[int, int], gpu: bool) -> tuple[dict[int, int], bool]:
    """The rank processes of this stage among a ``sample`` (pid -> bytes), and whether its pids are
    the host's: each of this process group whose name is a rank's. ``nvidia-smi`` in a container
    reports the processes on the GPU by their ids outside the container's pid namespace, which
    match none here: then, where none matches, every process it lists is taken as this stage's
    (the lent GPU runs the check alone; the stage's own context, if any, is one of them)."""
    group = os.getpgrp()
    mine = {pid: used for pid, used in sample.items()
            if pid != os.getpid() and _process_group(pid) == group and _is_rank(pid)}
    if gpu and sample and not mine and not any(_process_group(pid) == group for pid in sample):
        return dict(sample), True
    return mine, False


def _is_rank(pid: int) -> bool:
    """A rank process (named by the launcher: ``RANK_PROCESS_NAME``), not pytest, multiprocessing's
    fork server nor its resource tracker."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().startswith(RANK_PROCESS_NAME)
    except OSError:
        return False


def _process_group(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[2])
    except (OSError, IndexError, ValueError):
        return None


def layout(target: Target, out: Path, suite: Path) -> str:
    """The default run's process layout on one GPU: two timing groups of two gloo ranks over CUDA
    and the tracer's two, six processes with a context each, a model that fits six times (``mini``:
    the layout is checked, not the model's speed), its three configurations built from kept copies
    after the first (``ddp.bench.rounds.reuse``), in bf16 with two micro-batches a step
    (accumulation timed on CUDA). Every step is paired with its
    twin, every record counts its builds, warm-up, memory counts and traced steps, and the memory
    each process held is sampled: at most what the fit decisions count per process
    (``PROCESS_BYTES``) before a model is built."""
    json_path = out / "layout.json"
    # On an H200 (2026-11-27) small at b2 x 256 with five configurations took 75 s of pytest, past the
    # stage's limit: builds 19 s, first steps 17 s, rounds 9 s, traced steps 9 s. Now mini, three.
    model, seq_len = ("tiny", "32") if target.rehearse else ("mini", "128")
    sampler = ProcessMemory(gpu=not target.rehearse)
    with sampler:
        code, junit = _pytest(suite, out, "layout", "perf_tests/test_step.py", *target.two_ranks_on_one_gpu(),
                              "--rank-groups", "2", "--model", model, "--strategies", f"{FLOOR},bucketed,torch",
                              "--batch-sizes", "2", "--seq-lens", seq_len, "--bucket-sizes", "25",
                              "--precision", "fp32" if target.rehearse else "bf16", "--grad-accum", "2",
                              "--rounds", "6", "--max-rounds", "6",
                              "--warmup-rounds", "1", "--traced-steps", "2", "--benchmark-json", str(json_path))
    outcomes = _outcomes(junit)
    target.check(code == 0 and outcomes and all(o == "passed" for o in outcomes.values()), f"layout run: {outcomes}")
    steps = list(_steps(json_path).values())
    for row in steps:
        counted = (row.builds, row.warmup_rounds, row.memory_counts, row.traced_steps)
        target.check(None not in counted and row.traced_steps > 0, f"{row.config.test_id}: counts {counted}")
        if row.strategy != FLOOR:
            target.check(row.overhead_seconds is not None, f"{row.config.test_id} unpaired: {row.unpaired_reason}")
    restored = sum(row.restored_builds or 0 for row in steps)
    figure = (f"{len(steps)} steps of {model} on 2 gloo ranks x 2 groups + tracer, {restored} builds from kept copies, "
              f"bound by {dict(Counter(row.bound_by for row in steps))}")
    target.check(restored > 0, f"{figure}: no configuration was built from a kept copy")
    # Not sampled is not passed: the stage exists to see what each process holds.
    target.check(not sampler.error and sampler.largest,
                 f"{figure}; process memory not sampled ({sampler.error or 'no process of this stage in any sample'})")
    ranks = list(sampler.largest)
    idle = min(sampler.smallest[pid] for pid in ranks)
    figure += (f"; {len(ranks)} processes sampled{' (by the host pids nvidia-smi gives)' if sampler.host_pids else ''}, largest {size_text(max(sampler.largest.values()))}, "
               f"together at most {size_text(sum(sampler.largest.values()))}; the least a process held {size_text(idle)}, "
               f"counted per process {size_text(PROCESS_BYTES['cpu' if target.rehearse else 'cuda'])}")
    # 2 timing groups of 2 ranks and, on CUDA, the tracer's 2 (on the CPU a step is traced where it was timed)
    expected = 4 if target.rehearse else 6
    target.check(len(ranks) >= expected, f"{figure}: expected {expected} rank processes")
    # On a GPU a process appears once its context exists: its least is the context (and the
    # allocator's first reserve). On the CPU its least is caught while it starts: reported only.
    target.check(idle <= PROCESS_BYTES["cpu" if target.rehearse else "cuda"], f"{figure}: a process holds more than counted",
                 timing=True)
    return figure


def fit(target: Target, out: Path, suite: Path) -> str:
    seq_len = 32 if target.rehearse else 1024
    # In the GPU grid's precision (bf16), named on the command line, so the run builds what was
    # predicted in a rehearsal too; the outcomes are read by the configurations' own test ids.
    precision = AXES["precision"].gpu[0]
    config = StepConfig(FLOOR, target.model, 1, seq_len, precision=precision)
    if target.rehearse:  # a device of the size in which batch 4 just fits (the host has far more)
        memory_bytes = math.ceil(predict(dataclasses.replace(config, batch_size=4), 1).total_bytes / (1 - HEADROOM))
    else:
        memory_bytes = torch.cuda.get_device_properties(0).total_memory
    batch = largest_batch(config, 1, memory_bytes)
    target.check(batch >= 1, f"not even batch 1 of {config.describe()} is predicted to fit in {_gib(memory_bytes)}")
    json_path = out / "fit.json"
    code, junit = _pytest(suite, out, "fit", "perf_tests/test_step.py", *target.one_rank(), *target.one_group(), "--model", target.model,
                          "--strategies", FLOOR, "--batch-sizes", f"{batch},{batch + 1}", "--seq-lens", str(seq_len),
                          "--precision", precision, "--interleave", "off", "--rounds", "2", "--max-rounds", "2", "--warmup-rounds", "1",
                          "--traced-steps", "0", "--device-memory", f"{memory_bytes}B", "--benchmark-json", str(json_path))
    outcomes = _outcomes(junit)
    fits, next_one = (f"test_step[{dataclasses.replace(config, batch_size=b).test_id}]" for b in (batch, batch + 1))
    figure = f"largest batch predicted to fit {_gib(memory_bytes)}: {batch} at seq {seq_len}"
    target.check(code == 0 and outcomes.get(fits) == "passed", f"{figure}; it did not run: {outcomes.get(fits)}")
    target.check(str(outcomes.get(next_one)).startswith("skipped: predicted not to fit"),
                 f"{figure}; batch {batch + 1} was not refused unbuilt: {outcomes.get(next_one)}")
    record = _steps(json_path)[fits.removeprefix("test_step[").removesuffix("]")]
    predicted, measured = record.predicted_memory.total_bytes, record.measured_peak_bytes
    figure += (f", runs; batch {batch + 1} refused unbuilt; peak predicted {_gib(predicted)}, measured {_gib(measured)} "
               f"({'max_memory_allocated' if record.peak_memory_bytes else 'MemTracker'}), ratio {predicted / measured:.3f}")
    target.check(0.9 <= predicted / measured <= 1.1, f"{figure}: beyond 10%")
    return figure


def memory_hog(batch_size: int, seq_len: int):
    """A user's model (``package.module:build``) whose forward takes memory until the device has
    none: on CUDA a gigabyte after another until the allocator refuses; on the CPU (a rehearsal) a
    few blocks, then more than any host has, which the allocator refuses at once. Its forward reads
    its input's values (``.item()``), so its step cannot be traced and has no prediction: it is
    built, as any user's model the prediction cannot read is."""

    class Hog(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(1))

        def forward(self, inputs: torch.Tensor) -> torch.Tensor:
            inputs.sum().item()  # reads the values: a step the prediction cannot trace on fake tensors
            held, block = [], 2**30 if inputs.is_cuda else 2**26
            while inputs.is_cuda or len(held) < 4:
                held.append(torch.empty(block, dtype=torch.uint8, device=inputs.device))
            held.append(torch.empty(2**60, dtype=torch.uint8, device=inputs.device))
            return (inputs * self.weight).sum()

    def batch(generator: torch.Generator):
        return torch.ones(batch_size, seq_len), torch.zeros(batch_size)

    return Hog(), batch, lambda output, _targets: output


def oom(target: Target, out: Path, suite: Path) -> str:
    hog = StepConfig(FLOOR, f"{__name__}:memory_hog", 1, 1)
    after = StepConfig(FLOOR, target.model, 2, 32 if target.rehearse else 128)
    policy = RoundOptions.fixed(2, 1)
    with target.ranks(1) as ranks:
        measurer = GridMeasurer(ranks, [hog, after], policy, "off")
        empty = ranks.run(allocated_bytes)[0]
        skipped = measurer.measurement(hog)
        target.check(isinstance(skipped, NotRun), f"{hog.describe()} did not run out of memory: {skipped}")
        reason = skipped.reason(1)
        target.check(reason.startswith("out of memory"), f"not skipped for memory: {reason}")
        back = ranks.run(allocated_bytes)[0]
        measured = measurer.measurement(after)
        free(ranks)
    target.check(not isinstance(measured, NotRun), f"{after.describe()} did not run after it: {measured}")
    memory = "" if empty is None else f"; allocated before {_gib(empty)}, after the skip {_gib(back)}"
    figure = f"skipped: {reason[:160]}...; then {after.describe()} ran, {_ms(statistics.median(measured[0].round_seconds()))}{memory}"
    target.check(empty is None or back <= empty, f"{figure}: memory not back")
    return figure


def traced(target: Target, out: Path, suite: Path) -> str:
    model = "tiny" if target.rehearse else "small"
    bucket = 0.1 if target.rehearse else 25.0
    configs = [StepConfig(FLOOR, model, 2, 32 if target.rehearse else 128)]
    configs += [StepConfig(name, configs[0].model, 2, configs[0].seq_len, bucket) for name in ("bucketed", "torch")]
    policy = RoundOptions.fixed(6, 1, traced_steps=3)
    figures = []
    with target.ranks(2) as timing, target.ranks(2) as tracer:
        measurer = GridMeasurer(timing, configs, policy, FLOOR, tracer=tracer)
        for config in configs:
            measurement, index, _ = measurer.measurement(config)
            for rank_steps in measurement.traces[index]:
                for step in rank_steps:
                    target.check(adds_up(step.timeline), f"{config.strategy}: parts of a traced step's window do not add "
                                 f"up: {_parts(step.timeline)}")
            trace_record = collective_trace(measurement.traces[index])
            if config.strategy == FLOOR:
                target.check(trace_record.comm_seconds == 0.0, f"local: {trace_record.comm_seconds} s of communication")
                figures.append(f"local: bound by {trace_record.bound_by}, {_parts(dataclasses.asdict(trace_record))}")
                continue
            plan = measurement.setups[index][0].bucket_sizes_bytes
            labels = [c.label for c in trace_record.collectives]
            buckets = [label for label in labels if label.startswith("bucket")]
            shown = (f"{config.strategy}: {', '.join(labels)} from {trace_record.comm_source}, tail {trace_record.tail}, "
                     f"bound by {trace_record.bound_by}, {_parts(dataclasses.asdict(trace_record))}")
            target.check(len(buckets) == len(plan) and trace_record.tail in buckets, f"{shown}; plan of {len(plan)} buckets")
            target.check(abs(trace_record.attributed_seconds - trace_record.exposed_comm_seconds) <= 1e-3,
                         f"{shown}: the collectives' shares do not add up to the exposed communication")
            figures.append(shown)
        # bucketed's timed rounds before and after a trace of torch, whose traced steps run the
        # profiler with CUDA activity (PyTorch's reducer records nothing itself) on the tracer's ranks.
        pair, profiled = [configs[1], configs[0]], [configs[2]]
        rounds = dataclasses.replace(policy, min_rounds=6, max_rounds=6)
        before = measure(timing, pair, rounds).round_seconds(0)
        trace(tracer, profiled, policy)
        after = measure(timing, pair, rounds).round_seconds(0)
        free(timing)
    ratio, low, high = ratio_of_medians_ci(after, before)
    figures.append(f"bucketed after torch's profiled trace on the tracer / before {ratio:.3f} [{low:.3f}, {high:.3f}]")
    target.check(low <= 1.03, "; ".join(figures) + ": slower after the tracer traced", timing=True)
    figures.append(one_nccl_rank_launches_no_kernel(target, out))
    return "; ".join(figures)


def one_nccl_rank_launches_no_kernel(target: Target, out: Path) -> str:
    """``ddp profile`` at world size 1: the steps' phases read from the GPU's kernels, and no NCCL
    kernel (an all-reduce over one rank launches nothing: ``launch_all_reduce``)."""
    configs = [ProfileConfig(StepConfig(name, "tiny", 2, 64, 1.0 if name != "naive" else None),
                             steps=2, out_dir=str(out)) for name in ("naive", "bucketed")]
    with target.ranks(1) as ranks:
        records = profile_on(ranks, configs)
    kernels = [e["name"] for r in records for e in json.loads(Path(r[0]["trace_file"]).read_text())["traceEvents"]
               if e.get("cat") == "kernel"]
    kinds = [kernel_kind(name, "kernel") for name in kernels]
    # NCCL's one-rank kernel for AVG is named oneRankReduce, and HTA's rule (kernel_kind) calls it
    # compute: it is looked for by name.
    one_rank = [name for name in kernels if "oneRankReduce" in name]
    target.check(target.rehearse or kinds.count("compute") > 0, "no compute kernel in the CUDA trace at world size 1")
    target.check(kinds.count("communication") == 0 and not one_rank,
                 f"{kinds.count('communication')} NCCL kernels and {len(one_rank)} oneRankReduce at world size 1")
    # The partition of the same trace, as the parent reads it: parts that add up and no
    # communication. The suite's strategies launch no collective at world size 1 (launch_all_reduce),
    # so NCCL ranges without a kernel (PyTorch's reducer's) are counted, not required.
    steps = [step for r in records for step in read_traces(r)[0]["steps"]]
    without = sum(len(step.timeline["collectives_without_kernel"]) for step in steps)
    for step in steps:
        # (rehearsed on CPU, gloo's one-rank all-reduce is a collective of its own: it communicates)
        target.check(adds_up(step.timeline) and (target.rehearse or step.timeline["comm_seconds"] == 0.0),
                     f"world size 1: {_parts(step.timeline)}, communication {step.timeline['comm_seconds']} s")
    bound = Counter(step.timeline["bound_by"] for step in steps)
    return (f"world size 1: {kinds.count('compute')} compute kernels, no NCCL kernel, no oneRankReduce; "
            f"{without} collectives without a kernel; bound by {dict(bound)}")


def adds_up(figures: dict) -> bool:
    """Whether the parts of a step's window add up to it (``ddp.bench.collectives.timeline.PARTS``)."""
    return abs(sum(figures[part] for part in PARTS) - figures["window_seconds"]) <= 1e-9 + 1e-6 * figures["window_seconds"]


def _parts(figures: dict) -> str:
    return ", ".join(f"{part.removesuffix('_seconds')} {_ms(figures[part])}" for part in ("window_seconds", *PARTS,
                                                                                          "host_wait_seconds"))


def compile_(target: Target, out: Path, suite: Path) -> str:
    json_path = out / "compile.json"
    code, junit = _pytest(suite, out, "compile", "perf_tests/test_step.py", *target.one_rank(), *target.one_group(), "--model", target.model,
                          "--strategies", "bucketed,torch", "--bucket-sizes", "0.1" if target.rehearse else "25",
                          "--batch-sizes", "2", "--seq-lens", "32" if target.rehearse else "128", "--compile", "on",
                          "--interleave", "off", "--rounds", "3", "--max-rounds", "3", "--warmup-rounds", "1",
                          "--traced-steps", "0", "--benchmark-json", str(json_path))
    outcomes = _outcomes(junit)
    target.check(code == 0 and all(o == "passed" for o in outcomes.values()), f"compiled steps: {outcomes}")
    return "; ".join(f"{r.config.label} compiled {_ms(r.step_seconds)}" for r in _steps(json_path).values())


# Seconds a correctness test took on one H100 (at 3975dc7), by stage, and a stage's start-up (its
# pytest, its ranks): CORRECTNESS is cut to fit each stage's limit at these rates
# (tests/test_gpu_check.py counts it).
CORRECTNESS_SECONDS_PER_TEST = {"correctness-gloo-cuda": 0.59, "correctness-nccl": 0.47}
STAGE_START_SECONDS = 10.0
# The strategies a GPU runs differently (a C++ reducer, buckets on the device, sharded state), on
# the LM with AdamW, each in every precision and every step shape (--grad-accum,
# --activation-checkpointing) of theirs: 42 tests.
CORRECTNESS = (("--strategies", "bucketed,torch,fsdp"),
               "(transformer_tiny and adamw and not tensor_over_cap and not (bucketed and few_per_bucket))"
               " or (test_precision and not whole_batch_mean)")
REHEARSED_CORRECTNESS = (("--strategies", "bucketed"), "transformer_tiny and adamw and step")
REUSE = ("tests/test_reuse.py", "a_reused_model")
"""A model built from a kept copy against a fresh build, on CUDA tensors (with 2 gloo ranks)."""
LEFT_OUT = ("naive, flat, overlap, sharded_optimizer, zero and torch_fsdp; SGD; two of bucketed's four bucket layouts; "
            "the frozen, tied and routed models; the whole-batch-mean cases of the step's shapes (each shape trains "
            "against one process in test_precision); the suite's own tests/ (all of them run on the CPU in CI)")


def correctness(launch: Callable[[Target], list[str]], name: str, also: tuple[str, str] | None = None):
    """A stage that runs the correctness suite (``CORRECTNESS`` of it) with ``launch``'s ranks;
    ``also``: a test file of the suite's own and the tests of it to run with them."""

    def stage(target: Target, out: Path, suite: Path) -> str:
        options, keyword = REHEARSED_CORRECTNESS if target.rehearse else CORRECTNESS
        paths = ["correctness_tests"]
        if also is not None:
            paths.append(also[0])
            keyword = f"({keyword}) or {also[1]}"
        selection = (*options, "-k", keyword)
        code, junit = _pytest(suite, out, name, *paths, *launch(target), *selection)
        outcomes = list(_outcomes(junit).values())
        counts = {kind: sum(o.split(":")[0] == kind for o in outcomes) for kind in ("passed", "failed", "skipped")}
        figure = f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped ({' '.join(selection)})"
        target.check(code == 0 and counts["passed"] > 0, figure)
        return figure

    return stage
