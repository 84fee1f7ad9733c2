"""The figures a report derives from saved runs: overheads over ``local``, winners, bucket plans,
run-to-run ratios and the machine facts that must match for them to mean anything. Pure: reads
``ddp.bench.results.records`` and computes; ``markdown`` and ``plots`` render."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ddp.bench.config.step_config import StepConfig
from ddp.bench.results.records import Run, StepRecord
from ddp.strategies.bucketed import BYTES_PER_MB
from ddp.strategies.registry import is_floor, traits


def step_order(step: StepRecord) -> tuple:
    """A step's place in tables: its configuration's (``StepConfig.sort_key``: registry order of
    strategies, then each axis's values in their declared order)."""
    return step.config.sort_key()


def sorted_steps(steps: list[StepRecord]) -> list[StepRecord]:
    """By group, then in registry order of strategies, then by their members (bucket cap, ...)."""
    return sorted(steps, key=lambda s: (s.group.sort_key(), step_order(s)))


def groups(steps: list[StepRecord]) -> list[StepConfig]:
    """The groups of ``steps`` (each its ``local`` twin's configuration), in the order of their axes' values."""
    return sorted({s.group for s in steps}, key=StepConfig.sort_key)


def several_models(steps: list[StepRecord]) -> bool:
    """Whether labels must name the model."""
    return len({s.config.model for s in steps}) > 1


@dataclass(frozen=True)
class Overhead:
    """A step against ``local`` at its configuration: paired over rounds where the run interleaved
    them (``overhead_seconds`` of the record, with its interval), else the difference of medians."""

    step: StepRecord
    local_seconds: float

    @property
    def paired(self) -> bool:
        return self.step.overhead_seconds is not None

    @property
    def ratio(self) -> float:
        return self.step.overhead_ratio if self.paired else self.step.step_seconds / self.local_seconds

    @property
    def extra_seconds(self) -> float:
        return self.step.overhead_seconds if self.paired else self.step.step_seconds - self.local_seconds

    @property
    def interval(self) -> list[float] | None:
        """95% interval of ``extra_seconds`` (paired runs only)."""
        return self.step.overhead_seconds_ci95 if self.paired else None

    @property
    def resolved(self) -> bool | None:
        """Whether the interval excludes 0: a cost the run resolved (None when unpaired)."""
        return None if self.interval is None else self.interval[0] > 0 or self.interval[1] < 0


def resolved_apart(a: StepRecord, b: StepRecord) -> bool:
    """Whether two steps' 95% intervals of their medians do not overlap: a difference the run resolves."""
    if not a.step_seconds_ci95 or not b.step_seconds_ci95:
        return True  # a step without an interval (a single round): nothing to judge by
    return a.step_seconds_ci95[1] < b.step_seconds_ci95[0] or b.step_seconds_ci95[1] < a.step_seconds_ci95[0]


def overheads_over_local(steps: list[StepRecord]) -> list[Overhead]:
    """Every step but the floors' against its floor (``StepConfig.local_twin``: ``local``, or
    ``local_mixed`` for FSDP in bf16) at the same configuration, where the floor ran."""
    local = {s.config: s.step_seconds for s in steps if is_floor(s.strategy)}
    return [
        Overhead(s, local[twin])
        for s in sorted_steps(steps)
        if not is_floor(s.strategy) and (twin := s.config.local_twin()) in local and local[twin] > 0
    ]


@dataclass(frozen=True)
class Win:
    """The fastest data-parallel strategy at one configuration, and its margins."""

    group: StepConfig
    winner: StepRecord
    runner_up: StepRecord | None
    references: list[StepRecord]
    """Each strategy the report measures a winner against (``Traits.reference_in_reports``:
    PyTorch's DDP, ``naive``) that ran here, at its best bucket cap."""


def fastest(steps: list[StepRecord]) -> StepRecord | None:
    return min(steps, key=lambda s: s.step_seconds, default=None)


def winners(steps: list[StepRecord]) -> list[Win]:
    """Per configuration, the fastest strategy other than ``local`` (bucket caps at their best)."""
    wins = []
    for group in groups(steps):
        here = [s for s in steps if s.group == group and not is_floor(s.strategy)]
        winner = fastest(here)
        if winner is None:
            continue
        best_per_strategy = [fastest([s for s in here if s.strategy == name]) for name in {s.strategy for s in here}]
        others = [s for s in best_per_strategy if s.strategy != winner.strategy]
        wins.append(
            Win(
                group=group,
                winner=winner,
                runner_up=fastest(others),
                references=[s for s in sorted(best_per_strategy, key=step_order) if traits(s.strategy).reference_in_reports],
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
        """The count a reader expects from total / cap (which it is not: see the commentary)."""
        return max(1, math.ceil(self.total_bytes / (self.bucket_size_mb * BYTES_PER_MB)))

    @property
    def oversized_buckets(self) -> int | None:
        """Buckets holding more than the cap: in ``bucketed``, a single tensor larger than the cap; in
        ``torch``, also a bucket PyTorch closed only once it had reached the cap."""
        if self.bucket_sizes_bytes is None:
            return None
        cap = self.bucket_size_mb * BYTES_PER_MB
        return sum(1 for size in self.bucket_sizes_bytes if size > cap)


def bucket_plans(steps: list[StepRecord]) -> list[BucketPlan]:
    plans = {}
    for s in sorted(steps, key=step_order):
        cap = s.config.bucket_size_mb
        if s.num_buckets is not None and cap is not None:
            plans.setdefault((s.strategy, cap), BucketPlan(s.strategy, cap, s.num_buckets, s.bytes_per_step, s.bucket_sizes_bytes))
    return list(plans.values())


def machine_summary(run: Run) -> dict[str, str]:
    """What a run records of its machine, as the report's header lists it."""
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


# The facts that must match for two runs' times to be comparable: a difference in any of them
# makes a ratio between the runs measure the machine as much as the code.
MACHINE_FACTS = ("node", "cpu", "cpu count", "torch", "backend", "device", "world size", "GPU", "CUDA", "NCCL")


def machine_differences(old: Run, new: Run) -> dict[str, tuple[str, str]]:
    """The ``MACHINE_FACTS`` that differ between two runs: {fact: (old, new)}."""
    a, b = machine_summary(old), machine_summary(new)
    return {key: (a.get(key, "unknown"), b.get(key, "unknown")) for key in MACHINE_FACTS if a.get(key) != b.get(key)}
