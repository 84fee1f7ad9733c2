"""PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``) behind ddp-bench's interface: the
reference for ``fsdp``.

The same units as ``fsdp`` (each child of an ``nn.ModuleList``, then the root) are passed to
``fully_shard``, whose parameters become DTensors sharded on dim 0 over the ranks. It all-gathers
and reduce-scatters inside forward and backward and waits for its reduce-scatters at the end of
backward, so ``finish_gradient_synchronization`` has nothing left to do. Runs on gloo over CPU in
torch 2.13 (checked: ``fully_shard`` needs ``all_gather_into_tensor`` and
``reduce_scatter_tensor``, which gloo has there). ``fully_shard`` does not give every rank rank
0's values, so the module is broadcast from rank 0 first.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from ddp.strategies.base import Strategy, broadcast_from_rank0, require_process_group
from ddp.strategies.declarations import MemoryPlan, Sharding, StepBuffers, declare, gathered_unit_buffers
from ddp.strategies.fsdp import check_compute_dtype, plan_units


class TorchFSDP(Strategy):
    """``fully_shard`` per unit; ``compute_dtype`` becomes its ``MixedPrecisionPolicy(param_dtype=...)``
    with fp32 gradient reduction."""

    def __init__(self, module: nn.Module, *, compute_dtype: torch.dtype | str | None = None, process_group=None) -> None:
        super().__init__()
        require_process_group(type(self).__name__, process_group)
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        self.process_group = process_group
        broadcast_from_rank0(module, process_group)
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
        group = process_group if process_group is not None else dist.group.WORLD
        mesh = DeviceMesh.from_group(group, device.type)
        dtype = check_compute_dtype(compute_dtype)
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype else MixedPrecisionPolicy()
        scalars = [name for name, p in module.named_parameters() if p.requires_grad and p.dim() == 0]
        if scalars:
            raise ValueError(
                f"PyTorch's fully_shard cannot shard a 0-dimensional parameter ({', '.join(scalars)}): "
                "make it a 1-element tensor, or freeze it"
            )
        # Frozen parameters stay whole on every rank, as in fsdp (and fully_shard refuses scalars).
        frozen = {p for p in module.parameters() if not p.requires_grad}
        for _, unit in plan_units(module)[:-1]:
            fully_shard(unit, mesh=mesh, mp_policy=policy, ignored_params=frozen)
        self.module = fully_shard(module, mesh=mesh, mp_policy=policy, ignored_params=frozen)

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Gradients accumulate correctly across backwards (the sharded gradients add up), but
        each backward still reduce-scatters (fully_shard's own no-sync, set_requires_gradient_sync, is not used): ``accumulates_locally`` is False."""
        return contextlib.nullcontext()

    def finish_gradient_synchronization(self) -> None:
        """Nothing to do: fully_shard waited for its reduce-scatters at the end of backward."""

    def close(self) -> None:
        """Forget what DTensor caches for the life of the process, keyed by this strategy's
        DeviceMesh (sharding decisions, redistribution plans, mesh topology): each cache holds the
        mesh and its rank tensor otherwise. Private PyTorch functions, each skipped if absent."""
        from torch.distributed.tensor import _collective_utils, _redistribute, _sharding_prop
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache

        _clear_sharding_prop_cache()
        caches = (
            getattr(_redistribute, "_gen_transform_infos", None),
            getattr(getattr(_collective_utils, "MeshTopoInfo", None), "build_from_mesh", None),
            getattr(getattr(_sharding_prop, "ShardingPropagator", None), "_propagate_tensor_meta_cached", None),
        )
        for cached in caches:
            if hasattr(cached, "cache_clear"):
                cached.cache_clear()
        if hasattr(_redistribute, "clear_redistribute_planner_cache"):
            _redistribute.clear_redistribute_planner_cache()

    @torch.no_grad()
    def gather_full_params(self) -> dict[str, torch.Tensor]:
        return {
            name: p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
            for name, p in self.module.named_parameters()
        }


def prefetched_units_and_root(plan: MemoryPlan) -> StepBuffers:
    """``gathered_unit_buffers``, and at backward's end the root's: its gathered parameters, its
    whole gradient and the reduce-scatter's output, a 1/N share of it (MemTracker on mini: 48.8 MiB,
    2.5 of its 19.5 MiB roots at N = 2)."""
    root = plan.unit_bytes[-1] if plan.unit_bytes else 0
    buffers = gathered_unit_buffers(plan, prefetches_next_unit=True)
    # With a compute dtype (param_dtype) the gathered root and its gradient are in it, and the
    # gradient is copied to reduce_dtype (fp32) for the reduce-scatter.
    copied = root if plan.computes_in_another_dtype else 0
    return buffers._replace(synchronization_bytes=2 * plan.gathered(root) + copied + root // plan.world_size)


# What the memory prediction and the cost model read of it (ddp.strategies.declarations).
declare(
    TorchFSDP,
    sharding=Sharding(parameters=True, gradients=True, optimizer_state=True),
    communicates=True,
    accumulates_locally=False,  # fully_shard reduce-scatters every backward unless told not to
    records_collectives=False,  # c10d's collectives, read from the profiler
    steps_to_settle=1,
    prefetches_next_unit=True,  # fully_shard's implicit prefetching
    units=plan_units,  # the units it passes to fully_shard
    step_buffers=prefetched_units_and_root,
)
