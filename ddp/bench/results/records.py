"""The saved-run schema: what a step, an all-reduce and a race record in a benchmark's
``extra_info``, and the other files ddp-bench saves, written and read here and nowhere else.

Runs are pytest-benchmark JSON (``--benchmark-json``, ``--benchmark-save``, or ``ddp run --json``).
Each benchmark's ``extra_info`` holds one record: ``StepRecord``, ``AllReduceRecord`` or
``RaceRecord``, told apart by their ``kind``, with ``schema_version``. The dataclasses below are
the schema: their fields are the keys, documented once, with units. A step's configuration is one
nested object, ``config`` (``ddp.bench.config.step_config.StepConfig``: every axis by name; an axis a file
predates reads at its default), and its training state another, ``memory`` (``StateRecord``).
Every reader (report, simulate, compare, versus) goes through ``load_run``, which fails with one
``RunFileError`` naming the file and saying what to do; a file of another schema version is
refused in one line that names its version.

The same module owns the other files ddp-bench saves, each a typed record with ``kind`` and
``schema_version``: the cost model's predictions and validation rows (``ddp simulate --json``,
``--validation-json``: JSON lists of ``PredictionRecord`` / ``ValidationRecord``) and a profile's
figures per strategy (``ddp profile``'s ``summary.json``: ``ProfileSummary``).

Per-round data is saved in the record itself (``round_seconds``), because pytest-benchmark saves
``stats.data`` only with ``--benchmark-save-data``: a comparison needs the rounds for its intervals.
How the figures are computed from the rounds is ``ddp.bench.rounds.summary``; how a run measured outside
pytest is written as pytest-benchmark JSON is ``ddp.bench.results.benchmark_json``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ddp.bench.config.step_config import AXES, StepConfig
from ddp.strategies.declarations import Sharding
from ddp.strategies.registry import is_floor

SCHEMA_VERSION = 9
# Schema 7 read what bounds a step from its traced steps' timeline (``ddp.bench.collectives.timeline``):
# ``exposed_comm_seconds`` became communication running alone, and the timed rounds' event-based
# figure, which schema 6 saved under that name, is ``sync_wait_seconds``. Schema 8 added what a
# step benchmark cost besides its rounds (``builds``, ``restored_builds``, ``warmup_rounds``,
# ``memory_counts``, ``traced_steps``), why a pair ran without its twin (``unpaired_reason``) and the exact coverage
# of the step's interval (``step_seconds_ci_coverage``). Schema 9 says the dtype a sharded strategy
# gathered and computed in (``compute_dtype``): before it, fsdp and torch_fsdp under bf16 gathered
# fp32 weights, which a record of schema 8 or before reads as (None). Records of schemas 6 to 8 are
# migrated on reading (``_migrate``); nothing is carried under a name whose meaning changed.
MIGRATES_FROM = (6, 7, 8)
EXPOSED_CHANGED_IN = 7
"""Records saved before this schema had no traced exposed communication (``ddp compare`` says so)."""


def strategy_label(strategy: str, bucket_size_mb: float | None) -> str:
    """``bucketed 25 MiB`` or ``naive``: a strategy as tables and plots name it, for records that hold
    no whole configuration (predictions); ``StepConfig.label`` names the others."""
    return strategy if bucket_size_mb is None else f"{strategy} {AXES['bucket_size_mb'].text(bucket_size_mb)}"


def file_stem(strategy: str) -> str:
    """A strategy's name as a file name (profiles' traces and timelines): ``pkg.mod:Class`` -> ``pkg.mod-Class``."""
    return strategy.replace(":", "-").replace("/", "-")


class RunFileError(Exception):
    """A file that cannot be read as a saved run; the message names it and says what to do."""


@dataclass(frozen=True)
class MemoryPrediction:
    """What one rank is predicted to hold at its step's peak (``ddp.bench.memory.predict``), by category, in bytes."""

    parameters_bytes: int
    buffers_bytes: int
    gradients_bytes: int
    optimizer_state_bytes: int
    activations_bytes: int
    temporaries_bytes: int
    communication_bytes: int
    moment: str
    """When the peak falls: ``forward``, ``backward``, ``synchronization``, ``optimizer`` or
    ``gather`` (``ddp.bench.memory.predict.MOMENTS``)."""

    @property
    def total_bytes(self) -> int:
        return sum(self.categories().values())

    def categories(self) -> dict[str, int]:
        """Bytes by category name (``parameters``, ``buffers``, ..., ``communication``)."""
        return {f.name.removesuffix("_bytes"): getattr(self, f.name) for f in fields(self) if f.name.endswith("_bytes")}

    @classmethod
    def from_dict(cls, data: dict) -> MemoryPrediction:
        return cls(**data)


