"""A sharded optimizer (ZeRO stage 1): gradients averaged as ``bucketed`` does, optimizer state split.

Every rank still holds every parameter and, after ``finish_gradient_synchronization``, every
averaged gradient (``BucketedDDP``'s buckets, reused as they are). What is split is the optimizer:
each parameter belongs to one rank, which alone keeps its optimizer state (AdamW's two moments, 8
bytes a parameter of the 16 a replicated rank holds) and steps it; the owner then broadcasts the
updated values, so that every rank leaves ``step()`` with the whole model again. Memory per rank:
4 + 4 + 8/N bytes a parameter.

``ShardedOptimizer`` has the shape a course's adapter asks for, ``(params, optimizer_cls,
**kwargs)``, and is what ``ShardedOptimizerDDP.make_optimizer`` returns; a user's own optimizer
class of that shape, named on the command line, runs through ``sharded_optimizer_strategy``, the
same way (see ``ddp.strategies.registry``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddp.strategies.bucketed import BucketedDDP, buckets_as_they_fill, gradients_in_buckets
from ddp.strategies.declarations import MemoryPlan, Sharding, StepBuffers, Transfer, declarations, declare


def assign_to_ranks(numels: list[int], load: list[int]) -> list[int]:
    """The owning rank of each tensor: largest first, each to the rank holding the fewest elements
    so far (``load``, one count per rank, updated in place; ties to the lower rank), so ranks end
    within one tensor's size of each other.

    Whole tensors, not slices: a rank steps its tensors with the user's optimizer as it is. Every
    rank computes the same assignment from the same sizes, in the same order.
    """
    owners = [0] * len(numels)
    for index in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        rank = min(range(len(load)), key=lambda r: (load[r], r))
        owners[index] = rank
        load[rank] += numels[index]
    return owners


class ShardedOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer_cls``: this rank builds it over the parameters it owns only, steps them,
    and every parameter's owner broadcasts its new value after the step.

    Parameters are assigned whole, balanced by element count (``assign_to_ranks``); a rank may own
    none (more ranks than parameters). Frozen parameters are kept in ``param_groups`` but neither
    stepped nor sent. ``param_groups`` holds every parameter with its options, so learning-rate
    schedules work as on any optimizer: their options are copied to this rank's optimizer at each step.
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter] | Iterable[dict],
        optimizer_cls: type[torch.optim.Optimizer],
        *,
        process_group: dist.ProcessGroup | None = None,
        **kwargs: Any,
    ) -> None:
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.optimizer_cls = optimizer_cls
        self.optimizer_kwargs = kwargs
        self.local_optimizer: torch.optim.Optimizer | None = None
        self._local_group: list[int | None] = []  # per param group: its index in local_optimizer's groups
        self._load = [0] * self.world_size  # elements owned by each rank so far
        self._owner: dict[int, int] = {}  # id(param) -> owning rank
        super().__init__(params, defaults=kwargs)
        if self.local_optimizer is not None:
            self.state = self.local_optimizer.state  # the state this rank holds, as any optimizer's

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        trainable = [p for p in group["params"] if p.requires_grad and id(p) not in self._owner]
        for param, owner in zip(trainable, assign_to_ranks([p.numel() for p in trainable], self._load)):
            self._owner[id(param)] = owner
        mine = [p for p in trainable if self._owner[id(p)] == self.rank]
        if not mine:
            self._local_group.append(None)
            return
        options = {key: value for key, value in group.items() if key != "params"}
        if self.local_optimizer is None:
            self.local_optimizer = self.optimizer_cls([{"params": mine, **options}], **self.optimizer_kwargs)
            self._local_group.append(0)
        else:
            self.local_optimizer.add_param_group({"params": mine, **options})
            self._local_group.append(len(self.local_optimizer.param_groups) - 1)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.local_optimizer is not None:
            for group, local_index in zip(self.param_groups, self._local_group):
                if local_index is not None:
                    local = self.local_optimizer.param_groups[local_index]
                    local.update({key: value for key, value in group.items() if key != "params"})
            self.local_optimizer.step()
        self._broadcast_updated()
        return loss

    @torch.no_grad()
    def _broadcast_updated(self) -> None:
        """One broadcast per owning rank (and dtype, device): its parameters, flattened."""
        sends: dict[tuple[int, torch.dtype, torch.device], list[nn.Parameter]] = {}
        for group in self.param_groups:
            for param in group["params"]:
                if id(param) in self._owner:
                    sends.setdefault((self._owner[id(param)], param.dtype, param.device), []).append(param)
        for (owner, _, _), params in sends.items():
            flat = torch.cat([p.reshape(-1) for p in params])
            src = dist.get_global_rank(self.process_group, owner) if self.process_group is not None else owner
            dist.broadcast(flat, src=src, group=self.process_group)
            if owner != self.rank:
                torch._foreach_copy_(params, [view.view_as(p) for view, p in zip(flat.split([p.numel() for p in params]), params)])


def parameters_gathered_after(gradients, backward_seconds: float) -> Transfer:
    """ZeRO-1's last collective in a cost schedule: every parameter, all-gathered once the
    optimizer has stepped the shards (ready when backward ends; the optimizer's time is the step's)."""
    return Transfer(backward_seconds, sum(g.size_bytes for g in gradients), "all_gather")


class ShardedOptimizerDDP(BucketedDDP):
    """``bucketed``'s gradient averaging, and an optimizer that shards its state (ZeRO-1)."""

    sharded_optimizer_class: type[torch.optim.Optimizer] = ShardedOptimizer

    def make_optimizer(self, optimizer_cls: type[torch.optim.Optimizer], **kwargs) -> torch.optim.Optimizer:
        return self.sharded_optimizer_class(self.module.parameters(), optimizer_cls, **kwargs)


