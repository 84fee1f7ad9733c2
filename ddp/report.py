"""``python -m ddp report RUN.json [RUN2.json ...] --out DIR``: tables, plots and commentary from
saved pytest-benchmark runs of ``perf_tests/``.

This file owns reading saved runs (``load_run``), the figures a report derives from them
(overheads over ``local``, winners, bucket plans, run-to-run ratios, machine differences) and
``DIR/report.md``; the plots are drawn by ddp/plots.py. Nothing here reruns or parses printed
output: every number comes from the JSON that ``--benchmark-json`` or ``--benchmark-autosave``
wrote (``.benchmarks/<backend>-<device>/.../NNNN_name.json``).

Benchmarks are told apart by their ``extra_info`` keys, not by their names: a step benchmark
records ``strategy`` and ``comm_wait_seconds`` (ddp/benchmark.py ``extra_info``), an all-reduce
benchmark ``size_bytes`` and ``algbw_gbps`` (perf_tests/test_allreduce.py). Anything else is
listed with its median only.

Time per step is pytest-benchmark's median round: one training step on every rank, until the
slowest rank has returned (it includes the launcher's round trip, which the perf run's
"harness overhead" line measures). ``comm_wait_seconds`` (from the last gradient backward
produced to gradients synchronized, slowest rank, median over rounds) is the communication
that the step could not hide; compute is the rest.

With several runs, the last one is reported in full and every earlier one is compared with it,
benchmark by benchmark (matched by name, ratio last / earlier).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from tabulate import tabulate

BYTES_PER_MB = 2**20  # bucket caps count MiB, as ddp/bucketed.py and PyTorch's bucket_cap_mb do
BUCKETED_STRATEGIES = ("bucketed", "torch")  # as ddp.BUCKETED_STRATEGIES; not imported: no torch needed here
STRATEGY_ORDER = ("local", "naive", "flat", "overlap", "bucketed", "torch")
TABLE_FORMAT = "github"
# PyTorch's DDP fills its first bucket up to this, whatever bucket_cap_mb (dist._DEFAULT_FIRST_BUCKET_BYTES).
TORCH_FIRST_BUCKET_BYTES = 2**20

_STEP_KEYS = {"strategy", "comm_wait_seconds"}
_ALLREDUCE_KEYS = {"size_bytes", "algbw_gbps"}
_VERSUS_KEYS = {"median_step_seconds", "ratio_bucketed_over_torch"}


class ReportError(Exception):
    """A run that cannot be reported; the message says what to do about it."""


# --------------------------------------------------------------------------- reading runs


@dataclass(frozen=True)
class StepResult:
    """One step benchmark: a strategy (and bucket cap) at one batch size and sequence length."""

    name: str
    strategy: str
    model_size: str
    batch_size: int
    """Sequences per rank."""
    seq_len: int
    bucket_size_mb: float | None
    """Bucket cap in MiB; None for strategies that do not bucket."""
    step_seconds: float
    """pytest-benchmark's median round (see the module docstring)."""
    comm_wait_seconds: float
    comm_fraction: float
    """comm_wait_seconds over the ranks' own step time."""
    world_size: int
    num_buckets: int | None
    allreduce_calls_per_step: int
    bytes_per_step: int
    """Gradient bytes each rank all-reduces per step."""
    tokens_per_second: float
    bucket_sizes_bytes: tuple[int, ...] | None = None
    """Gradient bytes of each bucket in launch order, where the run recorded them."""
    iqr_seconds: float | None = None
    """Interquartile range of the rounds (pytest-benchmark's stats.iqr): the run's noise."""

    @property
    def label(self) -> str:
        """``bucketed 25 MB`` or ``naive``: the strategy as report columns name it."""
        if self.bucket_size_mb is None:
            return self.strategy
        return f"{self.strategy} {self.bucket_size_mb:g} MB"

    @property
    def config(self) -> tuple[str, int, int]:
        """What a step's time depends on besides the strategy: (model size, batch, seq len)."""
        return (self.model_size, self.batch_size, self.seq_len)

    @property
    def compute_seconds(self) -> float:
        return max(0.0, self.step_seconds - self.comm_wait_seconds)


