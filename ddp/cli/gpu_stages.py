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
- ``precision``: xl steps of ``local``, ``bucketed`` and ``torch`` in fp32, tf32 and bf16, each paired
  with its ``local`` twin: every row has its MFU, the twin's and the points of MFU lost.
- ``fit``: the largest batch ``ddp memory`` says fits (``largest_batch``) runs, the next is refused
  unbuilt, and the measured peak (CUDA's ``max_memory_allocated``; MemTracker's in a rehearsal)
  is within 10% of the predicted one.
- ``oom``: a step that takes every byte there is runs out of memory for real and is skipped with
  its figures; the next configuration, xl, runs on the same ranks with the memory back.
- ``traced``: the traced steps on CUDA (2 gloo ranks over CUDA tensors), ``local`` included: each
  step's window partitioned (``ddp.bench.collectives.timeline``) into parts that add up to it, each
  bucket named, the shares adding up to the exposed communication, a tail, what bounds the step;
  the timed rounds after a tracer's traced steps against those before (not slower), beside the
  after-effect of tracing in the timing ranks themselves (reported); at world size 1 with NCCL, no
  strategy launches an NCCL kernel, the partition adds up and the collectives without a kernel are named.
- ``compile``: ``--compile on`` for xl with ``bucketed`` and ``torch``: both compile and run.
- ``correctness-gloo-cuda``, ``correctness-nccl``: the correctness suite with 2 gloo ranks over
  CUDA tensors and with one NCCL rank, cut to what fits the budget (``LEFT_OUT`` says what not).
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import subprocess
import sys
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
from ddp.bench.config.step_config import StepConfig
from ddp.bench.memory.predict import HEADROOM, largest_batch, predict, size_text
from ddp.bench.results.records import StepRecord, load_run
from ddp.bench.results.stats import ratio_of_medians_ci
from ddp.bench.rounds.measure import HARNESS_RATIO_BAR, GridMeasurer, NotRun, free, measure, trace
from ddp.bench.rounds.profiling import ProfileConfig, profile_on
from ddp.bench.rounds.rank_state import allocated_bytes
from ddp.bench.rounds.summary import collective_trace
from ddp.launcher import RankGroup
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
    """Run pytest in the suite with ``args``; its output goes to this stage's log (our stdout), its
    outcomes to ``out/<name>.xml`` (JUnit XML: every skip with its reason)."""
    junit = out / f"{name}.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", f"--junitxml={junit}", *args]
    print("$", " ".join(command), flush=True)
    return subprocess.run(command, cwd=suite, stdout=sys.stdout, stderr=subprocess.STDOUT).returncode, junit


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


def precision(target: Target, out: Path, suite: Path) -> str:
    json_path = out / "precision.json"
    bucket = "0.1" if target.rehearse else "25"
    code, _ = _pytest(suite, out, "precision", "perf_tests/test_step.py", *target.one_rank(), *target.one_group(), "--model", target.model,
                      "--strategies", f"{FLOOR},bucketed,torch", "--batch-sizes", "2", "--seq-lens", "32" if target.rehearse else "512",
                      "--bucket-sizes", bucket, "--precision", "fp32,tf32,bf16", "--interleave", FLOOR, "--rounds", "5",
                      "--max-rounds", "5", "--warmup-rounds", "1", "--traced-steps", "0", "--benchmark-json", str(json_path))
    target.check(code == 0, f"perf_tests/test_step.py exited {code}")
    steps = _steps(json_path)
    target.check(len(steps) == 9, f"{len(steps)} of 9 steps measured: {sorted(steps)}")
    parts = []
    for name in ("fp32", "tf32", "bf16"):
        rows = {r.strategy: r for r in steps.values() if r.config.precision == name}
        local = rows[FLOOR]
        text = f"{name}: local {_ms(local.step_seconds)}" + (f" MFU {local.mfu:.1%}" if local.mfu is not None else "")
        for strategy in ("bucketed", "torch"):
            row = rows[strategy]
            target.check(row.overhead_seconds is not None, f"{row.config.test_id} was not paired with its local twin")
            low, high = row.overhead_seconds_ci95
            text += f", {strategy} +{_ms(row.overhead_seconds)} [{low * 1e3:.1f}, {high * 1e3:.1f}]"
            if not target.rehearse:
                target.check(row.mfu is not None and 0 < row.mfu < 1 and row.local_mfu is not None
                             and row.mfu_lost_points is not None, f"{row.config.test_id}: MFU {row.mfu}, local's {row.local_mfu}")
                text += f" (MFU {row.mfu:.1%}, {row.mfu_lost_points:+.1f} points lost)"
        parts.append(text)
    return "; ".join(parts)