@dataclass(frozen=True)
class CollectiveTiming:
    """One collective of a step (a bucket's, a parameter's, a flat group's all-reduce, the used mask),
    medians over the traced steps of ``CollectiveTrace.rank``, in seconds from the end of backward's
    computation (negative: during backward)."""

    label: str
    """The strategy's name for it (``bucket3``, ``param17``, ``flat0``, ``used_mask``); where only
    the profiler or NCCL's kernels saw it, ``bucket{i}`` by the strategy's plan (its all-reduces
    before the optimizer), else its collective and place in launch order (``broadcast0``: PyTorch's
    DDP's buffers, ``allreduce5``), ``collective{i}`` where nothing says which collective."""
    size_bytes: int
    """Bytes sent (0 where unknown: a collective only the profiler saw)."""
    ready_seconds: float | None
    """When its data was ready to send (None where unknown: NCCL kernels)."""
    launch_seconds: float
    done_seconds: float
    exposed_seconds: float
    """Median over the traced steps of its share of the step's communication alone (no compute
    kernel beside it), instants where several run split equally among them
    (``ddp.bench.collectives.timeline``)."""
    exposed_seconds_ci95: list[float]
    overlapped_seconds: float = 0.0
    """Median over the traced steps of its share of the communication beside compute."""
    phase: str | None = None
    """The phase its launch lay in (``forward``, ``backward``, ``gradient_sync``, ``optimizer``, ...)."""

    @classmethod
    def from_dict(cls, data: dict) -> CollectiveTiming:
        return cls(**data)


@dataclass(frozen=True)
class CollectiveTrace:
    """What bounds the step, from untimed traced steps on ranks that time nothing
    (``ddp.bench.collectives.recording``), on the rank whose traced steps were slowest: the
    partition of the step's window (``ddp.bench.collectives.timeline``: a GPU's timeline on CUDA,
    the training thread's phases and the collectives on CPU), medians over its traced steps, and
    each collective of the step with its times and shares."""

    rank: int
    steps: int
    """Traced steps the medians are over."""
    comm_source: str
    """Where the collectives' times came from (``ddp.bench.collectives.reading.comm_source``: ``collective_records``,
    ``profiler``, ``nccl_kernels`` or ``mixed``)."""
    backward_start_seconds: float
    """When backward started, from the end of its computation (negative)."""
    window_seconds: float
    """The step's window: on CUDA from its first own GPU event to its last, on CPU its phases' span."""
    gpu_compute_seconds: float
    """The step's own compute (kernels on CUDA; the training thread's phases on CPU)."""
    other_steps_seconds: float
    """Other steps' or unowned work alone in the window (CUDA only)."""
    exposed_comm_seconds: float
    """The step's communication with no compute beside it: exposed communication."""
    exposed_comm_seconds_ci95: list[float]
    copy_only_seconds: float
    """Copies alone (CUDA only)."""
    idle_seconds: float
    """Nothing running."""
    host_wait_seconds: float
    """The part of idle where the GPU waited for the host to launch (CUDA only)."""
    comm_seconds: float
    """The union of the step's communication."""
    overlapped_comm_seconds: float
    """Its part beside compute."""
    bound_by: str
    """What bounds the step, by ``bound_by_rule`` (``ddp.bench.collectives.timeline.BOUND_BY``)."""
    bound_by_rule: str
    attributed_seconds: float
    """Median over the traced steps of the collectives' exposed shares added up (= the step's
    exposed communication where each step's collectives were all read)."""
    attributed_seconds_ci95: list[float]
    collectives: list[CollectiveTiming]
    """In launch order."""
    tail: str | None
    """The collective the traced steps most often waited for last (by ``tail_rule``); None if none."""
    tail_rule: str = ""

    @property
    def tail_timing(self) -> CollectiveTiming | None:
        return next((c for c in self.collectives if c.label == self.tail), None)

    @classmethod
    def from_dict(cls, data: dict) -> CollectiveTrace:
        return cls(**{**data, "collectives": [CollectiveTiming.from_dict(c) for c in data["collectives"]]})