@dataclass(frozen=True)
class AllReduceResult:
    name: str
    backend: str
    world_size: int
    size_bytes: int
    seconds: float
    """Median over rounds of the slowest rank's all-reduce."""
    algbw_gbps: float
    busbw_gbps: float
    wrong: int


@dataclass(frozen=True)
class VersusResult:
    """perf_tests/test_versus_torch.py: bucketed and torch (and local) in alternating rounds."""

    name: str
    model: str
    bucket_size_mb: float | None
    median_step_seconds: dict[str, float]
    """By strategy name."""
    ratio_bucketed_over_torch: float


@dataclass(frozen=True)
class OtherResult:
    """A benchmark that is neither a step nor an all-reduce (listed with its median only)."""

    name: str
    group: str | None
    seconds: float


@dataclass
class Run:
    """One saved pytest-benchmark run."""

    path: Path
    machine_info: dict
    commit_info: dict
    datetime: str | None
    medians: dict[str, float]
    """Median seconds of every benchmark, by name (what comparisons match on)."""
    steps: list[StepResult] = field(default_factory=list)
    allreduces: list[AllReduceResult] = field(default_factory=list)
    versus: list[VersusResult] = field(default_factory=list)
    others: list[OtherResult] = field(default_factory=list)


def _read_json(path: Path) -> dict:
    hint = "pass a file written by `pytest perf_tests --benchmark-json PATH` or --benchmark-autosave (under .benchmarks/)"
    if not path.exists():
        raise ReportError(f"{path}: no such file; {hint}")
    if path.is_dir():
        raise ReportError(f"{path} is a directory; {hint}, e.g. .benchmarks/gloo-cpu/*/0001_*.json")
    try:
        data = json.loads(path.read_text())
    except UnicodeDecodeError:
        raise ReportError(f"{path} is not a text file, let alone pytest-benchmark JSON; {hint}") from None
    except json.JSONDecodeError as error:
        raise ReportError(
            f"{path} is not JSON ({error.msg} at line {error.lineno}, column {error.colno}); {hint}"
        ) from None
    if not isinstance(data, dict) or not isinstance(data.get("benchmarks"), list):
        raise ReportError(f"{path} is JSON but not a pytest-benchmark run (it has no 'benchmarks' list); {hint}")
    return data


def _median_seconds(path: Path, bench: dict) -> float:
    stats = bench.get("stats")
    name = bench.get("name", "?")
    if not isinstance(stats, dict) or "median" not in stats:
        raise ReportError(
            f"{path}: benchmark {name!r} has no stats.median (was it run with --benchmark-disable?); "
            "rerun the perf tests without --benchmark-disable"
        )
    return float(stats["median"])


def _step(path: Path, bench: dict, median: float) -> StepResult:
    info = bench["extra_info"]
    try:
        sizes = info.get("bucket_sizes_bytes")
        return StepResult(
            name=bench["name"],
            strategy=str(info["strategy"]),
            model_size=str(info["model_size"]),
            batch_size=int(info["batch_size"]),
            seq_len=int(info["seq_len"]),
            bucket_size_mb=None if info.get("bucket_size_mb") is None else float(info["bucket_size_mb"]),
            step_seconds=median,
            comm_wait_seconds=float(info["comm_wait_seconds"]),
            comm_fraction=float(info["comm_fraction"]),
            world_size=int(info["world_size"]),
            num_buckets=None if info.get("num_buckets") is None else int(info["num_buckets"]),
            allreduce_calls_per_step=int(info["allreduce_calls_per_step"]),
            bytes_per_step=int(info["bytes_per_step"]),
            tokens_per_second=float(info["tokens_per_second"]),
            bucket_sizes_bytes=None if sizes is None else tuple(int(s) for s in sizes),
            iqr_seconds=None if bench["stats"].get("iqr") is None else float(bench["stats"]["iqr"]),
        )
    except KeyError as error:
        raise ReportError(
            f"{path}: step benchmark {bench['name']!r} lacks extra_info[{error.args[0]!r}]; the run predates "
            "that field or was not written by perf_tests/test_step.py: rerun the perf tests"
        ) from None


def _allreduce(bench: dict, median: float) -> AllReduceResult:
    info = bench["extra_info"]
    return AllReduceResult(
        name=bench["name"],
        backend=str(info.get("backend", "?")),
        world_size=int(info["world_size"]),
        size_bytes=int(info["size_bytes"]),
        seconds=median,
        algbw_gbps=float(info["algbw_gbps"]),
        busbw_gbps=float(info.get("busbw_gbps", float("nan"))),
        wrong=int(info.get("wrong", 0)),
    )


