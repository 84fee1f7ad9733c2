"""The all-reduce microbenchmark: backend x float32 size x world size, measured as nccl-tests does.

Each round times one checked all-reduce on every rank after a barrier; the round's time is the
slowest rank's own time (see ``SlowestRankClock``), warm-up rounds are excluded, and every round
counts wrong elements, which must be 0. Formulas: ddp/allreduce.py.
"""

from __future__ import annotations

import statistics


from ddp.allreduce import BYTES_PER_MB, FLOAT32_BYTES, algbw_gbps, busbw_gbps, release_buffer, timed_all_reduce


class SlowestRankClock:
    """A clock for pytest-benchmark that advances only by the slowest rank's time of each round.

    pytest-benchmark times the whole target, here a ``RankGroup.run`` round trip to the ranks,
    which for a 1 MB all-reduce would add a sizeable share of the collective's own time. Read
    through this clock, a round lasts exactly as long as the slowest rank's timed all-reduce.
    """

    __name__ = "slowest_rank_clock"  # what pytest-benchmark records as the timer

    def __init__(self) -> None:
        self.seconds = 0.0

    def __call__(self) -> float:
        return self.seconds

    def advance(self, seconds: float) -> None:
        self.seconds += seconds


def test_allreduce(benchmark, allreduce_group, allreduce_world_size: int, allreduce_size_mb: float, grid) -> None:
    group = allreduce_group
    size_bytes = int(allreduce_size_mb * BYTES_PER_MB) // FLOAT32_BYTES * FLOAT32_BYTES
    benchmark.group = f"all_reduce: {group.backend}, {group.world_size} ranks"
    clock = SlowestRankClock()
    benchmark._timer = clock  # pytest-benchmark reads the clock through this attribute
    rounds = []

    def one_round() -> None:
        timings = group.run(timed_all_reduce, size_bytes)
        clock.advance(max(t.seconds for t in timings))
        rounds.append(timings)

    try:
        benchmark.pedantic(one_round, rounds=grid.rounds, warmup_rounds=grid.warmup_rounds, iterations=1)
    finally:
        group.run(release_buffer)

    wrong = sum(t.wrong for timings in rounds for t in timings)
    seconds = statistics.median(max(t.seconds for t in timings) for timings in rounds[-grid.rounds :])
    benchmark.extra_info.update(
        {
            "backend": group.backend,
            "world_size": group.world_size,
            "size_bytes": size_bytes,
            "algbw_gbps": algbw_gbps(size_bytes, seconds),
            "busbw_gbps": busbw_gbps(size_bytes, seconds, group.world_size),
            "wrong": wrong,
        }
    )
    assert wrong == 0, f"{wrong} elements of {size_bytes // FLOAT32_BYTES} held a wrong sum after all_reduce"
