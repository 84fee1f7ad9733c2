"""A rank that a signal ends (the host's out-of-memory killer's SIGKILL, which no rank can catch or
report) is named: which rank of which group, the signal and its likely cause. The call fails with
``RankKilled`` and no rank process is left behind; a benchmark is skipped with that reason and the
next one runs on fresh ranks."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from ddp.bench.config.options import RoundOptions
from ddp.bench.config.step_config import StepConfig
from ddp.bench.rounds.grid_measurer import GridMeasurer
from ddp.bench.rounds.loop import NotRun
from ddp.bench.rounds.rank_state import RankLost, release
from ddp.launcher import Rank, RankKilled, on_rank, signal_cause
from ddp.strategies.declarations import declarations, declare
from ddp.strategies.local import LocalTraining
from tests.on_ranks import sum_of_ranks

OUT_OF_MEMORY_KILLER = "likely the host's out-of-memory killer: see `dmesg` / `journalctl -k`"


def own_pid() -> int:
    return os.getpid()


@on_rank
def killed_on_rank_one(rank: Rank) -> None:
    if rank.info.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # as the out-of-memory killer ends a process
    dist.barrier()  # rank 0 waits for a rank that is gone


class KilledOnRankOne(LocalTraining):
    """A user's strategy, ``tests.test_rank_killed:KilledOnRankOne``, whose first step ends rank
    1's process with SIGKILL, as the out-of-memory killer would."""

    def finish_gradient_synchronization(self) -> None:
        if dist.get_rank(self.process_group) == 1:
            os.kill(os.getpid(), signal.SIGKILL)


declare(KilledOnRankOne, **declarations(LocalTraining))


def assert_gone(pids: list[int]) -> None:
    """No process of ``pids`` is left, not even unreaped."""
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def wait_until_ended(pid: int) -> None:
    """Until the kernel has ended ``pid``, leaving it for its parent to reap: a zombie, and a
    moment more (a process shows as one while its other threads still tear down, pipes open)."""
    deadline = time.monotonic() + 10.0
    stat = Path(f"/proc/{pid}/stat")
    while stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z" and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)


def test_a_signal_is_named_with_its_likely_cause():
    assert signal_cause(signal.SIGKILL) == ("SIGKILL", OUT_OF_MEMORY_KILLER)
    name, cause = signal_cause(signal.SIGBUS)
    assert name == "SIGBUS" and "/dev/shm" in cause
    assert signal_cause(signal.SIGUSR2) == ("SIGUSR2", "user defined signal 2")  # strsignal's words
    assert signal_cause(200) == ("signal 200", "an unknown signal")


@pytest.mark.ranks(2, why="with one rank, there is no rank 1 to kill while rank 0 waits for it")
def test_a_rank_killed_in_a_call_is_named_and_the_next_call_runs_on_fresh_ranks(rank_group):
    before = rank_group.run(own_pid)
    started = rank_group.starts
    with pytest.raises(RankKilled) as killed:
        rank_group.run(killed_on_rank_one, timeout_seconds=60)
    summary = killed.value.summary
    assert summary.startswith(f"rank 1 of {rank_group.label} (pid {before[1]}) was killed by SIGKILL in "
                              "tests.test_rank_killed.killed_on_rank_one")
    assert summary.endswith(OUT_OF_MEMORY_KILLER)
    assert killed.value.rank == 1 and killed.value.signal_name == "SIGKILL"
    assert_gone(before)  # rank 0, waiting in the barrier, was ended with it
    after = rank_group.run(own_pid)
    assert rank_group.starts == started + 1 and not set(after) & set(before)
    assert rank_group.run(sum_of_ranks) == [sum(range(rank_group.world_size))] * rank_group.world_size


def test_a_rank_killed_between_calls_is_named_by_the_next_call(rank_group):
    """The call cannot be sent to a rank whose process is gone: a named error, not the pipe's
    BrokenPipeError; SIGTERM is named with its own cause."""
    before = rank_group.run(own_pid)
    os.kill(before[0], signal.SIGTERM)
    wait_until_ended(before[0])
    with pytest.raises(RankKilled) as killed:
        rank_group.run(sum_of_ranks)
    assert str(killed.value).startswith(
        f"rank 0 of {rank_group.label} (pid {before[0]}) was killed by SIGTERM in tests.on_ranks.sum_of_ranks, "
        "asked to stop from outside"
    )
    assert_gone(before)
    assert rank_group.run(sum_of_ranks) == [sum(range(rank_group.world_size))] * rank_group.world_size


@pytest.mark.slow
@pytest.mark.ranks(2, why="with one rank, there is no rank 1 to kill")
def test_a_benchmark_whose_rank_is_killed_is_skipped_by_name_and_the_next_one_runs(rank_group):
    killed = StepConfig("tests.test_rank_killed:KilledOnRankOne", "tiny", 2, 16)
    fine = StepConfig("local", "tiny", 2, 16)
    measurer = GridMeasurer(rank_group, [killed, fine], RoundOptions.fixed(2, 0), "off", memory_bytes=2**40)
    before = rank_group.run(own_pid)
    skipped = measurer.measurement(killed)
    assert isinstance(skipped, NotRun) and isinstance(skipped.marker, RankLost)
    reason = skipped.reason(rank_group.world_size)  # what perf_tests/test_step.py skips with
    assert reason.startswith(f"rank killed: {killed.describe()}, {rank_group.world_size} ranks: "
                             f"rank 1 of {rank_group.label} (pid {before[1]}) was killed by SIGKILL in ")
    assert OUT_OF_MEMORY_KILLER in reason and "\n" not in reason
    assert_gone(before)
    measured = measurer.measurement(fine)
    assert not isinstance(measured, NotRun) and len(measured[0].rounds) == 2
    assert not set(rank_group.run(own_pid)) & set(before)
    rank_group.run(release)