def load_run(path: str | Path) -> Run:
    """Read one saved run; ``ReportError`` (saying what to do) if it is not one."""
    path = Path(path)
    data = _read_json(path)
    run = Run(
        path=path,
        machine_info=data.get("machine_info") or {},
        commit_info=data.get("commit_info") or {},
        datetime=data.get("datetime"),
        medians={},
    )
    for bench in data["benchmarks"]:
        if not isinstance(bench, dict) or "name" not in bench:
            raise ReportError(f"{path}: an entry of 'benchmarks' has no name; the file is not pytest-benchmark JSON")
        median = _median_seconds(path, bench)
        run.medians[bench["name"]] = median
        keys = set(bench.get("extra_info") or {})
        if _STEP_KEYS <= keys:
            run.steps.append(_step(path, bench, median))
        elif _ALLREDUCE_KEYS <= keys:
            run.allreduces.append(_allreduce(bench, median))
        elif _VERSUS_KEYS <= keys:
            info = bench["extra_info"]
            run.versus.append(
                VersusResult(
                    name=bench["name"],
                    model=str(info.get("model", "?")),
                    bucket_size_mb=info.get("bucket_size_mb"),
                    median_step_seconds={k: float(v) for k, v in info["median_step_seconds"].items()},
                    ratio_bucketed_over_torch=float(info["ratio_bucketed_over_torch"]),
                )
            )
        else:
            run.others.append(OtherResult(bench["name"], bench.get("group"), median))
    if not run.steps and not run.allreduces and not run.versus:
        found = f"{len(run.others)} other benchmarks" if run.others else "no benchmarks at all"
        raise ReportError(
            f"{path} holds no ddp-bench step or all-reduce benchmarks ({found}); run "
            "`pytest perf_tests --benchmark-json PATH` (test_step.py gives the step tables, "
            "test_allreduce.py the all-reduce table) and report that file"
        )
    return run


# --------------------------------------------------------------------------- figures


def _strategy_rank(step: StepResult) -> tuple:
    order = STRATEGY_ORDER.index(step.strategy) if step.strategy in STRATEGY_ORDER else len(STRATEGY_ORDER)
    return (order, step.strategy, step.bucket_size_mb or 0.0)


def sorted_steps(steps: list[StepResult]) -> list[StepResult]:
    """By configuration, then in registry order of strategies, then by bucket cap."""
    return sorted(steps, key=lambda s: (s.config, _strategy_rank(s)))


def configs(steps: list[StepResult]) -> list[tuple[str, int, int]]:
    return sorted({s.config for s in steps})


def config_label(config: tuple[str, int, int], with_model: bool) -> str:
    model, batch, seq = config
    text = f"batch {batch}, seq {seq}"
    return f"{model}, {text}" if with_model else text


@dataclass(frozen=True)
class Overhead:
    step: StepResult
    local_seconds: float

    @property
    def ratio(self) -> float:
        return self.step.step_seconds / self.local_seconds

    @property
    def extra_seconds(self) -> float:
        return self.step.step_seconds - self.local_seconds


def overheads_over_local(steps: list[StepResult]) -> list[Overhead]:
    """Every non-local step against ``local`` at the same configuration (where local ran)."""
    local = {s.config: s.step_seconds for s in steps if s.strategy == "local"}
    return [
        Overhead(s, local[s.config])
        for s in sorted_steps(steps)
        if s.strategy != "local" and s.config in local and local[s.config] > 0
    ]


@dataclass(frozen=True)
class Win:
    """The fastest data-parallel strategy at one configuration, and its margins."""

    config: tuple[str, int, int]
    winner: StepResult
    runner_up: StepResult | None
    torch: StepResult | None
    """PyTorch's DDP at its best bucket cap (None if it did not run)."""
    naive: StepResult | None


def fastest(steps: list[StepResult]) -> StepResult | None:
    return min(steps, key=lambda s: s.step_seconds, default=None)