@dataclass(frozen=True)
class StateRecord:
    """Each rank's training state after a step, counted as distinct tensor storages
    (``ddp.bench.memory.state``), beside what the strategy's ``Sharding`` says it holds."""

    parameters_bytes: list[int]
    """Each rank's parameters, in bytes (a DTensor's local shard)."""
    gradients_bytes: list[int]
    """Each rank's gradients right after synchronization (buckets in full), in bytes."""
    optimizer_state_bytes: list[int]
    """Each rank's optimizer state (its shard's, for ZeRO and FSDP), in bytes."""
    sharding: Sharding | None
    """What the strategy splits over the ranks; None for a user's class that does not say."""
    tracked_peak_bytes: list[dict[str, int]] | None = None
    """On CPU, each rank's measured peak: PyTorch's ``MemTracker`` over untimed steps, bytes by its
    category at the moment the total peaked, and ``Total`` (``ddp.bench.memory.state.tracked_peak``);
    None on CUDA (``StepRecord.peak_memory_bytes`` is the measured peak there)."""

    @property
    def formula(self) -> str | None:
        """Bytes a parameter on each rank by ``sharding``, e.g. ``4 + 4 + 8/N``."""
        return None if self.sharding is None else self.sharding.formula

    def formula_bytes(self, num_parameters: int, world_size: int) -> dict[str, float] | None:
        """The formula for a model and world size: bytes per rank of ``parameters``, ``gradients``,
        ``optimizer_state`` and their ``total`` (fp32 weights, AdamW; trainable parameters only)."""
        if self.sharding is None:
            return None
        return {kind: size * num_parameters for kind, size in self.sharding.bytes_per_parameter(world_size).items()}

    def rank_total(self, rank: int) -> int:
        return self.parameters_bytes[rank] + self.gradients_bytes[rank] + self.optimizer_state_bytes[rank]


