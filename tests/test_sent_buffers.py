"""A temporary a strategy sends through a collective is freed when the strategy has waited for it,
whoever else still refers to it: gloo's worker thread keeps a completed work (and its tensors) a
moment after ``wait()`` returns, and a buffer that outlived the step's synchronization by that
race (gloo's clone of ``fsdp``'s root gradient) moved its memory peak into the optimizer step on a
fresh clone (``tests/test_memory_prediction.py``). Here the collective's caller keeps every input,
as the worker may, and each must have no storage left once ``finish_gradient_synchronization``
returns. The reference is the storage itself: what a tensor still holds is what is allocated.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from ddp.launcher import Rank, on_rank
from ddp.strategies.flat import FlatDDP
from ddp.strategies.fsdp import FullyShardedDP

STRATEGIES = {"fsdp": FullyShardedDP, "flat": FlatDDP}
COLLECTIVES = ("all_reduce", "reduce_scatter_tensor")


@contextlib.contextmanager
def inputs_kept(kept: list[torch.Tensor]):
    """Every gradient collective's input appended to ``kept`` (a reference that outlives the call)."""
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def keeping(name):
        def collective(*args, **kwargs):
            kept.append(args[1] if name == "reduce_scatter_tensor" else args[0])
            return originals[name](*args, **kwargs)
        return collective

    for name in COLLECTIVES:
        setattr(dist, name, keeping(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


@on_rank
def bytes_left_in_sent_buffers(rank: Rank, strategy: str) -> tuple[int, int]:
    """(inputs kept, bytes their storages still hold) after one step's synchronization."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    model = STRATEGIES[strategy](module, process_group=dist.group.WORLD)
    kept: list[torch.Tensor] = []
    try:
        with inputs_kept(kept):
            model(torch.randn(8, 16)).square().mean().backward()
            model.finish_gradient_synchronization()
        gradients = [p.grad for p in model.parameters()]
        assert all(g is not None and g.untyped_storage().nbytes() > 0 for g in gradients)
        return len(kept), sum(t.untyped_storage().nbytes() for t in kept)
    finally:
        model.close()


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_a_sent_temporary_is_freed_once_waited(rank_group, strategy):
    if rank_group.device != "cpu":
        pytest.skip("the race is gloo's worker thread; NCCL's inputs are freed in stream order")
    for count, left in rank_group.run(bytes_left_in_sent_buffers, strategy):
        assert count > 0, "no collective was seen: the test would pass whatever the strategy did"
        assert left == 0, f"{strategy}: {left:,} B of sent temporaries still allocated after synchronization"
