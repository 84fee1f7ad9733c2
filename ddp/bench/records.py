"""The saved-run schema: what a step, an all-reduce and a race record in a benchmark's
``extra_info``, written and read here and nowhere else.

Runs are pytest-benchmark JSON (``--benchmark-json``, ``--benchmark-save``, or ``ddp run --json``).
Each benchmark's ``extra_info`` holds a record: ``StepRecord``, ``AllReduceRecord`` or
``RaceRecord``, told apart by their ``kind`` field, with ``schema_version``. The dataclasses below
are the schema: their fields are the keys, documented once, with units. Every consumer (report,
simulate, compare, versus) reads runs through ``load_run``, which fails with one ``RunFileError``
naming the file and saying what to do.

The same module owns the other files ddp-bench saves, each a typed record with ``kind`` and
``schema_version``: the cost model's predictions and validation rows (``ddp simulate --json``,
``--validation-json``: JSON lists of ``PredictionRecord`` / ``ValidationRecord``) and a profile's
figures per strategy (``ddp profile``'s ``summary.json``: ``ProfileSummary``).

Per-round data is saved in the record itself (``round_seconds``), because pytest-benchmark saves
``stats.data`` only with ``--benchmark-save-data``: a comparison needs the rounds for its intervals.

Schema history: 2 added ``kind``, ``model`` (was ``model_size``), the rounds and the 95%
intervals; version 1 records (the first release) are read with those fields missing. 3 lets a
race hold any contenders: ``RaceRecord``'s ``ratio_bucketed_over_torch`` became
``ratio_over_reference`` per contender, with ``contenders`` and ``reference``; version 2 races are
read as bucketed against the reference torch.
4 added the step's numerics (``precision``, ``optimizer``, ``grad_comm``, on races too) and
``model_flops_per_token``, ``achieved_tflops``, ``mfu``: older records were all fp32 with fp32
communication and PyTorch's default AdamW (``foreach`` on GPUs; on CPU, where torch's default is
its per-tensor loop, ``for-loop``); they are read so, the run saying so in ``Run.notes``, and their
FLOPs figures are computed on reading, by the same formula.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from pytest_benchmark import __version__ as pytest_benchmark_version
from pytest_benchmark.stats import Stats
from pytest_benchmark.utils import get_commit_info

from ddp.bench.flops import achieved_tflops, mfu, workload_flops_per_token
from ddp.bench.stats import median_ci, paired_difference_ci, paired_ratio_ci, relative_half_width

SCHEMA_VERSION = 4
# The test file and function whose results step and all-reduce rows stand for: comparisons
# match benchmarks on their names, the same for a pytest run and a torchrun run.
STEP_TEST = "perf_tests/test_step.py::test_step"
# The phases of the one step (``ddp.bench.trainer``), as profiles record and readers name them.
PHASES = ("forward", "backward", "gradient_sync", "optimizer")
ALLREDUCE_TEST = "perf_tests/test_allreduce.py::test_allreduce"


def strategy_label(strategy: str, bucket_size_mb: float | None) -> str:
    """``bucketed 25 MB`` or ``naive``: a strategy as every table, plot and report names it."""
    return strategy if bucket_size_mb is None else f"{strategy} {bucket_size_mb:g} MB"


def file_stem(strategy: str) -> str:
    """A strategy's name as a file name (profiles' traces and timelines): ``pkg.mod:Class`` -> ``pkg.mod-Class``."""
    return strategy.replace(":", "-").replace("/", "-")


class RunFileError(Exception):
    """A file that cannot be read as a saved run; the message names it and says what to do."""


@dataclass(frozen=True)
class StepRecord:
    """One configuration's training step (``ddp.bench.trainer``), timed over rounds."""

    strategy: str
    backend: str
    device: str
    """``cpu`` or the GPU's name."""
    world_size: int
    model: str
    """The workload: an LM size, a named model or ``package.module:build``."""
    num_parameters: int
    batch_size: int
    """Samples per rank."""
    seq_len: int
    bucket_size_mb: float | None
    """Bucket cap in MiB; None for strategies that do not bucket."""
    num_parameter_tensors: int
    num_buckets: int | None
    bucket_sizes_bytes: list[int] | None
    """Gradient bytes of each bucket in launch order; None where the strategy does not say."""
    allreduce_calls_per_step: int | None
    """Collectives per step: the strategy's figure, or counted (None if neither)."""
    bytes_per_step: int
    """Gradient bytes each rank all-reduces per step."""
    step_seconds: float
    """Median over rounds of the slowest rank's step time."""
    step_seconds_ci95: list[float]
    """95% interval of that median (order statistics over rounds)."""
    round_seconds: list[float]
    """Each timed round's step time (slowest rank), in the order run."""
    comm_wait_seconds: float
    """Median over rounds of the slowest rank's wait from its last gradient to gradients synchronized."""
    comm_fraction: float
    """Median over rounds of comm wait / step time."""
    comm_fraction_ci95: list[float]
    tokens_per_second: float
    """Tokens the whole group trains per second at ``step_seconds``."""
    peak_memory_bytes: int | None
    """Peak CUDA memory allocated in a step (None on CPU)."""
    rank_step_seconds: list[float]
    """Each rank's median step time."""
    target_precision: float
    """The relative half-width of the median's interval that rounds were added to reach."""
    reached_precision: float | None
    """The relative half-width reached: above the target when the round budget ran out first
    (None with a single round, which has no interval)."""
    local_round_seconds: list[float] | None = None
    """``local``'s step time in the same rounds, interleaved (None when not paired)."""
    overhead_seconds: float | None = None
    """Median over rounds of (step - local step) in the same round: what synchronizing costs."""
    overhead_seconds_ci95: list[float] | None = None
    overhead_ratio: float | None = None
    """Median over rounds of step / local step in the same round."""
    overhead_ratio_ci95: list[float] | None = None
    precision: str = "fp32"
    """What the step computed in: ``fp32``, ``tf32`` or ``bf16`` (``ddp.bench.trainer``)."""
    optimizer: str = "foreach"
    """AdamW's implementation: ``foreach`` or ``fused`` (``for-loop``: a CPU run saved before
    schema 4, which used torch's default, its per-tensor loop on CPU)."""
    grad_comm: str = "fp32"
    """The dtype gradients were all-reduced in (``bf16``: accumulated back into fp32)."""
    model_flops_per_token: float | None = None
    """Training FLOPs per token, 6 * N + 12 * layers * d_model * seq len (``ddp.bench.flops``);
    None for workloads other than the built-in LM."""
    achieved_tflops: float | None = None
    """Model TFLOP/s per device at ``step_seconds``: FLOPs per token x batch x seq len / step time."""
    mfu: float | None = None
    """``achieved_tflops`` over the device's dense peak in ``precision`` (a fraction); None on CPU
    and on devices not in ``ddp.bench.flops.PEAK_TFLOPS``."""
    kind: str = "step"
    schema_version: int = SCHEMA_VERSION

    @property
    def label(self) -> str:
        """``bucketed 25 MB``, ``bucketed 25 MB bf16 comm`` or ``naive``: the strategy as report columns name it."""
        label = strategy_label(self.strategy, self.bucket_size_mb)
        return label if self.grad_comm == "fp32" else f"{label} {self.grad_comm} comm"

    @property
    def config(self) -> tuple[str, int, int, str]:
        """What a step's time depends on besides the strategy: (model, batch, seq len, ``numerics``).
        Steps of one config are compared with each other, and with its ``local``."""
        return (self.model, self.batch_size, self.seq_len, self.numerics)

    @property
    def numerics(self) -> str:
        """``fp32``, ``bf16``, ``bf16 fused``: what the step computed in, as reports name it."""
        return self.precision if self.optimizer == "foreach" else f"{self.precision} {self.optimizer}"

    @property
    def compute_seconds(self) -> float:
        return max(0.0, self.step_seconds - self.comm_wait_seconds)


