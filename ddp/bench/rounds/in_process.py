"""``InProcessRanks``: the ranks of a measurement when this process is itself one of torchrun's
ranks (``ddp run``): every call runs here and its result is gathered to every rank, so that all of
them take the same decisions."""

from __future__ import annotations

import datetime

import torch.distributed as dist

from ddp.bench.rounds.rank_state import (
    OutOfMemory,
    RankCannotRun,
)
from ddp.launcher import Rank, call_on_rank


class InProcessRanks:
    """``RankGroup``'s ``run`` for a process that is itself one of the ranks (under torchrun):
    run the function here and gather every rank's result to every rank, so that all of them take
    the same decisions (skip on out of memory, stop adding rounds).

    Results travel on a gloo group of their own with a timeout: a rank that ran out of memory
    alone cannot be joined by the others (they wait in a collective it left), and rather than hang
    until the NCCL watchdog, its gather fails after ``GATHER_TIMEOUT_SECONDS`` and the job ends with
    that rank's out-of-memory message (torchrun then stops the other ranks)."""

    GATHER_TIMEOUT_SECONDS = 60.0

    def __init__(self, rank: Rank) -> None:
        self.rank = rank
        self.world_size = rank.info.world_size
        self.backend = rank.info.backend
        self.device = rank.info.device.type
        self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.GATHER_TIMEOUT_SECONDS))

    def run(self, fn, *args, **kwargs) -> list:
        result = call_on_rank(self.rank, fn, args, kwargs)
        results = [None] * self.world_size
        try:
            dist.all_gather_object(results, result, group=self._group)
        except RuntimeError as error:
            if isinstance(result, OutOfMemory):
                raise RuntimeError(
                    f"rank {result.rank} ran out of memory alone ({result.message}) and the other ranks are waiting "
                    "in a collective it left: ending the job; use a smaller --batch-sizes, --seq-lens or --model"
                ) from error
            if isinstance(result, RankCannotRun):
                raise RuntimeError(
                    f"rank {result.rank} alone cannot run this configuration ({result.message}) and the other ranks are "
                    "waiting in a collective it left: ending the job"
                ) from error
            raise
        return results
