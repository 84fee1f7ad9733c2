"""Where a benchmark run's time goes, by part and by benchmark, and what a run's length is said to
be before it starts.

A ``Ledger`` counts, per configuration and part (``PARTS``), how many times the part ran and the
seconds it took. Every rank process keeps one (``ddp.bench.rounds.rank_state.RankBench.ledger``:
builds, warm-up steps, memory counts, rounds and traced steps, timed where they run), which the
parent takes after each call (``take_ledger``) and adds to its own, beside the parts only the
parent sees: starting groups of ranks (``ddp.launcher.started_seconds``) and the memory
predictions that decide what is built together. The per-benchmark counts and seconds go into each
record (``builds``, ``warmup_rounds``, ``memory_counts``, ``traced_steps``, ``seconds_by_part``);
the run's time by part is printed at its end.

The length said before a run (``estimated_length``) is what a user can check: the seconds the
last saved run of the same benchmarks took, read from its records, or, where no such run was
saved, the ceiling the options put on the rounds and the untimed steps each configuration runs
besides. No model of the machine prices anything.

On CUDA every step a rank times ends in ``torch.cuda.synchronize`` (``Trainer.step``), and a
build's allocations are synchronous, so the seconds are the GPU's too; a traced step's include the
profiler's processing of the trace, which is what tracing costs a run.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Hashable, Iterable, Iterator, Sequence
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

    def record_counts(self, key: Hashable) -> dict[str, int | dict[str, float]]:
        """What a step record carries of ``key``'s costs: its counts (``RECORD_FIELDS``) and its
        seconds by part (``seconds_by_part``)."""
        counts: dict[str, int | dict[str, float]] = {name: self.count(key, part) for part, name in RECORD_FIELDS.items()}
        counts["seconds_by_part"] = self.seconds_by_part(key)
        return counts

    def seconds_by_part(self, key: Hashable) -> dict[str, float]:
        """``key``'s own seconds in each part it took (builds, warm-up, memory counts, rounds, traced
        steps, predictions), over every group of ranks; parts it took no time in are left out."""
        return {part: self.seconds[key, part] for part in PARTS if self.seconds.get((key, part))}


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


@dataclass(frozen=True)
class SavedRun:
    """What a saved run says of its length: per benchmark name its seconds (None where not
    counted), and the whole run's seconds where recorded."""

    label: str
    """How the line names it: its file and date."""
    benchmark_seconds: dict[str, float | None]
    run_seconds: float | None = None
    """The whole run's length, start-up and pytest's own time included (None before it was saved)."""
    rounds: dict | None = None
    """The rounds it was asked for (``RoundOptions`` as saved, its budget resolved): a run of other
    rounds is not the same run (None before it was saved)."""


@dataclass(frozen=True)
class LengthEstimate:
    """The ``estimated length:`` line and the seconds it gives (None where only a ceiling is known)."""

    seconds: float | None
    line: str


def estimated_length(selected: Sequence[str], saved: Iterable[SavedRun], rounds: dict, step_benchmarks: int,
                     untimed_steps: int) -> LengthEstimate:
    """The length of a run of the benchmarks named ``selected`` with ``rounds`` (``RoundOptions``
    as a dict, its budget resolved): the seconds the newest of ``saved`` that ran every one of
    them with the same rounds (and counted each one's seconds) took for them, plus what that run
    spent besides its benchmarks (start-up, pytest); else a ceiling from the options: at
    most ``round_budget_seconds`` of rounds a step benchmark (``min_rounds`` may take longer on a
    slow step), and ``untimed_steps`` untimed steps a configuration besides."""
    wanted = list(selected)
    for run in saved:
        seconds = [run.benchmark_seconds.get(name) for name in wanted]
        if not wanted or any(s is None for s in seconds) or run.rounds != rounds:
            continue
        besides = 0.0
        if run.run_seconds is not None:
            besides = max(0.0, run.run_seconds - sum(s for s in run.benchmark_seconds.values() if s is not None))
        total = sum(seconds) + besides
        return LengthEstimate(total, f"estimated length: {minutes_text(total)}, what these {len(wanted)} benchmarks took "
                                     f"in the last saved run of them ({run.label}); the time by part at the end says where "
                                     "this one's went")
    budget = rounds["budget_seconds"]
    return LengthEstimate(None, f"estimated length: no saved run of these {len(wanted)} benchmarks with these rounds to go by; "
                                f"the rounds of its {step_benchmarks} step benchmarks take at most "
                                f"{minutes_text(step_benchmarks * budget)} ({budget:g} s each, more only where "
                                f"{rounds['min_rounds']} rounds of a step take longer), and each configuration runs about "
                                f"{untimed_steps} untimed steps besides "
                                "(warm-up, memory count, traced steps); the time by part at the end says where it went")


def time_left(done: int, selected: int, elapsed_seconds: float) -> float | None:
    """Seconds the rest of ``selected`` benchmarks will take at the rate of the ``done`` ones (None
    before any is done)."""
    return None if done <= 0 else elapsed_seconds / done * (selected - done)