@dataclass(frozen=True)
class AllReduceRecord:
    """One all-reduce size on one number of ranks (``ddp.bench.allreduce``)."""

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
    kind: str = "allreduce"
    schema_version: int = SCHEMA_VERSION


@dataclass(frozen=True)
class RaceRecord:
    """Strategies raced on one rank group, a step of each per round (``ddp versus``, ``ddp.bench.race``)."""

    model: str
    parameters: int
    bucket_size_mb: float | None
    """The cap of the contenders that take one."""
    world_size: int
    backend: str
    contenders: list[str]
    """``local`` first, then the contenders in the order raced."""
    reference: str
    """The contender every other is divided by (the last one that communicates: PyTorch's DDP by default)."""
    round_seconds: dict[str, list[float]]
    """Per strategy, each round's step time (slowest rank)."""
    median_step_seconds: dict[str, float]
    median_step_seconds_ci95: dict[str, list[float]]
    ratio_over_reference: dict[str, float]
    """Per contender other than local and the reference, median over rounds of its step / the
    reference's in the same round: below 1, it is faster."""
    ratio_over_reference_ci95: dict[str, list[float]]
    overhead_over_local_seconds: dict[str, float]
    """Per contender other than local, median over rounds of its step minus local's in the same round."""
    overhead_over_local_seconds_ci95: dict[str, list[float]]
    precision: str = "fp32"
    """What the steps computed in (``StepRecord.precision``)."""
    optimizer: str = "foreach"
    grad_comm: str = "fp32"
    """What bucketed and torch all-reduced gradients in."""
    kind: str = "race"
    schema_version: int = SCHEMA_VERSION

    @property
    def primary(self) -> str:
        """The first contender after local: the benchmark's rounds are its rounds."""
        return self.contenders[1]

    @property
    def local_round_seconds(self) -> list[float]:
        """``local``'s rounds, interleaved with the primary's."""
        return self.round_seconds["local"]


