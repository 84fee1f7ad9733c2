"""Where a benchmark run's time goes, by part: what each configuration cost besides its rounds.

A ``Ledger`` counts, per configuration and part (``PARTS``), how many times the part ran and the
seconds it took. Every rank process keeps one (``ddp.bench.rounds.rank_state.RankBench.ledger``:
builds, warm-up steps, memory counts, rounds and traced steps, timed where they run), which the
parent takes after each call (``take_ledger``) and adds to its own, beside the parts only the
parent sees: starting groups of ranks (``ddp.launcher.started_seconds``) and the memory
predictions that decide what is built together. The per-benchmark counts go into each record
(``builds``, ``warmup_rounds``, ``memory_counts``, ``traced_steps``); the run's time by part is
printed at its end, beside the estimate printed before it started (``ddp.bench.rounds.estimate``).

On CUDA every step a rank times ends in ``torch.cuda.synchronize`` (``Trainer.step``), and a
build's allocations are synchronous, so the seconds are the GPU's too; a traced step's include the
profiler's processing of the trace, which is what tracing costs a run.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

STARTUP = "start-up"
BUILDS = "builds"
WARMUP = "warm-up"
MEMORY_COUNTS = "memory counts"
ROUNDS = "rounds"
TRACED = "traced steps"
PREDICTIONS = "predictions"
PARTS = (STARTUP, BUILDS, WARMUP, MEMORY_COUNTS, ROUNDS, TRACED, PREDICTIONS)
"""The parts of a run's time, in the order a benchmark meets them."""

RESTORED = "restored builds"
"""A count, not a part: the builds (in ``BUILDS``) served from a kept copy (``ddp.bench.rounds.reuse``)."""
RECORD_FIELDS = {BUILDS: "builds", RESTORED: "restored_builds", WARMUP: "warmup_rounds", MEMORY_COUNTS: "memory_counts",
                 TRACED: "traced_steps"}
"""The counts a step record carries, by part: builds (fresh or restored), those restored, untimed
steps, memory counts and traced steps of its configuration over every group of ranks that ran it."""


@dataclass
class Ledger:
    """Counts and seconds by (configuration or None, part)."""

    counts: Counter = field(default_factory=Counter)
    seconds: Counter = field(default_factory=Counter)

    def add(self, part: str, seconds: float, key: Hashable = None, count: int = 1) -> None:
        if part not in PARTS and part != RESTORED:
            raise ValueError(f"unknown part {part!r}; parts: {', '.join(PARTS)}")
        self.counts[key, part] += count
        self.seconds[key, part] += seconds

    @contextmanager
    def timing(self, part: str, key: Hashable = None, count: int = 1) -> Iterator[None]:
        """Add the time the block takes to ``part``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(part, time.perf_counter() - start, key, count)

    def merge(self, other: Ledger) -> None:
        self.counts.update(other.counts)
        self.seconds.update(other.seconds)

    def by_part(self) -> dict[str, float]:
        """Seconds per part over every configuration, every part present (0 where none ran)."""
        totals = dict.fromkeys(PARTS, 0.0)
        for (_, part), seconds in self.seconds.items():
            if part in totals:
                totals[part] += seconds
        return totals

    def count(self, key: Hashable, part: str) -> int:
        return self.counts.get((key, part), 0)

    def record_counts(self, key: Hashable) -> dict[str, int]:
        """The counts a step record carries for ``key`` (``RECORD_FIELDS``)."""
        return {name: self.count(key, part) for part, name in RECORD_FIELDS.items()}


def take(ledger: Ledger) -> Ledger:
    """A copy of ``ledger``'s entries, ``ledger`` emptied (what the parent collects from a rank)."""
    taken = Ledger(Counter(ledger.counts), Counter(ledger.seconds))
    ledger.counts.clear()
    ledger.seconds.clear()
    return taken


def minutes_text(seconds: float) -> str:
    """``9 min 40 s``, ``45 s``."""
    whole = round(seconds)
    return f"{whole // 60} min {whole % 60} s" if whole >= 60 else f"{whole} s"
