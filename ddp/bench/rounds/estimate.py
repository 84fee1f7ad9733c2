"""How long a benchmark run will take, said before it starts: ``estimated length: ...``.

The estimate counts what the run will do, the way ``ddp.bench.rounds.measure.GridMeasurer`` does
it (per configuration: builds, warm-up steps, memory counts, rounds and traced steps on each group
of ranks; groups started), and prices each part with costs measured on a machine of the same
kind (``MEASURED``): a group's start-up, a build (a fixed part and one per parameter), and a
step, modelled as a fixed part (the host's launches and the harness), the step's model FLOPs
at the rate the machine sustained and the optimizer's part per parameter; on CPU the rate and the
optimizer are timed here, before the run, on the grid's smallest step (``host_speed``), and every
other price scaled with the table's own step timed here (``REFERENCE``, ``on_this_host``). A memory count and a traced step are priced in steps.
The rounds are the run's own loop (``ddp.bench.rounds.measure.timed_rounds``) on simulated rounds
that vary from one to the next as the machine's measured rounds did (``PartCosts.round_spread``):
a step that reaches its precision target in its minimum rounds costs those, a noisy one its
budget (``GridOptions.round_budget_seconds``), which the line also gives as the rounds' ceiling.

What the estimate rests on is printed with it; ``docs/perf-suite.md`` and ``docs/gpu.md`` give
the runs the costs were measured in. The run's time by part, printed when it ends (``ledger``),
is what to hold it to.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import statistics
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from ddp.bench.config.options import GridOptions, ResolvedLaunch, RoundOptions
from ddp.bench.config.shape import cannot_run
from ddp.bench.config.step_config import StepConfig
from ddp.bench.config.workloads import build_workload
from ddp.bench.memory.predict import fake_step_key, host_memory_bytes, parameter_count, too_large
from ddp.bench.results.flops import workload_flops_per_token
from ddp.bench.rounds.ledger import BUILDS, MEMORY_COUNTS, PARTS, PREDICTIONS, ROUNDS, STARTUP, TRACED, WARMUP, minutes_text
from ddp.bench.rounds.measure import active_groups, group_share, timed_rounds
from ddp.bench.rounds.reuse import restorable, workload_key
from ddp.bench.rounds.trainer import LEARNING_RATE, adamw_implementation
from ddp.strategies.registry import FLOOR, steps_to_settle


@dataclass(frozen=True)
class PartCosts:
    """What each part of a run costs on one kind of machine, measured (``MEASURED``)."""

    source: str
    """The run they were measured in."""
    startup_seconds: float
    """Starting a process's first group of ranks: the fork server and its imports, the process
    group (on CUDA each rank's context comes with its first build)."""
    later_startup_seconds: float
    """Starting each later group: forked from the fork server already there."""
    build_seconds: float
    """A build's fixed part: the strategy, the optimizer, the batches."""
    first_build_seconds: float
    """What the first build in a group of ranks costs besides (the model's modules and the
    optimizer's code paths met for the first time in those processes)."""
    build_seconds_per_gparam: float
    """A build's part per billion parameters: allocating and initializing the model."""
    restore_seconds: float | None
    """A build from a kept copy of its workload's model (``ddp.bench.rounds.reuse``), all of it;
    None: every build priced fresh (on CUDA whether a copy fits beside a pair depends on the GPU's
    memory, which the parent does not query: an xl pair on an 80 GB GPU keeps none)."""
    step_seconds: float
    """A step's fixed part: launches, hooks, the harness."""
    flops_per_second: float
    """Model FLOPs per second one rank sustains in a step's forward and backward (fp32 on CPU; per
    the grid's precision on a GPU, the whole step's). On CPU the rate read on ``REFERENCE`` the
    day the table was measured, used where nothing is timed here (``on_this_host``)."""
    optimizer_seconds_per_gparam: float
    """The optimizer's step per billion parameters, whatever the batch (on CPU timed with the
    host's rate; on CUDA 0: inside the whole step's rate the table gives)."""
    reference_step_seconds: float
    """``REFERENCE``'s step as ``host_speed`` times it on the machine and day the table's times
    were measured (CPU; on CUDA nothing is timed and it is not read)."""
    memory_count_steps: float
    """A memory count (one or two steps under MemTracker), in steps."""
    traced_step_steps: float
    """A traced step (the recorder; on CUDA the step under the profiler), in steps."""
    traced_step_seconds_per_gparam: float
    """A traced step's processing per billion parameters: on CUDA exporting, loading and reading
    its trace, whose events grow with the model's kernels (about 11 a kernel), not its batch."""
    benchmark_seconds: float
    """A step benchmark's own part besides those: calls to the ranks, freeing, the record."""
    trace_seconds: float
    """Predicting memory: the fixed part of tracing a step on fake tensors, once per
    ``fake_step_key`` (the arithmetic per configuration takes milliseconds)."""
    trace_seconds_per_gparam: float
    """The trace's part per billion parameters (its operators grow with the model)."""
    round_spread: tuple[float, ...]
    """How a step's time varies from round to round: measured rounds, each over its measurement's
    median, pooled (or their quantiles). The estimate draws simulated rounds from them."""
    allreduce_seconds: float
    """A world size's all-reduce benchmark besides its rounds: its groups of ranks, warm-up rounds,
    the barriers before each all-reduce and the check of every element."""
    allreduce_latency_seconds: float
    """An all-reduce's fixed time; with ``allreduce_bus_bytes_per_second`` the time of each size."""
    allreduce_bus_bytes_per_second: float
    """The bus bandwidth (nccl-tests' busbw) of a large all-reduce."""
    allreduce_spread: tuple[float, ...]
    """As ``round_spread``, for the rounds of all-reduces."""
    check_seconds: float
    """Any other perf test (the harness's own checks): each, on average."""


# Every round of the GPU-bound steps the H200 timed (docs/gpu-runs/2026-11-27-h200-c): local xl at
# 4 x 1,024 in tf32 and bf16 (precision), the harness and its plain loop at 4 x 128 (harness), bf16
# at 13 and 14 x 1,024 (fit), each over its run's median. Most within 0.5%; one in 36 took 10% longer.
H200_ROUNDS = (0.9956, 0.998, 0.9981, 0.9983, 0.9986, 0.9989, 0.999, 0.9991, 0.9993, 0.9994, 0.9995,
               0.9996, 0.9996, 0.9996, 0.9998, 0.9999, 0.9999, 1.0, 1.0, 1.0001, 1.0002, 1.0002,
               1.0004, 1.0005, 1.0005, 1.0005, 1.0006, 1.0012, 1.0015, 1.0017, 1.0019, 1.0031,
               1.0032, 1.0044, 1.0059, 1.1037)

# Measured with this suite's time by part (``ddp.bench.rounds.ledger``), each from the run named.
MEASURED: dict[str, PartCosts] = {
    "cpu": PartCosts(
        source="this project's 2-core CPU, torch 2.13.0+cpu, gloo, 2 ranks: mini at batch 4 x 64, local, bucketed and "
        "torch with their twins, 2026-11-27 (docs/perf-suite.md, what a benchmark costs besides its rounds)",
        # A build: 0.55 s besides the model, whose making takes about 45 s per billion parameters on
        # a rank's core (tiny 0.02 s, mini 0.47, small 5.7: build_workload and AdamW, one thread).
        # Start-up: the first group 2.3 s, each later one 0.03 s (ranks forked from the fork
        # server). A trace pair: mini 1.5 s, small 3.5, medium 7.3 (2026-11-27).
        # A restored build: the default run's 40 builds of mini took 11 s (2026-11-28), 8 of them
        # fresh (a twin and the first other strategy of each workload, on each group: a second
        # each), 32 restored.
        # The first build of a group 1.5 s more: 6 builds of mini (2 restored) took 7-8 s in the
        # test's run, 40 (32 restored) 12 s in the default run (2026-11-28).
        startup_seconds=2.5, later_startup_seconds=0.1, build_seconds=0.55, first_build_seconds=1.5,
        build_seconds_per_gparam=45.0,
        restore_seconds=0.1,
        # REFERENCE's step timed by host_speed on 2026-11-28 (four times: 485 to 498 ms): forward
        # and backward 25.3 GFLOP/s a rank, AdamW 7.9 s per billion parameters (74 ms of mini's step).
        step_seconds=0.02, flops_per_second=25.3e9, optimizer_seconds_per_gparam=7.9, reference_step_seconds=0.495,
        memory_count_steps=4.0, traced_step_steps=1.1, traced_step_seconds_per_gparam=0.0,
        benchmark_seconds=2.0,
        trace_seconds=1.4, trace_seconds_per_gparam=14.0,
        # The 5%-quantiles of 891 rounds over their medians: every test_step of the CPU baseline
        # saved on 2026-11-24 (.benchmarks/gloo-cpu, 0005), mini at batch 4 and 8 x 64 and 128,
        # each strategy and its local twin (3.4% a round).
        round_spread=(0.911, 0.952, 0.966, 0.974, 0.981, 0.985, 0.989, 0.993, 0.996, 0.999, 1.0,
                      1.002, 1.006, 1.01, 1.015, 1.022, 1.03, 1.038, 1.048, 1.064, 1.174),
        # All-reduces (2026-11-28, perf_tests' default 1, 10 and 100 MiB at 2, 4 and 6 ranks): a
        # world size 22 s, 15 of them its rounds, which take their budget (a round's time moves
        # by 0.3 to 4.9 times its median: the 5%-quantiles below, the baseline's 0005 rounds);
        # 2 ranks: 1.7 ms at 1 MiB, 1.56 GB/s of busbw at 100 MiB. The harness's checks
        # (test_harness.py, test_harness_cost.py): 32 s for 4.
        allreduce_seconds=7.0, allreduce_latency_seconds=1.5e-3, allreduce_bus_bytes_per_second=1.56e9,
        allreduce_spread=(0.29, 0.494, 0.61, 0.726, 0.814, 0.872, 0.905, 0.931, 0.956, 0.979, 1.0, 1.021, 1.045,
                          1.072, 1.107, 1.169, 1.262, 1.409, 1.727, 2.452, 4.875),
        check_seconds=8.0,
    ),
    "cuda": PartCosts(
        source="one H200, torch 2.11.0+cu130 (gpu-check, 2026-11-27): xl's bf16 step at 4,096 tokens 207-225 ms; the "
        "first group's start-up 4-5 s, later ones under 1 s; a fresh build of xl 3 s, a memory count 1-1.5 steps, a "
        "trace pair of xl 5 s, a step under the profiler 1.7 steps; its trace's processing 22 us an event as timed on "
        "a CPU (0.75 s a traced step per billion parameters), not yet timed on a GPU",
        # From the time by part of gpu-check's stages on an H200 (docs/gpu-runs/2026-11-27-h200-c):
        # fit (xl b13, b14 x 1024, 1 group): start-up 5 s, builds 6 s for two fresh, memory counts
        # 1 s for two at 0.5 s a step, predictions 6 s for one trace pair; precision (tf32, bf16):
        # start-up 4 s, predictions 10 s for two pairs; layout (3 groups): start-up 4 s.
        startup_seconds=4.5, later_startup_seconds=0.2, build_seconds=1.0, first_build_seconds=0.0,  # in the builds timed
        build_seconds_per_gparam=1.0,
        restore_seconds=None,
        step_seconds=0.02, flops_per_second=256e12, optimizer_seconds_per_gparam=0.0, reference_step_seconds=0.0, memory_count_steps=1.5,
        # A step under the profiler: 240.7 ms against 143.4 timed (xl bf16 2 x 512, 2026-11-27).
        # Its trace, per event, timed on this project's CPU (2026-11-28, a CPU profile of mini's
        # steps, 3,500 events a step): the profiler's stop 3.5 us, the export 3 us, loading 6 us,
        # and reading the traced stage's real H200 trace 9.5 us: 22 us. xl's 6,100 kernels come
        # with about 66,000 events a step: 1.45 s a traced step, 0.75 s per billion parameters.
        traced_step_steps=1.7, traced_step_seconds_per_gparam=0.75, benchmark_seconds=2.0,
        trace_seconds=1.0, trace_seconds_per_gparam=2.0,
        round_spread=H200_ROUNDS,
        # Not measured on two GPUs: NCCL over NVLink taken at a third of two H100s' 450 GB/s a
        # direction and 50 us a call, its rounds as steady as the steps'; a world size's groups
        # (new processes, CUDA contexts, communicators) and checks 5 s. The harness's checks: the
        # H200's harness stage took 25 s, the other checks are small models, 10 s each.
        allreduce_seconds=5.0, allreduce_latency_seconds=50e-6, allreduce_bus_bytes_per_second=150e9,
        allreduce_spread=H200_ROUNDS,
        check_seconds=10.0,
    ),
}


def costs_for(device: str) -> PartCosts:
    return MEASURED["cuda" if device == "cuda" else "cpu"]


@dataclass(frozen=True)
class HostSpeed:
    """What one rank's share of this host sustains now in one workload's step (``host_speed``)."""

    flops_per_second: float
    """Model FLOPs per second of forward and backward."""
    optimizer_seconds_per_gparam: float
    """The optimizer's step and ``zero_grad``, per billion parameters."""
    step_seconds: float
    """The whole step."""
    timing_seconds: float = 0.0
    """How long timing it took here (the run's time too: its parent's, before any group starts)."""


TIMED_STEPS = 4
"""Steps timed on each copy: with two, mini's reference step read 509, 576 and 588 ms on one
quiet host within half an hour (2026-11-28)."""

REFERENCE = StepConfig("local", "mini", 4, 64)
"""The step the CPU's table was measured with (``PartCosts.reference_step_seconds``): timed here
too, its time against the table's says how much slower this host is at everything else. The
grid's own smallest step cannot say it: a small model's step is bound by the host's per-operator
overhead, so its FLOPs rate reads low on any host (tiny's at 2 x 32 reads 4.7 GFLOP/s where
mini's reads about 20), and every price scaled by it would be five times too long."""


def host_speed(config: StepConfig, world_size: int) -> HostSpeed:
    """What one rank's share of this host sustains now, from training steps of ``config``'s
    workload timed here, in the parent, as the ranks will run them: ``world_size`` copies at once
    (as many as the host has cores; past that the ranks take turns on them), each on the threads a
    rank gets (``ddp.launcher.share_cores``). A CPU's speed moves from day to day and with what
    else runs (mini's step at batch 4 x 64 took 190 ms on one day, 480 on another), which a table
    cannot know; and two ranks on two cores each step about 7% slower than one alone (they share
    caches and memory bandwidth). Forward and backward, whose work grows with the tokens, are timed
    apart from the optimizer, whose work grows with the parameters (AdamW reads and writes four
    tensors a parameter whatever the batch: a seventh of mini's step at 4 x 64, a twelfth at 4 x
    128). The medians of each copy's ``TIMED_STEPS`` steps after a first.

    On CUDA nothing is timed here: the rate is the table's (``MEASURED``), since timing a GPU
    would hold a CUDA context in pytest's process through the run."""
    threads, copies, taking_turns = _timing_layout(world_size)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # one thread: each copy's operators run on its own thread
    ready = threading.Barrier(copies)

    def timed_steps(copy: int) -> list[tuple[float, float]]:
        try:
            workload = build_workload(config.model, config.batch_size, config.seq_len, "cpu")
            optimizer = torch.optim.AdamW(workload.module.parameters(), lr=LEARNING_RATE,
                                          **adamw_implementation(config.optimizer))  # the step's own AdamW
            inputs, targets = workload.batch(torch.Generator().manual_seed(config.seed + copy))
            ready.wait()
        except BaseException:
            ready.abort()  # the other copies stop waiting
            raise
        seconds = []
        for _ in range(1 + TIMED_STEPS):
            start = time.perf_counter()
            workload.loss(workload.module(inputs), targets).backward()
            backward = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            seconds.append((backward - start, time.perf_counter() - backward))
        return seconds[1:]

    torch.manual_seed(config.seed)
    began = time.perf_counter()
    try:
        with ThreadPoolExecutor(copies) as pool:
            seconds = np.array([s for steps in pool.map(timed_steps, range(copies)) for s in steps])
    finally:
        torch.set_num_threads(before)
    compute, optimizer = np.median(seconds, axis=0) * taking_turns
    whole = float(np.median(seconds.sum(axis=1))) * taking_turns
    return HostSpeed(step_flops(config) / max(float(compute), 1e-6), float(optimizer) / parameters(config) * 1e9, whole,
                     time.perf_counter() - began)


def _timing_layout(world_size: int) -> tuple[int, int, float]:
    """The threads of each rank (as ``ddp.launcher.share_cores`` gives them), the copies of a step
    timed at once (as many ranks as the cores hold) and how many ranks take turns on each core."""
    cores = os.cpu_count() or 1
    threads = max(1, cores // max(1, world_size))
    copies = max(1, min(world_size, cores // threads))
    return threads, copies, max(1.0, world_size * threads / cores)


def on_this_host(costs: PartCosts, speed: HostSpeed, reference: HostSpeed) -> PartCosts:
    """``costs`` (a CPU's) on this host: every part is the host's CPU work, so each of the table's
    times moves with ``reference`` (``REFERENCE``'s step timed here) against the table's own time
    of that step (a loaded or slower host builds, starts and traces slower too); a step is priced
    at ``speed``, its own workload's rate and optimizer as timed here."""
    return dataclasses.replace(slowed(costs, reference.step_seconds / costs.reference_step_seconds),
                               flops_per_second=speed.flops_per_second,
                               optimizer_seconds_per_gparam=speed.optimizer_seconds_per_gparam)


def slowed(costs: PartCosts, factor: float) -> PartCosts:
    """``costs`` with every time ``factor`` times as long and every rate ``factor`` times lower."""
    times = ("startup_seconds", "later_startup_seconds", "build_seconds", "first_build_seconds", "build_seconds_per_gparam",
             "restore_seconds",
             "step_seconds", "optimizer_seconds_per_gparam", "benchmark_seconds", "trace_seconds",
             "trace_seconds_per_gparam", "allreduce_seconds", "allreduce_latency_seconds", "check_seconds")
    scaled = {name: getattr(costs, name) * factor for name in times if getattr(costs, name) is not None}
    return dataclasses.replace(costs, flops_per_second=costs.flops_per_second / factor,
                               allreduce_bus_bytes_per_second=costs.allreduce_bus_bytes_per_second / factor, **scaled)


def at_run_speed(costs: PartCosts, slowdown: float) -> PartCosts:
    """``costs`` with its steps priced as a run whose ``local`` steps took ``slowdown`` times the
    time they priced (``observed_slowdown``) found them: each step ``slowdown`` times as long, the
    other parts as they were. A host that slows down under a run slows its builds too, but a
    small model's steps (bound by per-operator overhead, which two copies timed in one process
    meet at the interpreter's lock) can read slower or faster than the ranks run them on a host
    whose speed held, and that must not reprice the rest."""
    return dataclasses.replace(costs, flops_per_second=costs.flops_per_second / slowdown,
                               optimizer_seconds_per_gparam=costs.optimizer_seconds_per_gparam * slowdown,
                               step_seconds=costs.step_seconds * slowdown)


def fits_one_process(config: StepConfig, copies: int = 1) -> bool:
    """Whether ``copies`` steps of ``config``'s workload without communication, as
    ``host_speed`` times them in the run's parent, are predicted to fit the host's
    available memory (a model that cannot be predicted is tried): xl's needs 32 GB, which would
    end the parent before any rank started."""
    return too_large(config.local_twin(), 1, host_memory_bytes(copies)) is None


def step_flops(config: StepConfig) -> float:
    """Model FLOPs of one rank's step: the built-in sizes' count, else 6 per parameter per token."""
    tokens = config.step_shape.tokens_per_step
    per_token = workload_flops_per_token(config.model, config.seq_len)
    if per_token is None:
        per_token = 6.0 * parameter_count(config.model, config.batch_size, config.seq_len)
    return per_token * tokens


def priced_step_seconds(costs: PartCosts, config: StepConfig) -> float:
    """A step of ``config`` (its compute, no communication) as ``costs`` price it."""
    return (costs.step_seconds + step_flops(config) / costs.flops_per_second
            + costs.optimizer_seconds_per_gparam * parameters(config) / 1e9)


def observed_slowdown(costs: PartCosts, local_steps: Sequence[tuple[StepConfig, Sequence[float]]]) -> float | None:
    """How many times the time ``costs`` priced them a run's ``local`` steps took: the median, over
    ``local_steps`` (a configuration and its ``local`` twin's rounds), of the rounds' median over
    the twin's priced step. None without rounds. ``estimate_run`` with ``at_run_speed``'s costs
    is the estimate at the speed the run's ranks had: an estimate made before a run cannot know
    that the host will slow down (or that its ranks contend more than its timing saw), and this
    says by how much the run's length moved for that reason and not another."""
    ratios = [statistics.median(rounds) / priced_step_seconds(costs, config.local_twin())
              for config, rounds in local_steps if rounds]
    return statistics.median(ratios) if ratios else None


def parameters(config: StepConfig) -> int:
    return parameter_count(config.model, config.batch_size, config.seq_len)


# The estimate's parts besides the ledger's: the step benchmarks' own ("other"), then what the
# run holds besides its step benchmarks (``Besides``).
OTHER, ALLREDUCES, RACES, CHECKS = "other", "all-reduces", "races", "other tests"


@dataclass(frozen=True)
class Besides:
    """What a run holds besides its step benchmarks, as perf_tests selected it."""

    allreduce_world_sizes: tuple[int, ...] = ()
    """The world sizes whose all-reduces run: each measures every size of the grid together, when
    its first test runs."""
    allreduce_tests: int = 0
    """The all-reduce tests selected."""
    races: tuple[tuple[StepConfig, ...], ...] = ()
    """Each race's contenders (``ddp.bench.rounds.race``), built together on the run's ranks."""
    checks: int = 0
    """The other tests (the harness's own)."""

    @property
    def tests(self) -> int:
        return self.allreduce_tests + len(self.races) + self.checks


@dataclass(frozen=True)
class Estimate:
    """A run's estimated seconds by part (``ddp.bench.rounds.ledger.PARTS``, ``other``, and what
    the run holds besides its step benchmarks)."""

    seconds: dict[str, float]
    benchmarks: int
    costs: PartCosts
    skipped: int = 0
    """Of ``benchmarks``, those predicted not to fit, which the grid skips unbuilt (counted on CPU)."""
    refused: int = 0
    """Of ``benchmarks``, those whose strategy cannot run the shape asked (``cannot_run``), skipped unbuilt."""
    rounds_ceiling_seconds: float = 0.0
    """The rounds if every measurement took its budget (steps noisier than the machine's measured
    rounds never reach their precision target): what the run's length may reach."""
    besides: int = 0
    """The other tests priced (``Besides.tests``)."""

    @property
    def ceiling_seconds(self) -> float:
        """The length with the rounds at their ceiling."""
        return self.total_seconds - self.seconds[ROUNDS] + max(self.seconds[ROUNDS], self.rounds_ceiling_seconds)

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds.values())

    @property
    def step_benchmark_seconds(self) -> float:
        """The whole less the all-reduces, the races' rounds and the other tests (a race's builds,
        warm-up, memory counts and predictions are in the ledger's parts, with the steps')."""
        return self.total_seconds - sum(self.seconds.get(part, 0.0) for part in (ALLREDUCES, RACES, CHECKS))

    def line(self) -> str:
        parts = ", ".join(f"{part} {minutes_text(seconds)}" for part, seconds in self.seconds.items() if seconds >= 0.5)
        skipped = f"; {self.skipped} predicted not to fit, skipped unbuilt" if self.skipped else ""
        if self.refused:
            skipped += f"; {self.refused} cannot run as asked, skipped unbuilt"
        # Said where the budget could add a tenth or more: a noisy machine's run takes that long.
        ceiling = (f", up to {minutes_text(self.ceiling_seconds)} if the steps vary more than the rounds measured there "
                   "and take their budget" if self.ceiling_seconds > 1.1 * self.total_seconds else "")
        what = [f"{self.benchmarks} step benchmark{'s' if self.benchmarks != 1 else ''}"] if self.benchmarks else []
        if self.besides:
            what.append(f"{self.besides}{' other' if what else ''} test{'s' if self.besides != 1 else ''}")
        return (f"estimated length: {minutes_text(self.total_seconds)} for {' and '.join(what)} ({parts}; per-part "
                f"costs measured on {self.costs.source}"
                f"{ceiling}){skipped}")


def estimate_run(configs: Sequence[StepConfig], grid: GridOptions, launch: ResolvedLaunch,
                 besides: Besides = Besides(), costs: PartCosts | None = None) -> Estimate:
    """The estimated length of the step benchmarks of ``configs`` (the selected ones of ``grid``)
    on ``launch``'s ranks, laid out as perf_tests lays them out: ``grid.rank_groups`` groups of
    ranks timing, each configuration with its ``local`` twin (kept built across the strategies of
    its group) under ``--interleave local``, every strategy of a group in the same rounds under
    ``group``; traced on a third group on CUDA, where it was timed on CPU. Then ``besides``: each
    world size's all-reduces on groups of their own (``measure_all_reduces``), each race on the
    run's ranks (its contenders built and timed together, once), and the other tests.

    ``costs``: the prices, given (say, as a run's ranks found them: ``at_run_speed``) instead of
    the table's, on CPU scaled to the host's speed timed here."""
    given = costs is not None
    costs = costs or costs_for(launch.device)
    selected = len(configs)
    # What the grid will skip unbuilt on every device: a shape the strategy cannot run (decided on
    # the meta device, nothing allocated) ...
    configs = [c for c in configs if cannot_run(c) is None]
    runnable = len(configs)
    if launch.device != "cuda":
        # ... and what does not fit (``too_large`` on each rank's share of the host). On CUDA
        # the ranks read their GPU's memory; asking here would hold a CUDA context in this process
        # through the run, so nothing is taken off there.
        share = host_memory_bytes(launch.world_size)
        configs = [c for c in configs if too_large(c, launch.world_size, share) is None]
    timed = [*configs, *(c for contenders in besides.races for c in contenders)]
    timing = 0.0  # the host's timing is the run's too: its parent's, before the first group starts
    if not given and launch.device != "cuda" and timed:  # the host's speed now, from its smallest step
        smallest = min(timed, key=step_flops)
        if fits_one_process(smallest, _timing_layout(launch.world_size)[1]):
            speed = host_speed(smallest, launch.world_size)
            same = (smallest.model, smallest.batch_size, smallest.seq_len, smallest.optimizer) == (
                REFERENCE.model, REFERENCE.batch_size, REFERENCE.seq_len, REFERENCE.optimizer)
            reference = speed if same else host_speed(REFERENCE, launch.world_size)
            timing = speed.timing_seconds + (0.0 if same else reference.timing_seconds)
            costs = dataclasses.replace(on_this_host(costs, speed, reference), source=costs.source + (
                f"; scaled to this host now: {REFERENCE.model}'s step at {REFERENCE.batch_size} x {REFERENCE.seq_len} "
                f"timed here at {reference.step_seconds * 1e3:.0f} ms against the table's "
                f"{costs.reference_step_seconds * 1e3:.0f}, the steps priced at {speed.flops_per_second / 1e9:.1f} "
                f"GFLOP/s a rank as {smallest.model}'s at {smallest.batch_size} x {smallest.seq_len} ran"))
        else:
            costs = dataclasses.replace(costs, source=costs.source + f"; the step's rate not timed here: {smallest.model} "
                                        "at its smallest step is predicted not to fit this host's memory")
    policy = grid.round_options()
    groups = grid.rank_groups
    cuda = launch.device == "cuda"
    seconds = dict.fromkeys([*PARTS, OTHER, ALLREDUCES, RACES, CHECKS], 0.0)
    seconds[OTHER] = timing
    started = groups + (1 if cuda and policy.traced_steps else 0)
    seconds[STARTUP] = costs.startup_seconds + (started - 1) * costs.later_startup_seconds
    seconds[BUILDS] = costs.first_build_seconds * (started if configs else 1 if besides.races else 0)
    traces: dict[tuple, int] = {}  # the trace pairs the predictions make, by fake_step_key

    def step(config: StepConfig) -> float:
        return priced_step_seconds(costs, config)

    # The workloads whose kept copy and a released module wait on the timing groups for the next
    # configuration of that workload (``ddp.bench.rounds.reuse``; priced only where ``restore_seconds``).
    released: set = set()

    def keep_only(built: Sequence[StepConfig]) -> None:
        """A build keeps the copies of the workloads it builds, no other (``RankBench._build``)."""
        released.intersection_update({workload_key(c) for c in built})

    def release(done: Sequence[StepConfig]) -> None:
        """``done`` freed before the next build, its modules kept for the next of their workload."""
        released.update(workload_key(c) for c in done if restorable(c))

    def reuse(measured: Sequence[StepConfig]) -> None:
        """A measurement of nothing restorable turns reuse off, dropping every copy (``GridMeasurer._timed``)."""
        if not any(restorable(c) for c in measured):
            released.clear()

    def build(config: StepConfig, where: int, memory_count: bool = True) -> None:
        """A build on ``where`` groups of ranks, with its warm-up and, where it is timed, one memory
        count (in the first group): from the kept copy where one of its workload was released before."""
        restored = costs.restore_seconds is not None and restorable(config) and workload_key(config) in released
        seconds[BUILDS] += where * (costs.restore_seconds if restored else
                                    costs.build_seconds + costs.build_seconds_per_gparam * parameters(config) / 1e9)
        seconds[WARMUP] += where * max(steps_to_settle(config.strategy), policy.warmup_rounds) * step(config)
        if memory_count:
            seconds[MEMORY_COUNTS] += costs.memory_count_steps * step(config)

    active = len(active_groups(range(groups), policy))  # as ``measure_in_groups`` spreads a measurement's rounds
    shares = [policy] if active == 1 else [group_share(policy, active, index) for index in range(active)]
    ceiling = 0.0  # the rounds, each measurement taking its budget

    def rounds(step_seconds: Sequence[float], benchmarks: int = 1) -> float:
        """One measurement's rounds, over the groups of ranks, with the budget of ``benchmarks``."""
        nonlocal ceiling
        each = sum(step_seconds)
        ceiling += sum(min(share.max_rounds * each, max(share.min_rounds * each, share.budget_seconds * benchmarks))
                       for share in shares)
        return sum(expected_round_seconds(tuple(step_seconds), share, costs.round_spread, benchmarks) for share in shares)

    by_group: dict[StepConfig, list[StepConfig]] = {}
    for config in configs:
        by_group.setdefault(config.group, []).append(config)
    left_built: list[StepConfig] = []  # what the last measurement left built on the timing groups
    for members in by_group.values():
        local = next((c for c in members if c.strategy == FLOOR), None) or members[0].local_twin()
        others = [c for c in members if c.strategy != FLOOR]
        traces.update((fake_step_key(c), parameters(c)) for c in [local, *others])  # the twin is predicted too
        traced = [local, *others] if policy.traced_steps else []
        release(left_built)
        keep_only([local, *others])
        if grid.interleave == "group":  # built together, timed in the same rounds
            reuse([local, *others])
            for config in [local, *others]:
                build(config, groups)
            seconds[ROUNDS] += rounds([step(c) for c in [local, *others]], len(members))
            left_built = [local, *others]
        else:
            paired = grid.interleave != "off"
            alone = not paired and any(c.strategy == FLOOR for c in members)  # local measured on its own
            if paired or alone:
                if alone:
                    reuse([local])
                build(local, groups)
            if alone or not others:
                seconds[ROUNDS] += rounds([step(local)])
                if alone:
                    release([local])
            for config in others:
                measured = [config, local] if paired else [config]
                reuse(measured)
                build(config, groups)
                if paired:  # the kept twin's warm-up before each measurement
                    seconds[WARMUP] += groups * policy.warmup_rounds * step(local)
                seconds[ROUNDS] += rounds([step(c) for c in measured])
                release([config])  # freed before the next build; the twin stays built
            left_built = [local] if paired else []
        for config in traced:
            seconds[TRACED] += policy.traced_steps * (costs.traced_step_steps * step(config)
                                                      + costs.traced_step_seconds_per_gparam * parameters(config) / 1e9)
            if cuda:  # the tracer builds and warms up each configuration on its own ranks
                build(config, 1, memory_count=False)
        seconds[OTHER] += costs.benchmark_seconds * len(members)
    for contenders in besides.races:  # built together on the first group, timed in one measurement
        release(left_built)
        keep_only(contenders)
        left_built = list(contenders)
        settle = max(max(steps_to_settle(c.strategy) for c in contenders), policy.warmup_rounds)
        for config in contenders:
            build(config, 1)
            seconds[WARMUP] += (settle - max(steps_to_settle(config.strategy), policy.warmup_rounds)) * step(config)
        traces.update((fake_step_key(c), parameters(c)) for c in contenders)
        seconds[RACES] += expected_round_seconds(tuple(step(c) for c in contenders), policy,
                                                 costs.round_spread) + costs.benchmark_seconds
    for world_size in besides.allreduce_world_sizes:
        bus = 2 * (world_size - 1) / world_size / costs.allreduce_bus_bytes_per_second
        each = tuple(costs.allreduce_latency_seconds + size * 2**20 * bus for size in grid.allreduce_sizes_mb)
        seconds[ALLREDUCES] += costs.allreduce_seconds + sum(
            expected_round_seconds(each, share, costs.allreduce_spread, len(each)) for share in shares)
    seconds[CHECKS] = costs.check_seconds * besides.checks
    # On CPU the fit decisions above make them, in this process, before the line is printed: the
    # run's time by part then counts them in "other", its predictions finding them made.
    seconds[PREDICTIONS] = sum(costs.trace_seconds + costs.trace_seconds_per_gparam * n / 1e9 for n in traces.values())
    return Estimate(seconds, selected, costs, runnable - len(configs), selected - runnable,
                    rounds_ceiling_seconds=ceiling, besides=besides.tests)


# Simulated measurements the expected rounds average, and the rounds each is followed to before
# its precision is given up on (past it the rounds go on at their mean until the budget or the
# maximum): the estimate moves by about a round between seeds and a grid's takes under a second.
SIMULATED_MEASUREMENTS = 50
SIMULATED_ROUNDS = 60


@dataclass(frozen=True)
class _SimulatedStep:
    seconds: float


@functools.cache
def _simulated_rounds(spread: tuple[float, ...], configs: int, min_rounds: int, max_rounds: int,
                      target_precision: float) -> tuple[tuple[np.ndarray, bool], ...]:
    """Per simulated measurement of ``configs`` configurations, its rounds' relative step times
    (rounds x configs, drawn from ``spread``) until ``timed_rounds``, the run's own loop, with no
    budget, stops on its precision target or its maximum rounds, and whether it stopped (False:
    still going after ``SIMULATED_ROUNDS`` rounds). What a precision is does not depend on the steps'
    times, so one simulation serves every measurement of that many configurations."""
    draws = np.random.default_rng(0)
    values = np.asarray(spread)
    policy = RoundOptions(min_rounds, min(max_rounds, max(min_rounds, SIMULATED_ROUNDS)), 0, target_precision,
                          budget_seconds=float("inf"))
    measurements = []
    for _ in range(SIMULATED_MEASUREMENTS):
        rows: list[np.ndarray] = []

        def run_round(index: int) -> list[list[_SimulatedStep]]:
            rows.append(draws.choice(values, configs))
            return [[_SimulatedStep(float(v)) for v in rows[-1]]]

        _, precision = timed_rounds(run_round, policy)
        measurements.append((np.array(rows), precision <= target_precision or len(rows) >= max_rounds))
    return tuple(measurements)


def expected_round_seconds(step_seconds: tuple[float, ...], policy: RoundOptions, spread: tuple[float, ...],
                           benchmarks: int = 1) -> float:
    """The expected seconds of one measurement's rounds (on one group of ranks) of configurations
    whose steps take ``step_seconds``, with the budget of ``benchmarks`` benchmarks: the rounds of
    ``_simulated_rounds``, each at these times, cut where ``timed_rounds`` would stop them for the
    budget (the first round from the minimum on at which the time spent reaches it)."""
    base = np.asarray(step_seconds, dtype=float)
    budget = policy.budget_seconds * benchmarks
    total = 0.0
    for rows, settled in _simulated_rounds(spread, base.size, policy.min_rounds, policy.max_rounds,
                                           policy.target_precision):
        spent = np.cumsum(rows @ base)
        over = np.nonzero((np.arange(1, spent.size + 1) >= policy.min_rounds) & (spent >= budget))[0]
        if over.size or settled:
            total += spent[over[0]] if over.size else spent[-1]
            continue
        mean = spent[-1] / spent.size  # unsettled past the simulated rounds: on at the mean round
        rounds = min(policy.max_rounds, max(spent.size, math.ceil(budget / mean)))
        total += spent[-1] + (rounds - spent.size) * mean
    return float(total / SIMULATED_MEASUREMENTS)