def winners(steps: list[StepResult]) -> list[Win]:
    """Per configuration, the fastest strategy other than ``local`` (bucket caps at their best)."""
    wins = []
    for config in configs(steps):
        here = [s for s in steps if s.config == config and s.strategy != "local"]
        winner = fastest(here)
        if winner is None:
            continue
        best_per_strategy = [fastest([s for s in here if s.strategy == name]) for name in {s.strategy for s in here}]
        others = [s for s in best_per_strategy if s.strategy != winner.strategy]
        wins.append(
            Win(
                config=config,
                winner=winner,
                runner_up=fastest(others),
                torch=fastest([s for s in here if s.strategy == "torch"]),
                naive=fastest([s for s in here if s.strategy == "naive"]),
            )
        )
    return wins


@dataclass(frozen=True)
class BucketPlan:
    """How one bucketing strategy split the gradients at one cap (the same at every batch/seq)."""

    strategy: str
    bucket_size_mb: float
    num_buckets: int
    total_bytes: int
    bucket_sizes_bytes: tuple[int, ...] | None

    @property
    def total_over_cap(self) -> int:
        """The count a reader expects from total / cap (what the seeds assumed)."""
        return max(1, math.ceil(self.total_bytes / (self.bucket_size_mb * BYTES_PER_MB)))

    @property
    def oversized_buckets(self) -> int | None:
        """Buckets holding more than the cap: in ``bucketed``, a single tensor larger than the cap; in
        ``torch``, also a bucket PyTorch closed only once it had reached the cap."""
        if self.bucket_sizes_bytes is None:
            return None
        cap = self.bucket_size_mb * BYTES_PER_MB
        return sum(1 for size in self.bucket_sizes_bytes if size > cap)


def bucket_plans(steps: list[StepResult]) -> list[BucketPlan]:
    plans = {}
    for s in sorted_steps(steps):
        if s.strategy in BUCKETED_STRATEGIES and s.num_buckets is not None and s.bucket_size_mb is not None:
            plans.setdefault(
                (s.strategy, s.bucket_size_mb),
                BucketPlan(s.strategy, s.bucket_size_mb, s.num_buckets, s.bytes_per_step, s.bucket_sizes_bytes),
            )
    return [plans[key] for key in sorted(plans, key=lambda k: (STRATEGY_ORDER.index(k[0]), k[1]))]


@dataclass(frozen=True)
class Comparison:
    name: str
    old_seconds: float | None
    new_seconds: float | None

    @property
    def ratio(self) -> float | None:
        if self.old_seconds is None or self.new_seconds is None or self.old_seconds <= 0:
            return None
        return self.new_seconds / self.old_seconds


def compare_runs(old: Run, new: Run) -> list[Comparison]:
    """Benchmarks matched by name, in the new run's order, then those only in the old run."""
    names = list(new.medians) + [name for name in old.medians if name not in new.medians]
    return [Comparison(name, old.medians.get(name), new.medians.get(name)) for name in names]


def machine_summary(run: Run) -> dict[str, str]:
    """What must match for two runs' times to be comparable."""
    info = run.machine_info
    cpu = info.get("cpu") or {}
    bench = info.get("ddp_bench") or {}
    summary = {
        "node": info.get("node"),
        "cpu": cpu.get("brand_raw"),
        "cpu count": cpu.get("count"),
        "system": f"{info.get('system', '')} {info.get('release', '')}".strip() or None,
        "python": info.get("python_version"),
        "torch": bench.get("torch"),
        "backend": bench.get("backend"),
        "device": bench.get("device"),
        "world size": bench.get("world_size"),
        "GPU": f"{bench['gpu_count']} x {bench['gpu']}" if bench.get("gpu") else None,
        "CUDA": bench.get("cuda"),
        "NCCL": bench.get("nccl"),
    }
    return {key: str(value) for key, value in summary.items() if value not in (None, "")}


def machine_differences(old: Run, new: Run) -> dict[str, tuple[str, str]]:
    """The machine facts that differ between two runs: {fact: (old, new)}."""
    a, b = machine_summary(old), machine_summary(new)
    return {key: (a.get(key, "unknown"), b.get(key, "unknown")) for key in dict.fromkeys([*a, *b]) if a.get(key) != b.get(key)}


# --------------------------------------------------------------------------- report.md


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.2f}"


