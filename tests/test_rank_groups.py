"""A benchmark's rounds spread over groups of ranks started apart (``ddp.bench.rounds.spread.measure_in_rank_groups``):
how the rounds are divided and labelled, what each group keeps built, and, on real ranks, that the
record carries each round's group and an interval over both."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

from ddp.bench.config.options import RoundOptions
from ddp.bench.config.step_config import StepConfig
from ddp.bench.memory.predict import fit
from ddp.bench.results.stats import median_ci, median_interval
from ddp.bench.rounds.allreduce import AllReduceTiming, measure_all_reduces
from ddp.bench.rounds.grid_measurer import GridMeasurer
from ddp.bench.rounds.rank_state import prepare, release, timed_round
from ddp.bench.rounds.spread import measure_in_rank_groups, rank_group_share
from ddp.bench.rounds.summary import step_record
from ddp.launcher import Rank, RankGroup, on_rank

STEP = StepConfig("bucketed", "tiny", batch_size=2, seq_len=16, bucket_size_mb=1.0)


@dataclass(frozen=True)
class Timing:
    step_seconds: float
    sync_wait_seconds: float = 0.0
    peak_memory_bytes: int | None = None

    @property
    def seconds(self) -> float:
        return self.step_seconds


class Recording:
    """A group of one rank whose every step takes ``seconds``; ``calls`` logs what ran on it, in
    order, into a log the groups share."""

    world_size = 1

    def __init__(self, name: str, seconds: float, log: list) -> None:
        self.name, self.seconds, self.log = name, seconds, log

    def run(self, fn, *args):
        self.log.append((self.name, fn.__name__))
        if fn is timed_round:
            return [[Timing(self.seconds) for _ in args[0]]]
        return [[None for _ in args[0]] if fn is prepare else None]


def test_rounds_are_divided_among_the_groups_and_keep_their_group():
    log: list = []
    groups = [Recording("a", 0.01, log), Recording("b", 0.02, log)]
    measured = measure_in_rank_groups(groups, [STEP], RoundOptions.fixed(10, 0))
    assert measured.round_groups == [0] * 5 + [1] * 5
    assert measured.round_seconds(0) == [0.01] * 5 + [0.02] * 5
    assert [name for name, fn in log if fn == "timed_round"] == ["a"] * 5 + ["b"] * 5  # a block each, in turn
    assert ("a", "release") not in log  # kept built: the next strategy of its group reuses its local twin
    # the interval over them is two-level: wider than the rounds as one group
    low, high = median_interval(measured.round_seconds(0), measured.round_groups)
    assert low < 0.01 and high > 0.02 and median_ci(measured.round_seconds(0)) == (0.01, 0.02)


def test_a_group_frees_its_build_before_the_next_builds_where_both_would_not_fit():
    log: list = []
    groups = [Recording("a", 0.01, log), Recording("b", 0.01, log)]
    measure_in_rank_groups(groups, [STEP], RoundOptions.fixed(4, 0), keep_built=False)
    first_b = log.index(("b", "prepare"))
    assert log.index(("a", "release")) < log.index(("a", "return_cached_memory")) < first_b


def test_each_group_gets_its_share_of_the_budget_and_the_rounds():
    policy = RoundOptions(min_rounds=5, max_rounds=2000, warmup_rounds=1, target_precision=0.02, budget_seconds=100.0)
    share = rank_group_share(policy, 2)
    assert (share.min_rounds, share.max_rounds, share.budget_seconds, share.warmup_rounds) == (3, 1000, 50.0, 1)
    assert share.target_precision == pytest.approx(0.02 * 2**0.5)  # both groups together: about the target
    assert rank_group_share(policy, 2, 1).min_rounds == 2  # the shares add up to the whole: 3 + 2
    assert rank_group_share(policy, 1) is policy


def test_exactly_the_rounds_asked_for_however_they_divide():
    log: list = []
    measured = measure_in_rank_groups([Recording("a", 0.01, log), Recording("b", 0.02, log)], [STEP], RoundOptions.fixed(5, 0))
    assert measured.round_groups == [0, 0, 0, 1, 1]
    log.clear()
    one = measure_in_rank_groups([Recording("a", 0.01, log), Recording("b", 0.02, log)], [STEP], RoundOptions.fixed(1, 0))
    assert one.round_groups == [0] and all(name == "a" for name, _ in log)  # a share of no rounds is not run


def test_two_groups_builds_count_twice_in_memory():
    config = StepConfig("bucketed", "mini", batch_size=4, seq_len=64, bucket_size_mb=1.0)
    one, two = fit([config], 2**40, 2), fit([config, config], 2**40, 2)
    assert two.needed_together_bytes > one.needed_together_bytes


@on_rank
def process_id(rank: Rank) -> int:
    return os.getpid()


@pytest.mark.slow
def test_the_rounds_of_a_grid_come_from_two_groups_of_processes(rank_group):
    other = RankGroup(rank_group.world_size, rank_group.backend, rank_group.device, rank_group.timeout_seconds)
    try:
        measurer = GridMeasurer(rank_group, [STEP], RoundOptions.fixed(6, 1), "local", more_groups=[other])
        measurement, index, local_index = measurer.measurement(STEP)
        assert measurement.round_groups == [0, 0, 0, 1, 1, 1]
        assert set(rank_group.run(process_id)).isdisjoint(other.run(process_id))  # fresh processes
        record = step_record(measurement, rank_group.backend, "cpu", index, local_index)
        assert record.round_groups == [0, 0, 0, 1, 1, 1] and len(record.local_round_seconds) == 6
        low, high = record.step_seconds_ci95
        assert [low, high] == list(median_interval(record.round_seconds, record.round_groups))
    finally:
        rank_group.run(release)
        other.close()


class AllReducing:
    """A group of two ranks whose every all-reduce takes ``seconds`` (the slower rank's)."""

    backend, world_size = "gloo", 2

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def run(self, fn, *args):
        if fn.__name__ == "timed_all_reduces":
            return [[AllReduceTiming(rank, self.seconds * (1 + rank), 0) for _ in args[0]] for rank in range(2)]
        return [None, None]


def test_all_reduce_rounds_are_spread_over_the_groups_too():
    (record,) = measure_all_reduces(AllReducing(0.01), [4096], RoundOptions.fixed(6, 1), more_groups=[AllReducing(0.03)])
    assert record.round_groups == [0, 0, 0, 1, 1, 1]
    assert record.round_seconds == [0.02] * 3 + [0.06] * 3  # each round's slowest rank
    assert record.seconds_ci95 == list(median_interval(record.round_seconds, record.round_groups))
