"""Hand measured rounds to pytest-benchmark through its public interface.

pytest-benchmark times a target with a timer. The rounds of ddp-bench are measured on the ranks
(``ddp.bench.rounds.loop``: the slowest rank's step, or all-reduce, of each round), so the timer of a
ddp-bench benchmark is ``ROUND_CLOCK``, given per test by pytest-benchmark's own marker
(``benchmark_marker``: ``@pytest.mark.benchmark(timer=...)``), which advances by exactly one
measured round per call of its target: pytest-benchmark's stats, its saved JSON and
``--benchmark-compare`` then hold the ranks' times, with none of the parent's round trip to the
ranks in them. The marker also records the round policy as the benchmark's options.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest


class RoundClock:
    """A pytest-benchmark timer that advances by one measured round per ``next_round()``."""

    __name__ = "round_clock"  # pytest-benchmark names its timer in the saved options

    def __init__(self) -> None:
        self.load([])

    def __call__(self) -> float:
        self.reads += 1
        return self.seconds

    def load(self, round_seconds: Sequence[float]) -> None:
        self._rounds = list(round_seconds)
        self._index = 0
        self.seconds = 0.0
        self.reads = 0

    def next_round(self) -> None:
        # pytest-benchmark calls the target once more under --benchmark-cprofile: nothing measured is left
        if self._index < len(self._rounds):
            self.seconds += self._rounds[self._index]
            self._index += 1


ROUND_CLOCK = RoundClock()


def benchmark_options(rounds) -> dict:
    """pytest-benchmark's options of a ddp-bench benchmark, with the values its rounds were measured
    under (a ``ddp.bench.config.options.RoundOptions``): what a saved run records in ``options``."""
    budget = rounds.budget_seconds
    return {"timer": ROUND_CLOCK, "disable_gc": False, "min_rounds": rounds.min_rounds,
            "max_time": budget if budget is not None and math.isfinite(budget) else None, "warmup": rounds.warmup_rounds > 0}


def benchmark_marker(rounds) -> pytest.MarkDecorator:
    """The marker every ddp-bench benchmark carries (perf_tests/conftest.py adds it)."""
    return pytest.mark.benchmark(**benchmark_options(rounds))


def record_rounds(benchmark, round_seconds: Sequence[float]) -> None:
    """Give ``benchmark`` (pytest-benchmark's fixture, marked with ``benchmark_marker``) the measured
    ``round_seconds`` as its rounds."""
    ROUND_CLOCK.load(round_seconds)
    benchmark.pedantic(ROUND_CLOCK.next_round, rounds=len(round_seconds), warmup_rounds=0, iterations=1)
    if not benchmark.disabled and ROUND_CLOCK.reads == 0:
        raise RuntimeError("the benchmark's timer is not ddp-bench's round clock: mark the test with "
                           "ddp.bench.results.timing.benchmark_marker (perf_tests/conftest.py does it for perf_tests/)")
