"""Regression checks that know noise: two runs compared benchmark by benchmark, each ratio
new / old with its 95% interval, and a verdict that only a resolved difference can fail.

Benchmarks are matched by name. For each, the ratio of medians new / old gets a bootstrap interval
over the two runs' rounds (``ddp.bench.stats.ratio_of_medians_ci``), and the verdict against a
threshold t (``ddp.bench.stats.verdict``): *slower* when the whole interval lies above 1 + t,
*faster* below 1 - t, *unchanged* inside [1 - t, 1 + t], *not resolved* when it straddles a
threshold. The gate fails only on *slower*: a slowdown by more than the threshold that the rounds
resolve. pytest-benchmark's own ``--benchmark-compare-fail`` compares medians alone; here noise
widens the interval instead of failing the gate. ``gate`` is that gate, once: ``ddp compare`` and
pytest's ``--ddp-fail-slower`` (perf_tests/conftest.py) print and judge through it, and ``table``
is the one comparison table, in the terminal and in the report.

**Drift between runs.** Two runs are taken minutes or days apart, and a machine's speed drifts
by more than 10% over that on a shared host (measured here: ``local`` steps of one configuration
differed by up to 26% between two default runs of the same code), which no interval over one
run's rounds can show. Where both runs interleaved a step benchmark with ``local`` (its record has
``local_round_seconds``), the ratio is taken on each round's step / local instead: a change in
the machine slows both and cancels, a change in the strategy does not. The ``basis`` column says
which; runs without pairing are compared raw. ``local`` itself has nothing to pair with: it is
the machine's reference, and a resolved change there is reported as ``machine slower`` (or
faster), not gated: between two runs of the same code on this project's machine, every ``local``
benchmark once ran 11 to 28% slower (the whole machine was slower for that run) while every
paired strategy comparison stayed inside the threshold. A change that slows the model's own
compute shows there too, and is then a change of the workload rather than of a DDP.

Two runs from different machines, backends, devices, GPUs or torch versions measure the machine
as much as the code: ``machine_differences`` names what differs, and the report says so first.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddp.analysis.figures import machine_differences
from ddp.analysis.tables import ms, ratio_interval
from ddp.analysis.tables import table as render
from ddp.bench.records import Run, StepRecord
from ddp.bench.stats import Verdict, ratio_of_medians_ci, verdict

# The facts whose difference makes a comparison suspect; machine_differences names them.
MACHINE_FACTS = ("node", "cpu", "cpu count", "torch", "backend", "device", "world size", "GPU", "CUDA", "NCCL")


@dataclass(frozen=True)
class BenchmarkComparison:
    name: str
    old_seconds: float | None
    new_seconds: float | None
    ratio: float | None
    """median(new) / median(old)."""
    ratio_ci95: tuple[float, float] | None
    verdict: str
    """slower, faster, unchanged, not resolved, or only in old / only in new / no rounds."""
    basis: str = "raw"
    """``raw``: step times; ``paired with local``: each round's step / local (drift-corrected)."""


def compare(old: Run, new: Run, threshold: float) -> list[BenchmarkComparison]:
    """Every benchmark of either run, in the new run's order, then those only in the old one."""
    old_by, new_by = old.by_name(), new.by_name()
    rows = []
    for name in list(new_by) + [n for n in old_by if n not in new_by]:
        a, b = old_by.get(name), new_by.get(name)
        if a is None or b is None:
            rows.append(BenchmarkComparison(name, a and a.median_seconds, b and b.median_seconds, None, None,
                                            "only in new" if a is None else "only in old"))
            continue
        config = getattr(a.record, "config", None)
        if config is not None and config != getattr(b.record, "config", None):
            rows.append(BenchmarkComparison(name, a.median_seconds, b.median_seconds, None, None,
                                            f"different configuration: {config} vs {getattr(b.record, 'config', None)}"))
            continue
        if not a.round_seconds or not b.round_seconds:
            rows.append(BenchmarkComparison(name, a.median_seconds, b.median_seconds, b.median_seconds / a.median_seconds,
                                            None, "no rounds saved"))
            continue
        basis, old_rounds, new_rounds = _rounds_to_compare(a, b)
        ratio, low, high = ratio_of_medians_ci(new_rounds, old_rounds)
        judged = str(verdict(low, high, threshold))
        if getattr(a.record, "strategy", None) == "local" and judged in (str(Verdict.SLOWER), str(Verdict.FASTER)):
            # local is what every strategy is measured against: nothing to pair it with, so a change
            # there is the machine's (or the model's own compute), reported but not gated
            judged = f"machine {judged}"
            basis = MACHINE_REFERENCE
        rows.append(BenchmarkComparison(name, a.median_seconds, b.median_seconds, ratio, (low, high), judged, basis))
    return rows