def _mib(nbytes: float) -> str:
    return f"{nbytes / BYTES_PER_MB:.3g}"


def _pct(fraction: float) -> str:
    return f"{fraction:.1%}"


def _table(rows: list, headers: list[str]) -> str:
    return tabulate(rows, headers=headers, tablefmt=TABLE_FORMAT, disable_numparse=True)


def header_section(run: Run) -> list[str]:
    commit = run.commit_info
    commit_text = (
        f"{commit.get('id', '?')[:12]}{' (dirty tree)' if commit.get('dirty') else ''} on {commit.get('branch', '?')}"
        if commit
        else "not recorded"
    )
    rows = [["run", f"`{run.path}`"], ["saved", run.datetime or "not recorded"], ["commit", commit_text]]
    summary = machine_summary(run)
    summary.setdefault("GPU", "none")
    rows += [[key, value] for key, value in summary.items()]
    models = sorted({s.model_size for s in run.steps})
    if models:
        rows.append(["model", ", ".join(models)])
    return ["## Machine", "", _table(rows, ["", ""]), ""]


def _pivot(steps: list[StepResult], cell) -> tuple[list, list[str]]:
    keys = configs(steps)
    with_model = len({k[0] for k in keys}) > 1
    labels = list(dict.fromkeys(s.label for s in sorted(steps, key=_strategy_rank)))
    by = {(s.label, s.config): s for s in steps}
    rows = [[label] + [cell(by[(label, k)]) if (label, k) in by else "" for k in keys] for label in labels]
    return rows, ["strategy"] + [config_label(k, with_model) for k in keys]


def step_section(run: Run) -> list[str]:
    steps = run.steps
    time_rows, headers = _pivot(steps, lambda s: _ms(s.step_seconds))
    share_rows, _ = _pivot(steps, lambda s: f"{_pct(s.comm_fraction)} ({_ms(s.comm_wait_seconds)} ms)")
    world = sorted({s.world_size for s in steps})
    return [
        f"## Time per step ({', '.join(map(str, world))} ranks; batch is per rank)",
        "",
        "Median step time, ms (one step on every rank, until the slowest rank returned):",
        "",
        _table(time_rows, headers),
        "",
        "Communication share: the slowest rank's wait from its last gradient to gradients synchronized, "
        "as a share of its step (and in ms). For `local` it is the floor of the measurement.",
        "",
        _table(share_rows, headers),
        "",
    ]


def overhead_section(run: Run) -> list[str]:
    overheads = overheads_over_local(run.steps)
    if not overheads:
        return ["## Overhead over `local`", "", "No `local` benchmark in this run: nothing to measure overhead against.", ""]
    with_model = len({o.step.model_size for o in overheads}) > 1
    rows = [
        [config_label(o.step.config, with_model), o.step.label, _ms(o.local_seconds), _ms(o.step.step_seconds),
         _ms(o.extra_seconds), f"{o.ratio:.3f}"]
        for o in overheads
    ]
    return [
        "## Overhead over `local`",
        "",
        "`local` trains each rank's batch with no communication at all: the price of data parallelism is the rest.",
        "",
        _table(rows, ["config", "strategy", "local (ms)", "step (ms)", "overhead (ms)", "step / local"]),
        "",
    ]


def bucket_section(run: Run) -> list[str]:
    steps = [s for s in run.steps if s.strategy in BUCKETED_STRATEGIES and s.bucket_size_mb is not None]
    if not steps:
        return []
    plans = {(p.strategy, p.bucket_size_mb): p for p in bucket_plans(steps)}
    keys = configs(steps)
    with_model = len({k[0] for k in keys}) > 1
    by = {(s.strategy, s.bucket_size_mb, s.config): s for s in steps}
    rows = []
    for strategy, cap in sorted({(s.strategy, s.bucket_size_mb) for s in steps}, key=lambda k: (STRATEGY_ORDER.index(k[0]), k[1])):
        plan = plans.get((strategy, cap))
        row = [strategy, f"{cap:g}", "" if plan is None else plan.num_buckets, "" if plan is None else plan.total_over_cap]
        row += [_ms(by[(strategy, cap, k)].step_seconds) if (strategy, cap, k) in by else "" for k in keys]
        rows.append(row)
    headers = ["strategy", "bucket cap (MB)", "buckets", "total / cap"] + [f"{config_label(k, with_model)} (ms)" for k in keys]
    return [
        "## By bucket size",
        "",
        "Median step time, ms, with the number of buckets each cap produced and the count that "
        "total gradient bytes / cap would suggest (see the commentary for why they differ).",
        "",
        _table(rows, headers),
        "",
    ]


