"""Regression checks that know noise: two runs compared benchmark by benchmark, each ratio
new / old with its 95% interval, and a verdict that only a resolved difference can fail.

Benchmarks are matched by name. For each, the ratio of medians new / old gets a bootstrap interval
over the two runs' rounds (``ddp.bench.stats.ratio_of_medians_ci``), and the verdict against a
threshold t (``ddp.bench.stats.verdict``): *slower* when the whole interval lies above 1 + t,
*faster* below 1 - t, *unchanged* inside [1 - t, 1 + t], *not resolved* when it straddles a
threshold. The gate fails only on *slower*: a slowdown by more than the threshold that the rounds
resolve. pytest-benchmark's own ``--benchmark-compare-fail`` compares medians alone; here noise
widens the interval instead of failing the gate.

Two runs from different machines, backends, devices, GPUs or torch versions measure the machine
as much as the code: ``machine_differences`` names what differs, and the report says so first.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddp.analysis.figures import machine_differences
from ddp.bench.records import Run
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
        if not a.round_seconds or not b.round_seconds:
            rows.append(BenchmarkComparison(name, a.median_seconds, b.median_seconds, b.median_seconds / a.median_seconds,
                                            None, "no rounds saved"))
            continue
        ratio, low, high = ratio_of_medians_ci(b.round_seconds, a.round_seconds)
        rows.append(BenchmarkComparison(name, a.median_seconds, b.median_seconds, ratio, (low, high),
                                        str(verdict(low, high, threshold))))
    return rows


def failed(rows: list[BenchmarkComparison]) -> list[BenchmarkComparison]:
    """The benchmarks that fail the gate: resolved slowdowns beyond the threshold."""
    return [row for row in rows if row.verdict == str(Verdict.SLOWER)]


def suspect_differences(old: Run, new: Run) -> dict[str, tuple[str, str]]:
    """Machine facts that differ between the runs and make their ratios suspect."""
    return {key: value for key, value in machine_differences(old, new).items() if key in MACHINE_FACTS}
