"""Flat data parallelism: after backward, one all-reduce of all gradients flattened together.

Trades one copy into and out of a flat buffer for paying the collective's latency once instead of
once per parameter. Gradients of different dtype or device get one flat buffer each.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddp.strategies.base import DataParallel
from ddp.strategies.declarations import REPLICATED, MemoryPlan, StepBuffers, Transfer, declare
from ddp.strategies.tracing import free_sent, launch_all_reduce, ready_stamp


class FlatDDP(DataParallel):
    """Copy every gradient into one buffer per dtype and device, all-reduce it, copy back."""

    def __init__(self, module, *, process_group=None) -> None:
        super().__init__(module, process_group=process_group)
        self._groups: dict[tuple[torch.device, torch.dtype], list[torch.nn.Parameter]] = {}
        for param in self.parameters_to_sync:
            self._groups.setdefault((param.device, param.dtype), []).append(param)

    @property
    def num_allreduce_calls_per_step(self) -> int:
        return len(self._groups)

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        if not self._sync_this_backward:
            return
        op = dist.ReduceOp.AVG  # the division by world size folded into the collective
        ready = ready_stamp(self.collective_recorder)  # every gradient is in: backward is over
        for group_index, params in enumerate(self._groups.values()):
            # One extra element per parameter says whether this rank produced its gradient; after
            # averaging, a zero there means no rank did, and the gradient is left untouched.
            pieces = [p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in params]
            used = [p.grad is not None for p in params]
            # Usually every gradient is here: then the flags are ones whatever the other ranks
            # send, and neither a host-to-device copy nor a read back (each a GPU stall) is needed.
            all_used = all(used)
            flags_in = params[0].new_ones(len(params)) if all_used else torch.tensor(used, dtype=params[0].dtype, device=params[0].device)
            pieces.append(flags_in)
            flat = torch.cat(pieces)
            launch_all_reduce(flat, op, self.process_group, f"flat{group_index}", self.collective_recorder, ready).wait()
            flags = [1.0] * len(params) if all_used else flat[-len(params) :].tolist()
            offset = 0
            for param, used_somewhere in zip(params, flags):
                numel = param.numel()
                if used_somewhere > 0:
                    averaged = flat[offset : offset + numel].view_as(param)
                    if param.grad is None:
                        param.grad = averaged.clone()
                    else:
                        param.grad.copy_(averaged)
                offset += numel
            free_sent(flat)


def one_flattened_copy(plan: MemoryPlan) -> StepBuffers:
    """One flattened copy of every gradient while it is all-reduced."""
    return StepBuffers(synchronization_bytes=plan.gradient_bytes)


def after_backward_at_once(gradients, ready_seconds, backward_seconds, bucket_size_mb) -> list[Transfer]:
    """After backward, one all-reduce of all gradient bytes."""
    return [Transfer(backward_seconds, sum(g.size_bytes for g in gradients))]


# What the harness, the memory prediction and the cost model read of it (ddp.strategies.declarations).
declare(
    FlatDDP,
    sharding=REPLICATED,
    communicates=True,
    accumulates_locally=True,  # DataParallel.no_sync(): a backward inside it launches nothing
    steps_to_settle=1,
    records_collectives=True,  # every gradient collective through launch_all_reduce
    step_buffers=one_flattened_copy,
    communication_schedule=after_backward_at_once,
)
