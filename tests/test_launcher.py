"""The rank launcher: a failing or hanging rank fails its test quickly, with that rank's
traceback or every rank's stack, and the group is replaced for the next test."""

from __future__ import annotations

import os
import time

import pytest
import torch.distributed as dist

from ddp.launcher import Rank, RankError, RankGroup, on_rank
from tests.on_ranks import sum_of_ranks


@on_rank
def raise_on_rank_one(rank: Rank) -> None:
    if rank.info.rank == 1:
        raise ValueError("rank one cannot go on")
    dist.barrier()  # rank 0 waits for a rank that will never arrive


@on_rank
def hang_in_a_collective_on_rank_zero(rank: Rank) -> None:
    if rank.info.rank == 0:
        dist.barrier()
    else:
        time.sleep(3600)


@on_rank
def exit_on_rank_one(rank: Rank) -> None:
    if rank.info.rank == 1:
        os._exit(3)
    dist.barrier()


def own_pid() -> int:
    return os.getpid()


def environment_and_name(name: str) -> tuple[str | None, str]:
    return os.environ.get(name), open("/proc/self/comm").read().strip()


def test_a_rank_sees_the_environment_of_its_start_and_goes_by_its_name(monkeypatch):
    """Ranks are forked from a fork server started with the first group (``rank_process_context``),
    whose own environment is the parent's at that moment: a variable set afterwards still reaches
    the ranks of a later group, as a spawned process would have inherited it. Each rank names
    itself (its command line is the server's), which is how gpu-check tells ranks apart."""
    first = RankGroup(world_size=2, backend="gloo")
    first.run(own_pid)  # the fork server is running from here on
    first.close()
    monkeypatch.setenv("DDP_BENCH_TEST_SET_LATER", "seen")
    later = RankGroup(world_size=2, backend="gloo")
    try:
        assert later.run(environment_and_name, "DDP_BENCH_TEST_SET_LATER") == [("seen", "ddp-bench-rank0"),
                                                                                ("seen", "ddp-bench-rank1")]
    finally:
        later.close()


def test_runs_a_function_on_every_rank(rank_group):
    expected = sum(range(rank_group.world_size))
    assert rank_group.run(sum_of_ranks) == [expected] * rank_group.world_size


@pytest.mark.ranks(2, why="with one rank, there is no rank 1 to raise")
def test_rank_that_raises_fails_with_its_traceback_and_the_group_recovers(rank_group):
    started = rank_group.starts
    began = time.monotonic()
    with pytest.raises(RankError) as failure:
        rank_group.run(raise_on_rank_one)
    assert time.monotonic() - began < 30
    message = str(failure.value)
    assert "--- rank 1 ---" in message
    assert "ValueError: rank one cannot go on" in message
    assert "in raise_on_rank_one" in message
    assert rank_group.run(sum_of_ranks) == [sum(range(rank_group.world_size))] * rank_group.world_size
    assert rank_group.starts == started + 1


@pytest.mark.ranks(2, why="with one rank, rank 0 cannot wait in a collective for a rank that is not there")
def test_rank_that_hangs_fails_after_the_timeout_with_every_stack(rank_group):
    began = time.monotonic()
    with pytest.raises(RankError) as failure:
        rank_group.run(hang_in_a_collective_on_rank_zero, timeout_seconds=3)
    assert time.monotonic() - began < 30
    message = str(failure.value)
    assert "timed out after 3 s" in message
    assert "hang_in_a_collective_on_rank_zero" in message  # where the ranks were stuck
    assert "--- rank 0 ---" in message and "--- rank 1 ---" in message
    assert rank_group.run(sum_of_ranks) == [sum(range(rank_group.world_size))] * rank_group.world_size


@pytest.mark.ranks(2, why="with one rank, there is no rank 1 to die")
def test_rank_that_dies_is_reported(rank_group):
    with pytest.raises(RankError, match="rank 1 died with exit code 3"):
        rank_group.run(exit_on_rank_one, timeout_seconds=60)
    assert rank_group.run(sum_of_ranks) == [sum(range(rank_group.world_size))] * rank_group.world_size


def test_close_leaves_no_rank_process():
    group = RankGroup(world_size=2, backend="gloo")
    pids = group.run(own_pid)
    group.close()
    assert not group.started
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