@dataclass(frozen=True)
class StepRecord:
    """One configuration's training step (``ddp.bench.rounds.trainer``), timed over rounds."""

    config: StepConfig
    """What was trained: strategy, model, batch per rank, sequence length, bucket cap, precision, ..."""
    backend: str
    device: str
    """``cpu`` or the GPU's name."""
    world_size: int
    num_parameters: int
    """Trainable parameters of the model (a tied weight counts once)."""
    num_parameter_tensors: int
    num_buckets: int | None
    bucket_sizes_bytes: list[int] | None
    """Gradient bytes of each bucket in launch order; None where the strategy does not say."""
    collectives_per_step: int | None
    """Collectives one step launches: the strategy's ``num_allreduce_calls_per_step``, or counted
    in a warm-up step (None if neither)."""
    bytes_per_step: int
    """Gradient bytes each rank all-reduces per step."""
    step_seconds: float
    """Median over rounds of the slowest rank's step time."""
    step_seconds_ci95: list[float]
    """95% interval of that median (order statistics over rounds)."""
    round_seconds: list[float]
    """Each timed round's step time (slowest rank), in the order run."""
    rank_step_seconds: list[float]
    """Each rank's median step time."""
    sync_wait_seconds: float
    """Median over timed rounds of the slowest rank's wait from the end of backward's computation to
    gradients synchronized (``ddp.bench.rounds.trainer``): on CUDA the gap between two events, which
    where the GPU waits on the host is the host's launch gap (read it beside ``bound_by``); it
    leaves out communication outside that wait (FSDP's all-gathers, ZeRO's broadcasts)."""
    sync_wait_fraction: float
    """Median over rounds of that wait / step time."""
    sync_wait_fraction_ci95: list[float]
    tokens_per_second: float
    """Tokens the whole group trains per second at ``step_seconds``."""
    target_precision: float
    """The relative half-width of the median's interval that rounds were added to reach."""
    reached_precision: float | None
    """The relative half-width reached: above the target when the round budget ran out first
    (None with a single round, which has no interval)."""
    local_round_seconds: list[float] | None = None
    """``local``'s step time in the same rounds, interleaved (None when not paired)."""
    tokens_per_step: int | None = None
    """Tokens one rank trains in a step, over its micro-batches: grad accum x batch x seq len
    (``ddp.bench.config.shape.StepShape.tokens_per_step``); None in files saved before it was recorded."""
    round_groups: list[int] | None = None
    """Per round, the group of ranks (fresh processes) it ran in, 0 to groups - 1
    (``ddp.bench.rounds.spread.measure_in_rank_groups``): the intervals of ``step_seconds``, of the
    comparison with another run and ``reached_precision`` are two-level bootstraps over them
    (``ddp.bench.results.stats``). All 0: one group (a torchrun run, ``--rank-groups 1``), from which the
    regression gate calls no slowdown; None in files saved before groups were recorded (read as one)."""
    overhead_seconds: float | None = None
    """Median over rounds of (step - local step) in the same round: what synchronizing costs."""
    overhead_seconds_ci95: list[float] | None = None
    overhead_ratio: float | None = None
    """Median over rounds of step / local step in the same round."""
    overhead_ratio_ci95: list[float] | None = None
    model_flops_per_token: float | None = None
    """Training FLOPs per token, 6 * N + 12 * layers * d_model * seq len (``ddp.bench.results.flops``);
    None for workloads other than the built-in LM."""
    achieved_tflops: float | None = None
    """Model TFLOP/s per device at ``step_seconds``: FLOPs per token x ``tokens_per_step`` / step time."""
    mfu: float | None = None
    """``achieved_tflops`` over the device's dense peak in the step's precision (a fraction); None
    on CPU and on devices not in ``ddp.bench.results.flops.PEAK_TFLOPS``."""
    local_mfu: float | None = None
    """The MFU of the ``local`` twin in the same rounds, at its median step: the step without
    communication (None where ``mfu`` is, or the step was not paired with local)."""
    mfu_lost_points: float | None = None
    """Median over paired rounds of local's MFU minus this step's, in percentage points: what
    synchronization costs in MFU."""
    mfu_lost_points_ci95: list[float] | None = None
    peak_memory_bytes: list[int] | None = None
    """Each rank's CUDA allocator peak over the timed rounds; None on CPU."""
    memory: StateRecord | None = None
    """Each rank's training state, counted in an untimed step after warm-up."""
    predicted_memory: MemoryPrediction | None = None
    """The peak memory per rank predicted before anything was built (``ddp.bench.memory.predict``), by
    category and moment of the step; None where the model's step could not be traced."""
    collectives: CollectiveTrace | None = None
    """What bounds the step and each collective's times and shares, from traced steps on ranks that
    time nothing; None where none ran (``--traced-steps 0``, or out of memory under the profiler)."""
    exposed_comm_seconds: float | None = None
    """The traced steps' median communication alone (``collectives.exposed_comm_seconds``), every
    strategy's and all of it (FSDP's all-gathers, ZeRO's broadcasts); None where none was traced."""
    bound_by: str | None = None
    """What bounds the step (``collectives.bound_by``): ``host``, ``compute``, ``communication`` or
    ``copies``; None where none was traced. MFU and comparisons of a ``host``-bound step measure the host."""
    step_seconds_ci_coverage: float | None = None
    """The exact coverage of ``step_seconds_ci95`` (``ddp.bench.results.stats.median_ci_coverage``):
    at least 0.95 from 6 rounds up; below it from fewer, where the interval is flagged. None where
    the interval is two-level (rounds from groups of ranks: bootstrap, nominal 95%) or the record
    predates schema 8."""
    builds: int | None = None
    """Builds of this configuration over every group of ranks, the tracer's included
    (``ddp.bench.rounds.ledger``); None where not counted (``ddp run``, saved before schema 8)."""
    restored_builds: int | None = None
    """Those of ``builds`` whose model came from a kept copy (``ddp.bench.rounds.reuse``), not built."""
    warmup_rounds: int | None = None
    """Untimed steps of this configuration before its timed or traced ones, over every group."""
    memory_counts: int | None = None
    """Steps of this configuration whose training state was counted (``Trainer.count_setup``)."""
    traced_steps: int | None = None
    """Traced steps of this configuration (``collectives``)."""
    seconds_by_part: dict[str, float] | None = None
    """What this configuration cost the run, in seconds, by part of ``ddp.bench.rounds.ledger.PARTS``
    (its builds, warm-up, memory counts, rounds and traced steps over every group of ranks; a part
    it took no time in is left out): the next run's ``estimated length:`` adds these up. None where
    not counted (``ddp run``, saved before it was recorded)."""
    compute_dtype: str | None = None
    """The dtype a sharded strategy gathered its parameters and computed in, FSDP's compute dtype
    (``bfloat16`` under ``--precision bf16``: ``ddp.bench.config.values.sharded_compute_dtype``);
    None where the parameters computed in their own dtype (every other strategy and precision, and
    every record saved before schema 9)."""
    unpaired_reason: str | None = None
    """Why this step ran without its ``local`` twin in its rounds where the grid pairs them (no
    overhead figure then); None where paired or where the grid does not pair."""
    migrated_from: int | None = None
    """The schema version the record was saved in, where it was migrated on reading (``_migrate``)."""
    kind: str = "step"
    schema_version: int = SCHEMA_VERSION

    @property
    def strategy(self) -> str:
        return self.config.strategy

    @property
    def label(self) -> str:
        """``bucketed 25 MiB``, ``bucketed 25 MiB bf16 comm`` or ``naive``: the strategy as report columns name it."""
        return self.config.label

    @property
    def group(self) -> StepConfig:
        """What a step's time depends on besides the strategy (its ``local`` twin): steps of one
        group are compared with each other, and with its ``local``."""
        return self.config.group

    @property
    def benchmark_seconds(self) -> float | None:
        """What this benchmark cost the run, in seconds: its parts added up (None where not counted)."""
        return None if self.seconds_by_part is None else sum(self.seconds_by_part.values())

    @property
    def exposed_comm_fraction(self) -> float | None:
        """Exposed communication as a share of the step it was measured in: the traced steps'
        median exposed communication over their median window (``collectives.window_seconds``),
        never over the timed rounds' median, whose steps ran apart from the traced ones (a
        traced step on CPU may take longer than a timed one); None where none was traced."""
        if self.exposed_comm_seconds is None or self.collectives is None or self.collectives.window_seconds <= 0:
            return None
        return min(1.0, self.exposed_comm_seconds / self.collectives.window_seconds)

    @property
    def waited_seconds(self) -> float:
        """What the timed step spent on communication not hidden: its median times the traced
        steps' exposed share (``exposed_comm_fraction``) where traced, else the timed rounds'
        wait for gradients."""
        share = self.exposed_comm_fraction
        return self.sync_wait_seconds if share is None else share * self.step_seconds

    @property
    def compute_seconds(self) -> float:
        """The timed step's median less ``waited_seconds``: the rest, by the same shares."""
        return max(0.0, self.step_seconds - self.waited_seconds)

    @property
    def measured_peak_bytes(self) -> int | None:
        """The largest rank's measured peak: CUDA's allocator peak, else ``MemTracker``'s on CPU."""
        if self.peak_memory_bytes:
            return max(self.peak_memory_bytes)
        tracked = self.memory.tracked_peak_bytes if self.memory is not None else None
        return max(peak["Total"] for peak in tracked) if tracked else None