def _rounds_to_compare(old, new) -> tuple[str, list[float], list[float]]:
    """What the ratio is taken on: each round's step / local where both runs paired them, else the rounds."""
    pair_old = getattr(old.record, "local_round_seconds", None)
    pair_new = getattr(new.record, "local_round_seconds", None)
    if pair_old and pair_new and len(pair_old) == len(old.round_seconds) and len(pair_new) == len(new.round_seconds):
        return (
            PAIRED,
            [s / l for s, l in zip(old.round_seconds, pair_old)],
            [s / l for s, l in zip(new.round_seconds, pair_new)],
        )
    return RAW, old.round_seconds, new.round_seconds


RAW = "raw"
PAIRED = "paired with local"
MACHINE_REFERENCE = "raw (machine reference, not gated)"


def failed(rows: list[BenchmarkComparison]) -> list[BenchmarkComparison]:
    """The benchmarks that fail the gate: resolved slowdowns beyond the threshold."""
    return [row for row in rows if row.verdict == str(Verdict.SLOWER)]


def machine_drift(rows: list[BenchmarkComparison]) -> list[BenchmarkComparison]:
    """``local`` benchmarks resolved slower or faster: the machine (or the model's compute) changed."""
    return [row for row in rows if row.basis == MACHINE_REFERENCE]


def suspect_differences(old: Run, new: Run) -> dict[str, tuple[str, str]]:
    """Machine facts that differ between the runs and make their ratios suspect, and the numerics
    of steps matched by name that were not computed alike (a run saved before schema 3 on CPU used
    torch's per-tensor AdamW loop, a run today foreach: same names, not the same step)."""
    differences = {key: value for key, value in machine_differences(old, new).items() if key in MACHINE_FACTS}
    olds = old.by_name()
    pairs = {(a.record.numerics, b.record.numerics) for name, b in new.by_name().items()
             if name in olds and isinstance(b.record, StepRecord) and isinstance((a := olds[name]).record, StepRecord)}
    unlike = sorted((a, b) for a, b in pairs if a != b)
    if unlike:
        differences["step numerics"] = (", ".join(a for a, _ in unlike), ", ".join(b for _, b in unlike))
    return differences


def table(rows: list[BenchmarkComparison], tablefmt: str = "simple") -> str:
    """The comparison as a table: what ``ddp compare``, the pytest gate (text) and the report
    (``github``) show."""
    body = [
        [r.name, ms(r.old_seconds, missing="absent"), ms(r.new_seconds, missing="absent"),
         "" if r.ratio is None else f"{r.ratio:.3f}", ratio_interval(r.ratio_ci95), r.verdict, r.basis]
        for r in rows
    ]
    return render(body, ["benchmark", "old (ms)", "new (ms)", "new / old", "95% interval", "verdict", "basis"], tablefmt)


@dataclass(frozen=True)
class Gate:
    """The regression gate of one comparison, as ``ddp compare`` and pytest's ``--ddp-fail-slower``
    both print it: warnings first (setups that differ), then the table and what it concluded."""

    rows: list[BenchmarkComparison]
    warnings: list[str]
    lines: list[str]
    failed: list[BenchmarkComparison]


def gate(old: Run, new: Run, threshold: float) -> Gate:
    """Compare ``new`` against ``old`` and judge: fails on a resolved slowdown beyond ``threshold``."""
    warnings = []
    differences = suspect_differences(old, new)
    if differences:
        facts = "; ".join(f"{key}: {a} vs {b}" for key, (a, b) in differences.items())
        warnings.append(f"WARNING: the runs come from different machines or setups ({facts}): the ratios measure the "
                        "machine as much as the code")
    rows = compare(old, new, threshold)
    lines = [table(rows)]
    drift = machine_drift(rows)
    if drift:
        lines.append(
            f"NOTE: local, the machine's reference, changed in {len(drift)} configuration(s) ("
            + ", ".join(f"{r.name} x{r.ratio:.2f}" for r in drift) + "): the machine (or the model's own compute) "
            "differed between the runs; strategies are compared against it round by round, so this does not fail the gate"
        )
    slower = failed(rows)
    counts = {v: sum(r.verdict == v for r in rows) for v in dict.fromkeys(r.verdict for r in rows)}
    lines.append(", ".join(f"{n} {v}" for v, n in counts.items()) + f" (threshold {threshold:.0%})")
    if slower:
        lines.append(f"FAIL: {len(slower)} benchmark(s) slower by more than {threshold:.0%}: " + ", ".join(r.name for r in slower))
    return Gate(rows, warnings, lines, slower)