def allreduce_section(run: Run) -> list[str]:
    if not run.allreduces:
        return []
    results = sorted(run.allreduces, key=lambda a: (a.backend, a.world_size, a.size_bytes))
    rows = [
        [a.backend, a.world_size, _mib(a.size_bytes), f"{a.seconds * 1e3:.3f}", f"{a.algbw_gbps:.3f}",
         f"{a.busbw_gbps:.3f}", a.wrong]
        for a in results
    ]
    return [
        "## All-reduce",
        "",
        "float32 sum, time of the slowest rank (median). algbw = size / time; busbw = algbw x 2(n-1)/n "
        "(as nccl-tests), comparable with link bandwidth whatever the number of ranks. GB/s = 10^9 bytes/s.",
        "",
        _table(rows, ["backend", "ranks", "size (MiB)", "time (ms)", "algbw (GB/s)", "busbw (GB/s)", "#wrong"]),
        "",
    ]


def versus_section(run: Run) -> list[str]:
    if not run.versus:
        return []
    rows = []
    for v in run.versus:
        times = v.median_step_seconds
        local = times.get("local")
        rows.append(
            [v.name, v.model, "" if v.bucket_size_mb is None else f"{v.bucket_size_mb:g}", _ms(local),
             _ms(times.get("bucketed")), _ms(times.get("torch")), f"{v.ratio_bucketed_over_torch:.3f}"]
        )
    return [
        "## Bucketed against PyTorch's DDP (alternating rounds)",
        "",
        "Both wrap the same model on the same ranks, one step of each per round in rotating order, so "
        "drift in the machine falls on both alike. bucketed / torch below 1 means bucketed is faster.",
        "",
        _table(rows, ["benchmark", "model", "bucket cap (MB)", "local (ms)", "bucketed (ms)", "torch (ms)", "bucketed / torch"]),
        "",
    ]


def others_section(run: Run) -> list[str]:
    if not run.others:
        return []
    rows = [[o.name, o.group or "", _ms(o.seconds)] for o in run.others]
    return [
        "## Other benchmarks",
        "",
        "Neither step nor all-reduce benchmarks (told apart by their extra_info): median only.",
        "",
        _table(rows, ["benchmark", "group", "median (ms)"]),
        "",
    ]


def _times(faster: StepResult, slower: StepResult) -> str:
    return (
        f"{slower.step_seconds / faster.step_seconds:.2f}x faster than {slower.label} "
        f"({_ms(slower.step_seconds)} ms, {_ms(slower.step_seconds - faster.step_seconds)} ms less per step)"
    )


def winner_sentence(win: Win, with_model: bool) -> str:
    w = win.winner
    text = f"**{config_label(win.config, with_model)}**: {w.label} is fastest at {_ms(w.step_seconds)} ms"
    margins = []
    if win.torch is not None and win.torch.strategy != w.strategy:
        margins.append(_times(w, win.torch))
    elif win.runner_up is not None:
        margins.append(_times(w, win.runner_up))
    if win.naive is not None and win.naive.strategy != w.strategy:
        margins.append(_times(w, win.naive))
    return text + (": " + "; ".join(margins) if margins else "") + "."