@dataclass(frozen=True)
class AllReduceRecord:
    """One all-reduce size on one number of ranks (``ddp.bench.rounds.allreduce``)."""

    backend: str
    world_size: int
    size_bytes: int
    seconds: float
    """Median over rounds of the slowest rank's all-reduce."""
    seconds_ci95: list[float]
    round_seconds: list[float]
    algbw_gbps: float
    busbw_gbps: float
    wrong: int
    """Elements that held a wrong sum afterwards, over every round (must be 0)."""
    round_groups: list[int] | None = None
    """Per round, the group of ranks it ran in, as ``StepRecord.round_groups``."""
    benchmark_seconds: float | None = None
    """What this benchmark's test cost the run, in seconds (the first size of a world size measures
    them all, groups of ranks started included); None where not counted."""
    kind: str = "allreduce"
    schema_version: int = SCHEMA_VERSION


@dataclass(frozen=True)
class RaceRecord:
    """Strategies raced on one rank group, a step of each per round (``ddp versus``, ``ddp.bench.rounds.race``)."""

    configs: list[StepConfig]
    """Each contender's configuration, ``local``'s first: one model, batch, sequence length and
    options, each contender with its members (the bucket cap where it takes one)."""
    num_parameters: int
    world_size: int
    backend: str
    contenders: list[str]
    """``local`` first, then the contenders in the order raced."""
    reference: str
    """The contender every other is divided by (the last one that communicates: PyTorch's DDP by default)."""
    round_seconds: dict[str, list[float]]
    """Per strategy, each round's step time (slowest rank)."""
    step_seconds: dict[str, float]
    """Per strategy, the median of its rounds."""
    step_seconds_ci95: dict[str, list[float]]
    ratio_over_reference: dict[str, float]
    """Per contender other than local and the reference, median over rounds of its step / the
    reference's in the same round: below 1, it is faster."""
    ratio_over_reference_ci95: dict[str, list[float]]
    overhead_over_local_seconds: dict[str, float]
    """Per contender other than local, median over rounds of its step minus local's in the same round."""
    overhead_over_local_seconds_ci95: dict[str, list[float]]
    benchmark_seconds: float | None = None
    """What the race's test cost the run, in seconds; None where not counted (``ddp versus``)."""
    kind: str = "race"
    schema_version: int = SCHEMA_VERSION

    @property
    def primary(self) -> str:
        """The first contender after the floors: the benchmark's rounds are its rounds."""
        return next(name for name in self.contenders if not is_floor(name))

    @property
    def config(self) -> StepConfig:
        """The reference's configuration: what every contender shares, and its members."""
        return self.configs[self.contenders.index(self.reference)]

    @property
    def model(self) -> str:
        return self.configs[0].model

    @property
    def bucket_size_mb(self) -> float | None:
        """The cap of the contenders that take one."""
        return next((c.bucket_size_mb for c in self.configs if c.bucket_size_mb is not None), None)

    @property
    def local_round_seconds(self) -> list[float]:
        """``local``'s rounds, interleaved with the primary's."""
        return self.round_seconds[self.contenders[0]]


def to_extra_info(record) -> dict:
    """What goes into a benchmark's ``extra_info``: the record's fields, JSON-ready (the nested
    configuration and state as objects)."""
    return dataclasses.asdict(record)


# ------------------------------------------------------------------------------------ reading