def buckets_then_gather(gradients, ready_seconds, backward_seconds, bucket_size_mb) -> list[Transfer]:
    """``bucketed``'s buckets, then the updated parameters all-gathered (the owners' broadcasts)."""
    buckets = buckets_as_they_fill(gradients, ready_seconds, backward_seconds, bucket_size_mb)
    return [*buckets, parameters_gathered_after(gradients, backward_seconds)]


def buckets_and_owners_parameters(plan: MemoryPlan) -> StepBuffers:
    """``bucketed``'s, and after the step two owners' flattened parameters at once (the next one
    is built before the previous is freed): 2/N of the parameters, all of them at N = 2 (MemTracker
    on mini: 35.5 MiB)."""
    gathered = plan.gradient_bytes * min(2, plan.world_size) // plan.world_size
    return gradients_in_buckets(plan)._replace(gather_bytes=gathered)


# What the memory prediction and the cost model read of it (ddp.strategies.declarations).
declare(
    ShardedOptimizerDDP,
    sharding=Sharding(optimizer_state=True),
    communicates=True,
    accumulates_locally=True,  # bucketed's no_sync(); the optimizer's gathers run in its step, outside backward
    records_collectives=True,  # bucketed's all-reduces through launch_all_reduce
    steps_to_settle=3,  # bucketed's re-plan in ready order
    communication_schedule=buckets_then_gather,
    step_buffers=buckets_and_owners_parameters,
)


def sharded_optimizer_strategy(optimizer_class: type[torch.optim.Optimizer]) -> type[ShardedOptimizerDDP]:
    """A strategy that trains with a user's sharded optimizer class ``(params, optimizer_cls,
    **kwargs)``: ``bucketed`` averages the gradients, the class does the rest."""
    strategy = type(
        f"ShardedOptimizerDDP[{optimizer_class.__name__}]",
        (ShardedOptimizerDDP,),
        {"sharded_optimizer_class": optimizer_class, "__module__": __name__, "__doc__": ShardedOptimizerDDP.__doc__},
    )
    return declare(strategy, **declarations(ShardedOptimizerDDP))  # the same strategy, with the user's optimizer