def plan_sentence(plan: BucketPlan) -> str:
    text = (
        f"- {plan.strategy}, cap {plan.bucket_size_mb:g} MB: **{plan.num_buckets} bucket(s)** for "
        f"{_mib(plan.total_bytes)} MiB of gradients (total / cap = {plan.total_over_cap})"
    )
    if plan.bucket_sizes_bytes is not None:
        sizes = [float(_mib(size)) for size in plan.bucket_sizes_bytes]
        listed = ", ".join(f"{s:g}" for s in sizes[:12]) + (f", ... ({len(sizes) - 12} more)" if len(sizes) > 12 else "")
        text += f"; sizes in launch order, MiB: {listed}"
        if plan.oversized_buckets and plan.strategy == "torch":
            text += (
                f"; {plan.oversized_buckets} bucket(s) exceed the cap (PyTorch closes a bucket once it has "
                "reached the cap, not before the tensor that would overflow it)"
            )
        elif plan.oversized_buckets:
            text += f"; {plan.oversized_buckets} bucket(s) hold a single tensor larger than the cap"
    torch_first = plan.strategy == "torch" and plan.bucket_size_mb * BYTES_PER_MB < TORCH_FIRST_BUCKET_BYTES
    if plan.num_buckets < plan.total_over_cap:
        if torch_first and plan.total_bytes <= TORCH_FIRST_BUCKET_BYTES:
            text += (
                ". Fewer than total / cap: every gradient fits in PyTorch's first bucket, which DDP fills up "
                "to 1 MiB whatever bucket_cap_mb says"
            )
        else:
            text += ". Fewer than total / cap: some buckets hold more than the cap"
            if plan.strategy != "torch":
                text += ", a tensor larger than the cap in a bucket of its own"
            if torch_first:
                text += " (and PyTorch's first bucket, filled up to 1 MiB whatever bucket_cap_mb says)"
    elif plan.num_buckets > plan.total_over_cap:
        text += ". More than total / cap: a bucket is closed as soon as the next tensor would overflow it, so buckets are rarely full"
    return text + "."


def faster_than_local(steps: list[StepResult]) -> list[StepResult]:
    """Data-parallel steps faster than ``local`` at their configuration: communication cannot make a
    step faster, so each one is noise (or a machine busy with something else) larger than the difference."""
    return [o.step for o in overheads_over_local(steps) if o.extra_seconds < 0]