@dataclass
class Benchmark:
    """One benchmark of a saved run, as every reader sees it."""

    name: str
    group: str | None
    median_seconds: float
    round_seconds: list[float] | None
    """The rounds, from the record or pytest-benchmark's ``stats.data``; None if neither was saved."""
    record: StepRecord | AllReduceRecord | RaceRecord | None
    """None for a benchmark that is not ddp-bench's."""
    seconds: float | None = None
    """What the benchmark cost the run that saved it (its record's ``benchmark_seconds``, or the
    same key of a benchmark that has no record, such as the harness's cost); None where not counted."""


RUN_KEY = "ddp_bench_run"
"""The key of a saved run's JSON (beside pytest-benchmark's own) that holds what the run says of
itself: ``run_seconds``, its whole length, and ``rounds``, the ``RoundOptions`` it was asked for."""


@dataclass
class Run:
    """One saved run."""

    path: Path
    machine_info: dict
    commit_info: dict
    datetime: str | None
    benchmarks: list[Benchmark] = field(default_factory=list)
    run_info: dict = field(default_factory=dict)
    """``RUN_KEY``'s entry: the run's length and rounds (empty for a run saved before it was recorded)."""

    @property
    def steps(self) -> list[StepRecord]:
        return [b.record for b in self.benchmarks if isinstance(b.record, StepRecord)]

    @property
    def allreduces(self) -> list[AllReduceRecord]:
        return [b.record for b in self.benchmarks if isinstance(b.record, AllReduceRecord)]

    @property
    def races(self) -> list[RaceRecord]:
        return [b.record for b in self.benchmarks if isinstance(b.record, RaceRecord)]

    @property
    def others(self) -> list[Benchmark]:
        return [b for b in self.benchmarks if b.record is None]

    def by_name(self) -> dict[str, Benchmark]:
        return {b.name: b for b in self.benchmarks}

    @property
    def backend(self) -> str | None:
        return (self.machine_info.get("ddp_bench") or {}).get("backend")

    @property
    def device(self) -> str | None:
        return (self.machine_info.get("ddp_bench") or {}).get("device")


_HINT = "pass a file written by `pytest perf_tests --benchmark-json PATH`, --benchmark-save (under .benchmarks/) or `ddp run --json`"


def _read_json(path: Path) -> dict:
    if not path.exists():
        raise RunFileError(f"{path}: no such file; {_HINT}")
    if path.is_dir():
        raise RunFileError(f"{path} is a directory; {_HINT}, e.g. .benchmarks/gloo-cpu/*/0001_*.json")
    try:
        data = json.loads(path.read_text())
    except UnicodeDecodeError:
        raise RunFileError(f"{path} is not a text file, let alone pytest-benchmark JSON; {_HINT}") from None
    except json.JSONDecodeError as error:
        raise RunFileError(f"{path} is not JSON ({error.msg} at line {error.lineno}, column {error.colno}); {_HINT}") from None
    if not isinstance(data, dict) or not isinstance(data.get("benchmarks"), list):
        raise RunFileError(f"{path} is JSON but not a pytest-benchmark run (it has no 'benchmarks' list); {_HINT}")
    return data


# What a schema 6 step record's keys are called in schema 7; None: not carried (its meaning changed).
_RENAMED_IN_7 = {"exposed_comm_seconds": "sync_wait_seconds", "exposed_comm_fraction": "sync_wait_fraction",
                 "exposed_comm_fraction_ci95": "sync_wait_fraction_ci95", "collectives": None}


def _migrate(info: dict, version: int) -> dict:
    """A record of a schema in ``MIGRATES_FROM`` as one of this schema. From 6: a step's timed
    wait, saved as ``exposed_comm_*``, is ``sync_wait_*``; its traced collectives, whose exposed
    figures were the window from backward's end to the optimizer's start, are dropped: such a
    record has no exposed communication nor ``bound_by``. From 7: schema 8's fields are None (not
    counted). From 8: ``compute_dtype`` is None, what those steps ran. Other records are unchanged."""
    if info.get("kind") == "step":
        if version < EXPOSED_CHANGED_IN:
            info = {_RENAMED_IN_7.get(key, key): value for key, value in info.items()
                    if _RENAMED_IN_7.get(key, key) is not None}
        info = {**info, "migrated_from": version}
    return {**info, "schema_version": SCHEMA_VERSION}


def _step(info: dict) -> StepRecord:
    memory = info.get("memory")
    if memory is not None:
        sharding = memory.get("sharding")
        memory = StateRecord(**{**memory, "sharding": None if sharding is None else Sharding(**sharding)})
    predicted = info.get("predicted_memory")
    collectives = info.get("collectives")
    return StepRecord(**{**info, "config": StepConfig.from_dict(info["config"]), "memory": memory,
                         "predicted_memory": None if predicted is None else MemoryPrediction.from_dict(predicted),
                         "collectives": None if collectives is None else CollectiveTrace.from_dict(collectives)})