def fit(target: Target, out: Path, suite: Path) -> str:
    seq_len = 32 if target.rehearse else 1024
    config = StepConfig(FLOOR, target.model, 1, seq_len)
    if target.rehearse:  # a device of the size in which batch 4 just fits (the host has far more)
        memory_bytes = math.ceil(predict(dataclasses.replace(config, batch_size=4), 1).total_bytes / (1 - HEADROOM))
    else:
        memory_bytes = torch.cuda.get_device_properties(0).total_memory
    batch = largest_batch(config, 1, memory_bytes)
    target.check(batch >= 1, f"not even batch 1 of {config.describe()} is predicted to fit in {_gib(memory_bytes)}")
    json_path = out / "fit.json"
    code, junit = _pytest(suite, out, "fit", "perf_tests/test_step.py", *target.one_rank(), *target.one_group(), "--model", target.model,
                          "--strategies", FLOOR, "--batch-sizes", f"{batch},{batch + 1}", "--seq-lens", str(seq_len),
                          "--interleave", "off", "--rounds", "2", "--max-rounds", "2", "--warmup-rounds", "1",
                          "--traced-steps", "0", "--device-memory", f"{memory_bytes}B", "--benchmark-json", str(json_path))
    outcomes = _outcomes(junit)
    fits, next_one = (f"test_step[{FLOOR}-b{b}-s{seq_len}]" for b in (batch, batch + 1))
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
    policy = RoundOptions.fixed(8, 1, traced_steps=4)
    figures = []
    with target.ranks(2) as timing, target.ranks(2) as tracer:
        measurer = GridMeasurer(timing, configs, policy, FLOOR, tracer=tracer)
        for config in configs:
            measurement, index, _ = measurer.measurement(config)
            for rank_steps in measurement.traces[index]:
                for step in rank_steps:
                    target.check(adds_up(step["timeline"]), f"{config.strategy}: parts of a traced step's window do not add "
                                 f"up: {_parts(step['timeline'])}")
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
        # profiler with CUDA activity (PyTorch's reducer records nothing itself): on the tracer's
        # ranks, then on the timing ranks themselves, which then time bucketed again.
        pair, profiled = [configs[1], configs[0]], [configs[2]]
        rounds = dataclasses.replace(policy, min_rounds=10, max_rounds=10)
        before = measure(timing, pair, rounds).round_seconds(0)
        trace(tracer, profiled, policy)
        after = measure(timing, pair, rounds).round_seconds(0)
        trace(timing, profiled, policy)
        in_place = measure(timing, pair, rounds).round_seconds(0)
        free(timing)
    ratio, low, high = ratio_of_medians_ci(after, before)
    effect = ratio_of_medians_ci(in_place, after)
    figures.append(f"bucketed after torch's profiled trace on the tracer / before {ratio:.3f} [{low:.3f}, {high:.3f}]; "
                   f"after one in the timing ranks themselves {effect[0]:.3f} [{effect[1]:.3f}, {effect[2]:.3f}] (reported: "
                   "the profiler's after-effect in a process)")
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
    without = sum(len(step["timeline"]["collectives_without_kernel"]) for step in steps)
    for step in steps:
        # (rehearsed on CPU, gloo's one-rank all-reduce is a collective of its own: it communicates)
        target.check(adds_up(step["timeline"]) and (target.rehearse or step["timeline"]["comm_seconds"] == 0.0),
                     f"world size 1: {_parts(step['timeline'])}, communication {step['timeline']['comm_seconds']} s")
    bound = Counter(step["timeline"]["bound_by"] for step in steps)
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
CORRECTNESS = ("--strategies", "bucketed,torch,fsdp", "-k",
               "(transformer_tiny and adamw and not tensor_over_cap and not (bucketed and few_per_bucket))"
               " or (test_precision and not whole_batch_mean)")
REHEARSED_CORRECTNESS = ("--strategies", "bucketed", "-k", "transformer_tiny and adamw and step")
LEFT_OUT = ("naive, flat, overlap, sharded_optimizer, zero and torch_fsdp; SGD; two of bucketed's four bucket layouts; "
            "the frozen, tied and routed models; the whole-batch-mean cases of the step's shapes (each shape trains "
            "against one process in test_precision); the suite's own tests/ (all of them run on the CPU in CI)")


def correctness(launch: Callable[[Target], list[str]], name: str):
    """A stage that runs the correctness suite (``CORRECTNESS`` of it) with ``launch``'s ranks."""

    def stage(target: Target, out: Path, suite: Path) -> str:
        selection = REHEARSED_CORRECTNESS if target.rehearse else CORRECTNESS
        code, junit = _pytest(suite, out, name, "correctness_tests", *launch(target), *selection)
        outcomes = list(_outcomes(junit).values())
        counts = {kind: sum(o.split(":")[0] == kind for o in outcomes) for kind in ("passed", "failed", "skipped")}
        figure = f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped ({' '.join(selection)})"
        target.check(code == 0 and counts["passed"] > 0, figure)
        return figure

    return stage