# ------------------------------------------------------------------------------------ writing


def step_record(measurement, backend: str, device: str, index: int = 0, local_index: int | None = None) -> StepRecord:
    """The record of configuration ``index`` of a ``ddp.bench.measure.Measurement``, paired with
    ``local_index`` (its local twin in the same rounds) when given."""
    config = measurement.configs[index]
    setup = measurement.setups[index][0]
    rounds = measurement.round_seconds(index)
    waits = measurement.comm_wait_seconds(index)
    step = statistics.median(rounds)
    fractions = [w / s for w, s in zip(waits, rounds) if s > 0]
    paired = {}
    if local_index is not None:
        local = measurement.round_seconds(local_index)
        difference, *difference_ci = paired_difference_ci(rounds, local)
        ratio, *ratio_ci = paired_ratio_ci(rounds, local)
        paired = dict(
            local_round_seconds=local, overhead_seconds=difference, overhead_seconds_ci95=difference_ci,
            overhead_ratio=ratio, overhead_ratio_ci95=ratio_ci,
        )
    sizes = setup.bucket_sizes_bytes
    flops_per_token = workload_flops_per_token(config.model, config.seq_len)
    tflops = achieved_tflops(flops_per_token, config.batch_size * config.seq_len, step)
    return StepRecord(
        strategy=config.strategy, backend=backend, device=device, world_size=len(measurement.setups[index]),
        model=config.model, num_parameters=setup.num_parameters, batch_size=config.batch_size,
        seq_len=config.seq_len, bucket_size_mb=config.bucket_size_mb,
        num_parameter_tensors=setup.num_parameter_tensors,
        num_buckets=None if sizes is None else len(sizes), bucket_sizes_bytes=sizes,
        allreduce_calls_per_step=setup.allreduce_calls_per_step, bytes_per_step=setup.bytes_per_step,
        step_seconds=step, step_seconds_ci95=list(median_ci(rounds)), round_seconds=rounds,
        comm_wait_seconds=statistics.median(waits), comm_fraction=statistics.median(fractions),
        comm_fraction_ci95=list(median_ci(fractions)),
        tokens_per_second=len(measurement.setups[index]) * config.batch_size * config.seq_len / step,
        peak_memory_bytes=measurement.peak_memory_bytes(index),
        rank_step_seconds=[statistics.median(r) for r in measurement.rank_round_seconds(index)],
        target_precision=measurement.target_precision,
        reached_precision=relative_half_width(rounds) if len(rounds) > 1 else None,
        precision=config.precision, optimizer=config.optimizer, grad_comm=config.grad_comm,
        model_flops_per_token=flops_per_token, achieved_tflops=tflops, mfu=mfu(tflops, device, config.precision),
        **paired,
    )


def to_extra_info(record) -> dict:
    """What goes into a benchmark's ``extra_info``: the record's fields, JSON-ready."""
    return dataclasses.asdict(record)