def _race(info: dict) -> RaceRecord:
    return RaceRecord(**{**info, "configs": [StepConfig.from_dict(config) for config in info["configs"]]})


_KINDS = {"step": (StepRecord, _step), "allreduce": (AllReduceRecord, lambda info: AllReduceRecord(**info)),
          "race": (RaceRecord, _race)}


def _record(path: Path, bench: dict) -> StepRecord | AllReduceRecord | RaceRecord | None:
    info = bench.get("extra_info") or {}
    kind = info.get("kind")
    if kind is None and not {"strategy", "size_bytes", "contenders"} & set(info):
        return None  # not a ddp-bench benchmark: listed with its median only
    version = info.get("schema_version", 1)
    if version in MIGRATES_FROM:
        info, version = _migrate(info, version), SCHEMA_VERSION
    if version != SCHEMA_VERSION:
        newer = version > SCHEMA_VERSION
        raise RunFileError(
            f"{path}: benchmark {bench['name']!r} was saved in ddp-bench's schema {version}, this ddp-bench reads "
            f"schema {SCHEMA_VERSION}: " + ("upgrade ddp-bench" if newer else
                                             "rerun the perf tests to save it again, or read it with the ddp-bench that wrote it")
        )
    if kind not in _KINDS:
        raise RunFileError(f"{path}: benchmark {bench['name']!r} has an unknown record kind {kind!r}; upgrade ddp-bench")
    cls, build = _KINDS[kind]
    missing = sorted(f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING and f.name not in info)
    if missing:
        raise RunFileError(f"{path}: {kind} benchmark {bench['name']!r} lacks extra_info {', '.join(missing)}; the run was "
                           "not written by ddp-bench's perf tests: rerun them")
    try:
        return build(info)
    except (TypeError, ValueError) as error:
        raise RunFileError(f"{path}: {kind} benchmark {bench['name']!r} is not a schema {SCHEMA_VERSION} record ({error}): "
                           "rerun the perf tests") from None


def load_run(path: str | Path) -> Run:
    """Read one saved run; ``RunFileError`` (saying what to do) if it is not one."""
    path = Path(path)
    return run_from_data(path, _read_json(path))


def run_from_data(path: Path, data: dict) -> Run:
    """A run from pytest-benchmark's JSON structure (read from ``path``, or a session's own)."""
    run = Run(path, data.get("machine_info") or {}, data.get("commit_info") or {}, data.get("datetime"),
              run_info=data.get(RUN_KEY) or {})
    for bench in data["benchmarks"]:
        if not isinstance(bench, dict) or "name" not in bench:
            raise RunFileError(f"{path}: an entry of 'benchmarks' has no name; the file is not pytest-benchmark JSON")
        stats = bench.get("stats")
        if not isinstance(stats, dict) or "median" not in stats:
            raise RunFileError(
                f"{path}: benchmark {bench['name']!r} has no stats.median (was it run with --benchmark-disable?); "
                "rerun the perf tests without --benchmark-disable"
            )
        record = _record(path, bench)
        rounds = getattr(record, "round_seconds", None)
        if isinstance(rounds, dict):  # a race: its benchmark's rounds are its primary contender's
            rounds = rounds.get(record.primary)
        if not isinstance(rounds, list):
            rounds = stats.get("data")
        seconds = getattr(record, "benchmark_seconds", None) if record is not None else \
            (bench.get("extra_info") or {}).get("benchmark_seconds")
        run.benchmarks.append(
            Benchmark(name=bench["name"], group=bench.get("group"), median_seconds=float(stats["median"]),
                      round_seconds=rounds, record=record, seconds=seconds)
        )
    if not run.benchmarks:
        raise RunFileError(f"{path} holds no benchmarks; run `pytest perf_tests --benchmark-json PATH` and pass that file")
    return run


# ------------------------------------------------------------------------------------ predictions and profiles


@dataclass(frozen=True)
class PredictionRecord:
    """One training step predicted by the cost model (``ddp.analysis.costmodel``, ``ddp simulate --json``)."""

    strategy: str
    bucket_size_mb: float | None
    batch_size: int
    seq_len: int
    world_size: int
    step_seconds: float
    exposed_comm_seconds: float
    """What communication adds after backward ends."""
    comm_seconds: float
    """Collective time of the step on the channel, hidden or not."""
    collectives_per_step: int
    compute_seconds: float = 0.0
    """The step without communication; ``step_seconds`` adds the terms below and ``exposed_comm_seconds``
    (``ddp.analysis.costmodel.StepTerms``)."""
    fixed_step_seconds: float = 0.0
    """What the implementation adds once a step (hooks, bucket copies), calibrated on measured steps."""
    fixed_collective_seconds: float = 0.0
    """What its collectives add beyond the link's schedule (launches), all of them together."""
    rank_wait_seconds: float = 0.0
    """Waiting for the slowest rank."""
    overlap_slowdown_seconds: float = 0.0
    """Compute lost to communication overlapped with it."""
    kind: str = "prediction"
    schema_version: int = SCHEMA_VERSION

    @property
    def label(self) -> str:
        return strategy_label(self.strategy, self.bucket_size_mb)


