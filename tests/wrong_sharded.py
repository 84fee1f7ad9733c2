"""Sharded optimizers and an FSDP class with one known mistake each, for testing that the
correctness suite names it.

Each class changes one thing of a correct one: the sharded optimizers change ``ddp``'s
``ShardedOptimizer`` (the course's adapter shape, ``(params, optimizer_cls, **kwargs)``, which the
registry turns into a strategy), the FSDP class changes ``FullyShardedDP``. Both correct classes
pass the same tests (``test_strategies``), so each failure comes from the one change. They live at
module level so that they load by import path, like a user's class:
"tests.wrong_sharded:StepsShardTwice".
"""

from __future__ import annotations

import torch

from ddp.strategies.declarations import declarations, declare
from ddp.strategies.fsdp import FullyShardedDP, Unit
from ddp.strategies.sharded_optimizer import ShardedOptimizer


class StepsShardTwice(ShardedOptimizer):
    """Steps this rank's shard twice in each step (a step() that calls the inner optimizer again)."""

    def step(self, closure=None):
        if self.local_optimizer is not None:
            self.local_optimizer.step()
        return super().step(closure)


class FirstRankNeverSteps(ShardedOptimizer):
    """Rank 0's shard is never stepped (a loop over the ranks that starts at 1)."""

    def step(self, closure=None):
        if self.rank == 0:
            self._broadcast_updated()
            return None
        return super().step(closure)


class NeverGathersBack(ShardedOptimizer):
    """Steps its shard but never sends it: the other ranks keep the old values of this rank's parameters."""

    def _broadcast_updated(self) -> None:
        pass


class SumsShardedGradients(FullyShardedDP):
    """Reduce-scatters gradients with SUM and never divides by the world size."""

    @torch.no_grad()
    def _reduce_scatter(self, unit: Unit) -> None:
        gradient = unit.full.grad.to(torch.float32)
        unit.full.grad = None
        unit.full.untyped_storage().resize_(0)
        self._send(unit, gradient)


declare(SumsShardedGradients, **declarations(FullyShardedDP))