def benchmark_entry(name: str, fullname: str, group: str, param: str, params: dict, record, round_seconds: list[float]) -> dict:
    """One benchmark as pytest-benchmark saves it, for runs written outside pytest (``ddp run``,
    ``ddp versus --json``): its stats computed by pytest-benchmark's own ``Stats`` from the rounds."""
    stats = Stats()
    for seconds in round_seconds:
        stats.update(seconds)
    return {
        "group": group, "name": name, "fullname": fullname, "params": params, "param": param,
        "extra_info": to_extra_info(record),
        "options": {"disable_gc": False, "timer": "slowest_rank_clock", "min_rounds": 1, "max_time": 1.0,
                    "min_time": 5e-06, "warmup": False},
        "stats": {**stats.as_dict(), "data": list(round_seconds), "iterations": 1},
    }


def step_entry(config, record: StepRecord) -> dict:
    """A step benchmark under perf_tests/test_step.py's names (``config`` is its ``StepConfig``), for
    runs written outside pytest: comparisons match it with a pytest run's."""
    return benchmark_entry(
        f"test_step[{config.test_id}]", f"{STEP_TEST}[{config.test_id}]", config.group_name, config.test_id,
        {"step_config": f"UNSERIALIZABLE[{config!r}]"}, record, record.round_seconds,
    )


def allreduce_group_name(backend: str, world_size: int) -> str:
    """The benchmark group of the all-reduces of one backend and world size."""
    return f"all_reduce: {backend}, {world_size} ranks"


def allreduce_entry(record: AllReduceRecord, size_mb: float) -> dict:
    """An all-reduce benchmark under perf_tests/test_allreduce.py's names."""
    param = f"n{record.world_size}-{size_mb:g}mb"
    return benchmark_entry(
        f"test_allreduce[{param}]", f"{ALLREDUCE_TEST}[{param}]", allreduce_group_name(record.backend, record.world_size), param,
        {"allreduce_world_size": record.world_size, "allreduce_size_mb": size_mb}, record, record.round_seconds,
    )


def run_document(machine_info: dict, benchmarks: list[dict]) -> dict:
    """A whole saved run in pytest-benchmark's format, as ``--benchmark-json`` writes it."""
    return {
        "machine_info": machine_info, "commit_info": get_commit_info(), "benchmarks": benchmarks,
        "datetime": datetime.datetime.now(datetime.timezone.utc).isoformat(), "version": pytest_benchmark_version,
    }


def write_new(path: Path, document: dict) -> None:
    """Write a run to ``path``, which must not exist: nothing a user saved is overwritten."""
    if path.exists():
        raise RunFileError(f"{path} exists: give a new path (nothing saved is overwritten)")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=4))


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


@dataclass
class Run:
    """One saved run."""

    path: Path
    machine_info: dict
    commit_info: dict
    datetime: str | None
    benchmarks: list[Benchmark] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """What reading assumed about the file, e.g. the precision of records older than schema 4."""

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


_KINDS = {"step": StepRecord, "allreduce": AllReduceRecord, "race": RaceRecord}


def _kind(info: dict) -> str | None:
    if "kind" in info:
        return info["kind"]
    # schema 1 had no kind: tell its records apart by their keys
    if {"strategy", "comm_wait_seconds"} <= set(info):
        return "step"
    if {"size_bytes", "algbw_gbps"} <= set(info):
        return "allreduce"
    return None  # a schema-1 race lacks what a RaceRecord holds: it is listed with its median only


