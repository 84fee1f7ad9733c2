"""At world size 1 no hand-written strategy launches an all-reduce: an all-reduce over one rank is the
identity (``ddp.strategies.tracing.launch_all_reduce``), so a world size 1 run compares each
strategy's own machinery (hooks, copies, buckets), not which reduce op it chose (NCCL launches its
one-rank kernel for AVG, nothing for SUM in place). Each rank trains inside a process group of its
own, so the session's two gloo ranks check it without a group of one."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddp.launcher import Rank, on_rank
from ddp.model import build_model, language_model_loss, random_batch
from ddp.strategies.registry import make_ddp, takes_bucket_size

HAND_WRITTEN = ("naive", "flat", "overlap", "bucketed")


@on_rank
def step_alone(rank: Rank, name: str) -> dict:
    """Runs on every rank: one step of ``name`` in a process group of this rank alone, under the
    profiler; the collectives c10d saw and the gradients, beside those of the same step unwrapped."""
    info = rank.info
    alone = [dist.new_group([rank]) for rank in range(info.world_size)][info.rank]  # every rank makes every group
    inputs, targets = random_batch(build_model("tiny").config, 2, 16, generator=torch.Generator().manual_seed(0))

    def gradients(wrap: bool) -> tuple[list[torch.Tensor], list[str]]:
        torch.manual_seed(0)
        module = build_model("tiny")
        options = {"bucket_size_mb": 0.1} if takes_bucket_size(name) else {}
        model = make_ddp(name, module, process_group=alone, **options) if wrap else module
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
            language_model_loss(model(inputs), targets).backward()
            if wrap:
                model.finish_gradient_synchronization()
        if wrap:
            model.close()
        # bucketed's first step broadcasts rank 0's bucket plan: a copy, not a reduction
        names = [e.name for e in profiler.events() if e.name.startswith(("c10d::", "gloo:")) and "broadcast" not in e.name]
        return [p.grad.clone() for p in module.parameters()], names

    wrapped, launched = gradients(wrap=True)
    plain, _ = gradients(wrap=False)
    dist.destroy_process_group(alone)
    return {"launched": launched, "same_gradients": all(torch.equal(a, b) for a, b in zip(wrapped, plain, strict=True))}


def test_no_strategy_all_reduces_with_itself(rank_group):
    for name in HAND_WRITTEN:
        for rank, result in enumerate(rank_group.run(step_alone, name)):
            assert result["launched"] == [], f"{name} on rank {rank} alone launched {result['launched']}"
            assert result["same_gradients"], f"{name} alone changed the gradients of one process's step"
