"""``bucketed`` hooks only each bucket's last gradient in the ready order once it has re-planned in
that order (its trigger). When a backward comes in another order, the trigger runs before other
gradients of its bucket: the bucket must then be launched by ``finish_gradient_synchronization``
with those late gradients in it, averaged like the rest, with or without ``no_sync()``. The
reference is one process on the whole batch."""

from __future__ import annotations

import contextlib

import pytest
import torch

from ddp.launcher import Rank, on_rank
from ddp.strategies.bucketed import BucketedDDP


class Flipping(torch.nn.Module):
    """Two branches whose order of use flips with ``flip``: autograd runs the later one's backward
    first, so the order gradients come in changes from one backward to the next, and a segment's
    hooked gradient can come before the others of its segment (they then come late)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, flip: bool) -> torch.Tensor:
        first, second = (self.b, self.a) if flip else (self.a, self.b)
        y = first(x)
        return self.head(torch.tanh(y + second(x)))


@on_rank
def gradients_in_flipping_order(rank: Rank, micro_batches: int) -> float:
    """On every rank: ``bucketed`` (the model in one bucket) against one process on the whole batch,
    five steps whose ready order flips each backward; the largest gradient difference."""
    info = rank.info
    torch.manual_seed(0)
    reference = Flipping()
    model = BucketedDDP(Flipping(), bucket_size_mb=1.0, process_group=torch.distributed.group.WORLD)
    model.module.load_state_dict(reference.state_dict())
    generator = torch.Generator().manual_seed(5)
    worst = 0.0
    for step in range(5):
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        for micro in range(micro_batches):
            flip = (step + micro) % 2 == 1
            x = torch.randn(4 * info.world_size, 8, generator=generator)
            target = torch.randn(4 * info.world_size, 1, generator=generator)
            (torch.nn.functional.mse_loss(reference(x, flip), target) / micro_batches).backward()
            rows = slice(4 * info.rank, 4 * (info.rank + 1))
            context = model.no_sync() if micro < micro_batches - 1 else contextlib.nullcontext()
            with context:
                (torch.nn.functional.mse_loss(model(x[rows], flip), target[rows]) / micro_batches).backward()
        model.finish_gradient_synchronization()
        for mine, expected in zip(model.module.parameters(), reference.parameters()):
            worst = max(worst, (mine.grad - expected.grad).abs().max().item())
        assert len(model.buckets) == 1
    model.close()
    return worst


@pytest.mark.parametrize("micro_batches", [1, 2], ids=["step", "no_sync"])
def test_gradients_that_come_after_their_buckets_trigger_are_averaged(rank_group, micro_batches):
    assert max(rank_group.run(gradients_in_flipping_order, micro_batches)) < 1e-6