def _upgrade(kind: str, info: dict, bench: dict) -> dict:
    """An older record with the fields of the current schema it lacks: schema 1's filled from the
    stats, schema 2's race read as bucketed against the reference torch, schema 4's numerics the
    only ones the suite had (fp32, torch's default AdamW, fp32 communication) and its FLOPs figures
    computed."""
    info = dict(info)
    stats = bench["stats"]
    data = stats.get("data")
    if kind == "race" and info.get("schema_version", 1) == 2 and "ratio_bucketed_over_torch" in info:
        info.setdefault("contenders", list(info.get("round_seconds", {})))
        info.setdefault("reference", "torch")
        info.setdefault("ratio_over_reference", {"bucketed": info.pop("ratio_bucketed_over_torch")})
        info.setdefault("ratio_over_reference_ci95", {"bucketed": info.pop("ratio_bucketed_over_torch_ci95", None)})
    if kind in ("step", "race") and info.get("schema_version", 1) < 4:
        info.setdefault("precision", "fp32")
        # AdamW(lr) without foreach=: torch's foreach kernels on CUDA, its per-tensor loop on CPU
        # (a race records no device: gloo is read as CPU, nccl as GPUs)
        on_cpu = info.get("device", "cpu") == "cpu" if kind == "step" else info.get("backend") != "nccl"
        info.setdefault("optimizer", "for-loop" if on_cpu else "foreach")
        info.setdefault("grad_comm", "fp32")
    if kind == "step" and info.get("schema_version", 1) < 4:
        model, seq_len, step = info.get("model") or info.get("model_size"), info.get("seq_len"), info.get("step_seconds")
        if model is not None and seq_len is not None and step is not None:
            flops_per_token = workload_flops_per_token(model, seq_len)
            tflops = achieved_tflops(flops_per_token, info.get("batch_size", 0) * seq_len, step)
            info.setdefault("model_flops_per_token", flops_per_token)
            info.setdefault("achieved_tflops", tflops)
            info.setdefault("mfu", mfu(tflops, info.get("device", "cpu"), "fp32"))
    if kind == "step" and info.get("schema_version", 1) < 2:
        info.setdefault("model", info.pop("model_size", None))
        info.setdefault("round_seconds", data)
        info.setdefault("step_seconds_ci95", list(median_ci(data)) if data else None)
        info.setdefault("comm_fraction_ci95", None)
        info.setdefault("target_precision", None)
        info.setdefault("reached_precision", None)
    elif kind == "allreduce":
        info.setdefault("seconds", stats["median"])
        info.setdefault("seconds_ci95", list(median_ci(data)) if data else None)
        info.setdefault("round_seconds", data)
    info.pop("model_size", None)
    info["schema_version"] = SCHEMA_VERSION
    return info


def _record(path: Path, bench: dict, kind: str):
    cls = _KINDS.get(kind)
    if cls is None:
        raise RunFileError(f"{path}: benchmark {bench['name']!r} has an unknown record kind {kind!r}; upgrade ddp-bench")
    info = bench["extra_info"]
    if info.get("schema_version", 1) > SCHEMA_VERSION:
        raise RunFileError(
            f"{path}: benchmark {bench['name']!r} has schema version {info['schema_version']}, newer than this "
            f"ddp-bench reads ({SCHEMA_VERSION}): upgrade ddp-bench"
        )
    if info.get("schema_version", 1) < SCHEMA_VERSION:
        info = _upgrade(kind, info, bench)
    names = {f.name for f in dataclasses.fields(cls)}
    required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
    missing = sorted(required - set(info))
    if missing:
        raise RunFileError(
            f"{path}: {kind} benchmark {bench['name']!r} lacks extra_info {', '.join(missing)}; the run was "
            "not written by ddp-bench's perf tests or predates that field: rerun the perf tests"
        )
    return cls(**{key: value for key, value in info.items() if key in names})


def load_run(path: str | Path) -> Run:
    """Read one saved run; ``RunFileError`` (saying what to do) if it is not one."""
    path = Path(path)
    return run_from_data(path, _read_json(path))


def run_from_data(path: Path, data: dict) -> Run:
    """A run from pytest-benchmark's JSON structure (read from ``path``, or a session's own)."""
    run = Run(path, data.get("machine_info") or {}, data.get("commit_info") or {}, data.get("datetime"))
    for bench in data["benchmarks"]:
        if not isinstance(bench, dict) or "name" not in bench:
            raise RunFileError(f"{path}: an entry of 'benchmarks' has no name; the file is not pytest-benchmark JSON")
        stats = bench.get("stats")
        if not isinstance(stats, dict) or "median" not in stats:
            raise RunFileError(
                f"{path}: benchmark {bench['name']!r} has no stats.median (was it run with --benchmark-disable?); "
                "rerun the perf tests without --benchmark-disable"
            )
        kind = _kind(bench.get("extra_info") or {})
        record = _record(path, bench, kind) if kind is not None else None
        if kind == "step" and bench["extra_info"].get("schema_version", 1) < 4 and not run.notes:
            run.notes.append(
                f"{path.name}: steps saved before schema 4 do not record their numerics; read as fp32 with fp32 "
                "gradient communication and torch's default AdamW (foreach on GPUs, its per-tensor for-loop on CPU), "
                "the only numerics the suite had then"
            )
        rounds = getattr(record, "round_seconds", None)
        if isinstance(rounds, dict):  # a race: its benchmark's rounds are its primary contender's
            rounds = rounds.get(record.primary)
        if not isinstance(rounds, list):
            rounds = stats.get("data")
        run.benchmarks.append(
            Benchmark(
                name=bench["name"], group=bench.get("group"), median_seconds=float(stats["median"]),
                round_seconds=rounds, record=record,
            )
        )
    if not run.benchmarks:
        raise RunFileError(f"{path} holds no benchmarks; run `pytest perf_tests --benchmark-json PATH` and pass that file")
    return run