def median_spread(steps: list[StepResult]) -> float | None:
    """The median over benchmarks of IQR / median: how far apart rounds of one benchmark fall."""
    spreads = sorted(s.iqr_seconds / s.step_seconds for s in steps if s.iqr_seconds is not None and s.step_seconds > 0)
    return spreads[len(spreads) // 2] if spreads else None


def noise_sentence(steps: list[StepResult]) -> str | None:
    spread = median_spread(steps)
    suspicious = faster_than_local(steps)
    if not suspicious and (spread is None or spread < 0.05):
        return None
    parts = []
    if spread is not None:
        parts.append(f"rounds of one benchmark spread by {_pct(spread)} of their median (IQR, median over benchmarks)")
    if suspicious:
        compared = len(overheads_over_local(steps))
        parts.append(
            f"{len(suspicious)} of {compared} data-parallel steps ran faster than `local`, which does no communication"
        )
    return (
        "**Noise warning**: " + "; ".join(parts) + ". Differences of that order are not resolved by this run: "
        "use more --rounds, larger steps (--batch-sizes, --seq-lens) or a machine nobody else is using."
    )


def commentary_section(run: Run) -> list[str]:
    steps = run.steps
    lines = ["## Commentary (generated from the numbers above)", ""]
    noise = noise_sentence(steps)
    if noise:
        lines += [noise, ""]
    wins = winners(steps)
    with_model = len({w.config[0] for w in wins}) > 1
    if wins:
        counts = defaultdict(int)
        for win in wins:
            counts[win.winner.strategy] += 1
        tally = ", ".join(f"{name} at {n} of {len(wins)}" for name, n in sorted(counts.items(), key=lambda kv: -kv[1]))
        lines += [f"Fastest data-parallel strategy per configuration: {tally}.", ""]
        lines += [f"- {winner_sentence(win, with_model)}" for win in wins]
        lines.append("")
    exposed = [s for s in steps if s.strategy != "local"]
    if exposed:
        worst = max(exposed, key=lambda s: s.comm_wait_seconds)
        share = max(exposed, key=lambda s: s.comm_fraction)
        text = (
            f"Largest exposed communication: {worst.label} at {config_label(worst.config, with_model)} waits "
            f"{_ms(worst.comm_wait_seconds)} ms per step for its gradients ({_pct(worst.comm_fraction)} of the step)"
        )
        if share is not worst:
            text += (
                f"; the largest share is {share.label} at "
                f"{config_label(share.config, with_model)}: {_pct(share.comm_fraction)} ({_ms(share.comm_wait_seconds)} ms)"
            )
        local = [s.comm_wait_seconds for s in steps if s.strategy == "local"]
        if local:
            text += f". `local`, with nothing to wait for, measures up to {_ms(max(local))} ms: the floor of this figure"
        lines += [text + ".", ""]
    plans = bucket_plans(steps)
    if plans:
        lines += [
            "Bucket plans. Buckets are filled in backward order and closed when the next tensor would "
            "overflow the cap, and a tensor larger than the cap gets a bucket of its own, so the count is "
            "not total / cap: it is at most the number of gradient tensors (when every tensor is at least "
            "the cap, bucketing launches one all-reduce per tensor, like overlap) and can be far below total / cap.",
            "",
        ]
        lines += [plan_sentence(plan) for plan in plans]
        if all(plan.bucket_sizes_bytes is None for plan in plans):
            lines.append("- (Per-bucket sizes are not in this run: its extra_info has no bucket_sizes_bytes.)")
        lines.append("")
    return lines


def comparison_section(old: Run, new: Run) -> list[str]:
    lines = [f"## Comparison: `{new.path}` against `{old.path}`", ""]
    differences = machine_differences(old, new)
    if differences:
        facts = "; ".join(f"{key}: {a} vs {b}" for key, (a, b) in differences.items())
        lines += [
            f"> **WARNING: the runs come from different machines or setups** ({facts}). A ratio between "
            "them measures the machine as much as the code: rerun both on one machine before drawing conclusions.",
            "",
        ]
    comparisons = compare_runs(old, new)
    matched = [c.ratio for c in comparisons if c.ratio is not None]
    only_old = sum(1 for c in comparisons if c.new_seconds is None)
    only_new = sum(1 for c in comparisons if c.old_seconds is None)
    summary = f"{len(matched)} benchmarks in both runs"
    if matched:
        geomean = math.exp(sum(math.log(r) for r in matched) / len(matched))
        summary += f", geometric mean of new / old {geomean:.3f}"
    summary += f"; {only_old} only in the old run, {only_new} only in the new one."
    rows = [
        [c.name, _ms(c.old_seconds) or "absent", _ms(c.new_seconds) or "absent",
         "" if c.ratio is None else f"{c.ratio:.3f}"]
        for c in comparisons
    ]
    lines += [
        "Medians matched by benchmark name; new / old below 1 means the new run is faster. " + summary,
        "",
        _table(rows, ["benchmark", "old (ms)", "new (ms)", "new / old"]),
        "",
    ]
    return lines


def render_markdown(runs: list[Run], images: list[Path]) -> str:
    """report.md for ``runs`` (the last reported in full, the earlier ones compared with it)."""
    run = runs[-1]
    lines = ["# ddp-bench report", ""]
    lines += header_section(run)
    if run.steps:
        lines += commentary_section(run)
    for old in runs[:-1]:
        lines += comparison_section(old, run)
    if run.steps:
        lines += step_section(run)
        lines += overhead_section(run)
        lines += bucket_section(run)
    else:
        lines += ["No step benchmarks in this run (run perf_tests/test_step.py for the step tables).", ""]
    lines += versus_section(run)
    lines += allreduce_section(run)
    lines += others_section(run)
    if images:
        lines += ["## Plots", ""]
        lines += [f"![{image.stem}]({image.name})" for image in images]
        lines.append("")
    return "\n".join(lines)


def write_report(paths: list[str | Path], out: str | Path) -> Path:
    """Read the runs, draw the plots into ``out`` and write ``out/report.md``; returns its path."""
    runs = [load_run(path) for path in paths]
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ReportError(f"--out {out} is a file; give a directory (it is created if missing)")
    out.mkdir(parents=True, exist_ok=True)
    from ddp import plots  # matplotlib is imported only when a report is drawn

    images = plots.draw_all(runs[-1], out)
    report = out / "report.md"
    report.write_text(render_markdown(runs, images))
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "runs",
        nargs="+",
        metavar="RUN.json",
        help="saved pytest-benchmark runs (--benchmark-json, or .benchmarks/...); the last is reported, "
        "earlier ones are compared with it",
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="directory for report.md and the PNG plots")


def main(args: argparse.Namespace) -> int:
    try:
        report = write_report(args.runs, args.out)
    except ReportError as error:
        print(f"ddp-bench report: error: {error}", file=sys.stderr)
        return 2
    print(report)
    return 0
