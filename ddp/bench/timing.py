"""Hand measured rounds to pytest-benchmark.

pytest-benchmark times a target with its own clock. The rounds of ddp-bench are measured on the
ranks (``ddp.bench.measure``: the slowest rank's step, or all-reduce, of each round), so the
clock that pytest-benchmark reads here advances by exactly those seconds, one round per call: its
stats, its saved JSON and ``--benchmark-compare`` then hold the ranks' times, with none of the
parent's round trip to the ranks in them.
"""

from __future__ import annotations

from collections.abc import Sequence


class RoundClock:
    """A pytest-benchmark timer that advances by one measured round per ``next_round()``."""

    __name__ = "slowest_rank_clock"  # what pytest-benchmark records as the timer

    def __init__(self, round_seconds: Sequence[float]) -> None:
        self._rounds = list(round_seconds)
        self._index = 0
        self.seconds = 0.0

    def __call__(self) -> float:
        return self.seconds

    def next_round(self) -> None:
        # pytest-benchmark calls the target once more under --benchmark-cprofile: nothing measured is left
        if self._index < len(self._rounds):
            self.seconds += self._rounds[self._index]
            self._index += 1


def record_rounds(benchmark, round_seconds: Sequence[float]) -> None:
    """Give ``benchmark`` (pytest-benchmark's fixture) the measured ``round_seconds`` as its rounds."""
    clock = RoundClock(round_seconds)
    benchmark._timer = clock  # pytest-benchmark reads the clock through this attribute
    benchmark.pedantic(clock.next_round, rounds=len(round_seconds), warmup_rounds=0, iterations=1)