def race_record(measurement, backend: str, reference: str) -> RaceRecord:
    """The record of a race (``ddp.bench.race``): ``local`` (configuration 0) and the contenders in the
    same rounds, each divided by ``reference``'s."""
    names = [config.strategy for config in measurement.configs]
    rounds = {name: measurement.round_seconds(index) for index, name in enumerate(names)}
    ratios = {name: paired_ratio_ci(rounds[name], rounds[reference]) for name in names[1:] if name != reference}
    overhead = {name: paired_difference_ci(rounds[name], rounds["local"]) for name in names[1:]}
    caps = [config.bucket_size_mb for config in measurement.configs if config.bucket_size_mb is not None]
    numerics = measurement.configs[names.index(reference)]  # every contender's precision and optimizer
    return RaceRecord(
        model=measurement.configs[0].model, parameters=measurement.setups[0][0].num_parameters,
        bucket_size_mb=caps[0] if caps else None, world_size=len(measurement.setups[0]), backend=backend,
        contenders=names, reference=reference, round_seconds=rounds,
        median_step_seconds={name: statistics.median(r) for name, r in rounds.items()},
        median_step_seconds_ci95={name: list(median_ci(r)) for name, r in rounds.items()},
        ratio_over_reference={name: value[0] for name, value in ratios.items()},
        ratio_over_reference_ci95={name: list(value[1:]) for name, value in ratios.items()},
        overhead_over_local_seconds={name: value[0] for name, value in overhead.items()},
        overhead_over_local_seconds_ci95={name: list(value[1:]) for name, value in overhead.items()},
        precision=numerics.precision, optimizer=numerics.optimizer, grad_comm=numerics.grad_comm,
    )


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
    comm_seconds: float | None = None
    """All-reduce time of the step on the channel, hidden or not (None in files of schema 2 and before)."""
    num_allreduces: int | None = None
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
    measured_comm_wait_seconds: float
    predicted_exposed_comm_seconds: float
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
    """Length of the union of the collectives' intervals."""
    overlap_fraction: float | None
    """Share of ``comm_seconds`` inside backward's compute; None when nothing was communicated."""
    exposed_comm_seconds: float
    overlapped_comm_seconds: float
    comm_source: str
    """Where the communication intervals came from (``ddp.analysis.overlap.COMM_FROM_*``)."""
    slowest_rank: int
    ranks: list[dict]
    """Every rank's figures (``ddp.analysis.overlap.rank_figures``) and its trace file."""
    config: dict
    """The ``ProfileConfig`` profiled."""
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


def load_records(path: str | Path, cls):
    """A JSON list of ``cls`` records written by ``write_records``; files of schema 2 and before
    (plain dicts, no ``kind``) load with the fields they lack at their defaults."""
    path = Path(path)
    try:
        rows = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise RunFileError(f"{path}: not a JSON list of {cls.__name__} ({error})") from None
    names = {f.name for f in dataclasses.fields(cls)}
    try:
        return [cls(**{**{k: v for k, v in row.items() if k in names}, "schema_version": SCHEMA_VERSION}) for row in rows]
    except (TypeError, AttributeError) as error:
        raise RunFileError(f"{path}: not a JSON list of {cls.__name__} ({error})") from None


def write_profile_summary(path: Path, summary: ProfileSummary) -> None:
    path.write_text(json.dumps(dataclasses.asdict(summary), indent=2))


def load_profile_summary(path: str | Path) -> ProfileSummary:
    """``summary.json`` as ``ddp profile`` wrote it."""
    data = json.loads(Path(path).read_text())
    strategies = {name: ProfileRecord(**{"strategy": name, **entry}) for name, entry in data.pop("strategies").items()}
    return ProfileSummary(strategies=strategies, **data)
