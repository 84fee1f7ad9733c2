"""Which bucket size for my model, measured: a sweep of the bucketing strategies over bucket caps on
this machine's ranks, and the all-reduces a link is fitted on (``ddp buckets`` puts the cost
model's recommendation for larger world sizes beside it).

Each cap is measured through the one timing loop with a round of ``local`` interleaved in every
round (or, where the two do not fit in memory together, one at a time in alternating blocks of
rounds: ``ddp.bench.rounds.blocks.measure_in_blocks``), so its cost is a paired overhead over ``local``
with a 95% interval: caps are compared on what synchronizing costs, not on step times that drift with the machine. The best measured cap is
the one with the smallest overhead; the sweep says whether the runner-up's interval overlaps it
(then the data do not tell them apart). ``fitted_link`` measures all-reduces on the same ranks for
the cost model's link (``ddp.analysis.costmodel.fit_link``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ddp.bench.config.options import RoundOptions
from ddp.bench.config.step_config import StepConfig
from ddp.bench.memory.predict import device_memory_bytes, fit
from ddp.bench.results.machine import device_name
from ddp.bench.results.records import StepRecord
from ddp.bench.rounds.allreduce import measure_all_reduces, size_bytes_of
from ddp.bench.rounds.blocks import measure_in_blocks
from ddp.bench.rounds.loop import NotRun, free, measure
from ddp.bench.rounds.summary import step_record
from ddp.strategies.registry import BUCKETED_STRATEGIES

# All-reduce sizes the link is fitted on when no preset is given (MiB): latency- and bandwidth-bound.
FIT_SIZES_MB = (0.25, 4.0, 32.0)


@dataclass(frozen=True)
class Sweep:
    records: list[StepRecord]
    """One per strategy and cap, each paired with local."""
    skipped: list[str]
    """Caps that ran out of memory, with the reason."""

    def best(self, strategy: str) -> StepRecord | None:
        mine = [r for r in self.records if r.strategy == strategy]
        return min(mine, key=lambda r: r.overhead_seconds, default=None)

    def resolved_best(self, strategy: str) -> bool:
        """Whether the best cap's overhead interval lies below every other cap's."""
        best = self.best(strategy)
        others = [r for r in self.records if r.strategy == strategy and r is not best]
        return best is not None and all(best.overhead_seconds_ci95[1] < r.overhead_seconds_ci95[0] for r in others)


def sweep(ranks, values: Mapping, caps_mb: tuple[float, ...], policy: RoundOptions,
          strategies: tuple[str, ...] = BUCKETED_STRATEGIES) -> Sweep:
    """Each strategy at each cap with ``values`` (``StepConfig`` fields by name: model, batch size,
    precision, ...), paired with ``local``; the ranks are freed afterwards."""
    records, skipped = [], []
    memory_bytes = min(ranks.run(device_memory_bytes))
    for strategy in strategies:
        for cap in caps_mb:
            config = StepConfig.of(strategy, {**values, "bucket_size_mb": cap})
            pair = [config, config.local_twin()]
            memory = fit(pair, memory_bytes, ranks.world_size)
            if memory.too_large():
                skipped.append(memory.too_large())
                continue
            if memory.together:
                result = measure(ranks, pair, policy)
            else:
                result, _ = measure_in_blocks(ranks, pair, policy)
            if isinstance(result, NotRun):
                free(ranks)
                skipped.append(result.reason(ranks.world_size))
                continue
            records.append(step_record(result, ranks.backend, device_name(ranks.device), 0, 1))
    free(ranks)
    return Sweep(records, skipped)


def link_samples(ranks, policy: RoundOptions) -> list[tuple[int, int, float]]:
    """``(size_bytes, world_size, seconds)`` of all-reduces at ``FIT_SIZES_MB`` on ``ranks``, to fit
    the cost model's link on."""
    records = measure_all_reduces(ranks, [size_bytes_of(mb) for mb in FIT_SIZES_MB], policy)
    return [(record.size_bytes, record.world_size, record.seconds) for record in records]