@dataclass(frozen=True)
class ValidationRecord:
    """A measured step beside the cost model's prediction at the run's world size (``ddp simulate``)."""

    strategy: str
    bucket_size_mb: float | None
    batch_size: int
    seq_len: int
    measured_step_seconds: float
    predicted_step_seconds: float
    error: float
    """predicted / measured - 1."""
    measured_exposed_comm_seconds: float
    predicted_exposed_comm_seconds: float
    fixed_step_from: str = "none"
    """Where the prediction's fixed cost per step was fitted (``ddp.analysis.costmodel.PairedFixedSteps``):
    ``other shapes`` of the same configuration (held out), ``this row`` (measured at no other
    shape: its error is 0 by construction), or ``none`` (no fixed step: ``local``)."""
    kind: str = "validation"
    schema_version: int = SCHEMA_VERSION

    @property
    def label(self) -> str:
        return strategy_label(self.strategy, self.bucket_size_mb)


@dataclass(frozen=True)
class ProfileRecord:
    """One strategy profiled by ``ddp profile`` (``ddp.analysis.overlap.strategy_summary``): the
    slowest rank's figures, each per step, and every rank's."""

    strategy: str
    step_seconds: float
    comm_seconds: float
    """Length of the union of the collectives' intervals (``ddp.bench.collectives.timeline``)."""
    overlap_fraction: float | None
    """Share of ``comm_seconds`` beside compute; None when nothing was communicated."""
    exposed_comm_seconds: float
    """Communication with no compute beside it."""
    overlapped_comm_seconds: float
    comm_source: str
    """Where the communication intervals came from (``ddp.bench.collectives.reading.comm_source``: ``collective_records``,
    ``profiler``, ``nccl_kernels`` or ``mixed``)."""
    slowest_rank: int
    ranks: list[dict]
    """Every rank's figures (``ddp.analysis.overlap.rank_figures``) and its trace file."""
    bound_by: str | None
    """What bounds the slowest rank's step (``ddp.bench.collectives.timeline.BOUND_BY_RULE``)."""
    config: dict
    """The ``ProfileConfig`` profiled: its step's configuration (``step``), warm-up and profiled steps, folder."""
    timeline_json: str
    timeline_png: str
    kind: str = "profile"
    schema_version: int = SCHEMA_VERSION


@dataclass(frozen=True)
class ProfileSummary:
    """``summary.json`` of ``ddp profile``."""

    world_size: int
    backend: str
    device: str
    strategies: dict[str, ProfileRecord]
    timeline_combined_png: str | None = None
    schema_version: int = SCHEMA_VERSION


def write_records(path: Path, records) -> None:
    """A JSON list of records (predictions, validation rows)."""
    path.write_text(json.dumps([dataclasses.asdict(record) for record in records], indent=2))


def _check_version(path: Path, rows: list[Any], what: str) -> None:
    versions = sorted({row.get("schema_version") for row in rows if isinstance(row, dict)} - {SCHEMA_VERSION}, key=str)
    if versions:
        raise RunFileError(f"{path}: {what} saved in ddp-bench's schema {versions[0]}, this ddp-bench reads schema "
                           f"{SCHEMA_VERSION}: write it again with this ddp-bench")


def load_records(path: str | Path, cls):
    """A JSON list of ``cls`` records written by ``write_records``."""
    path = Path(path)
    try:
        rows = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise RunFileError(f"{path}: not a JSON list of {cls.__name__} ({error})") from None
    if not isinstance(rows, list):
        raise RunFileError(f"{path}: not a JSON list of {cls.__name__}")
    _check_version(path, rows, f"a list of {cls.__name__}")
    try:
        return [cls(**row) for row in rows]
    except TypeError as error:
        raise RunFileError(f"{path}: not a JSON list of {cls.__name__} ({error})") from None


def write_profile_summary(path: Path, summary: ProfileSummary) -> None:
    path.write_text(json.dumps(dataclasses.asdict(summary), indent=2))


def load_profile_summary(path: str | Path) -> ProfileSummary:
    """``summary.json`` as ``ddp profile`` wrote it."""
    path = Path(path)
    data = json.loads(path.read_text())
    _check_version(path, [data], "a profile summary")
    strategies = {name: ProfileRecord(**{"strategy": name, **entry}) for name, entry in data.pop("strategies").items()}
    return ProfileSummary(strategies=strategies, **data)
