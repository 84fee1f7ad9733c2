"""Overlapped data parallelism: all-reduce each parameter's gradient as soon as it is ready.

A post-accumulate-grad hook launches an asynchronous all-reduce of the gradient in place while
backward goes on computing earlier layers; ``finish_gradient_synchronization`` waits for them.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ddp.strategies.base import DataParallel
from ddp.strategies.declarations import REPLICATED, Transfer, declare, no_step_buffers
from ddp.strategies.tracing import launch_all_reduce


class OverlapDDP(DataParallel):
    """One asynchronous all-reduce per parameter, launched from its gradient hook."""

    def __init__(self, module, *, process_group=None) -> None:
        super().__init__(module, process_group=process_group)
        # Reverse registration order approximates the order backward produces gradients. Every
        # rank launches in this one fixed order: collectives pair up by launch order, so a rank
        # whose hooks fire in another order (data-dependent control flow) must not launch early.
        self._order = list(reversed(self.parameters_to_sync))
        self._position = {id(p): i for i, p in enumerate(self._order)}
        self._names = {id(p): name for name, p in module.named_parameters()}
        self._op = dist.ReduceOp.AVG  # the division by world size folded into the collective
        self._reset()
        self._hook_gradients(self._order, self._on_gradient_ready)

    @property
    def num_allreduce_calls_per_step(self) -> int:
        return len(self._order) + 1  # one per parameter, plus the used-mask

    def _reset(self) -> None:
        self._ready = [False] * len(self._order)
        self._ready_seconds: list[float | None] = [None] * len(self._order)  # stamped only when recorded
        self._works: list[dist.Work] = []
        self._next_to_launch = 0

    def _on_gradient_ready(self, param: torch.nn.Parameter) -> None:
        if not self._sync_this_backward:
            return
        position = self._position[id(param)]
        if self._ready[position]:
            raise RuntimeError(
                f"the gradient of {self._names.get(id(param), 'a parameter')!r} was produced twice without "
                "finish_gradient_synchronization() in between: call it after every backward, or "
                "accumulate inside no_sync()"
            )
        self._ready[position] = True
        if self.collective_recorder is not None:  # stamped only in a recorded step
            self._ready_seconds[position] = time.perf_counter()
        while self._next_to_launch < len(self._order) and self._ready[self._next_to_launch]:
            grad = self._order[self._next_to_launch].grad
            self._works.append(launch_all_reduce(grad, self._op, self.process_group, f"param{self._next_to_launch}", self.collective_recorder,
                                              self._ready_seconds[self._next_to_launch]))
            self._next_to_launch += 1

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        if not self._sync_this_backward:
            return
        # Parameters that got no gradient here still take part, in the same order, contributing
        # zeros (or the gradient they already hold) through a scratch tensor.
        scratch: dict[int, torch.Tensor] = {}
        for position in range(self._next_to_launch, len(self._order)):
            param = self._order[position]
            if self._ready[position]:
                tensor = param.grad
            else:
                tensor = param.grad.clone() if param.grad is not None else torch.zeros_like(param)
                scratch[position] = tensor
            self._works.append(launch_all_reduce(tensor, self._op, self.process_group, f"param{position}", self.collective_recorder,
                                              self._ready_seconds[position]))
        # Used in this accumulation window: in this backward, or holding a gradient from no_sync().
        used = [ready or param.grad is not None for ready, param in zip(self._ready, self._order)]
        mask_work = self._all_reduce_used_mask(used)
        for work in self._works:
            work.wait()
        mask_work.wait()
        if scratch:
            used_somewhere = self.used_somewhere()
            for position, averaged in scratch.items():
                if used_somewhere[position]:
                    self._order[position].grad = averaged
        self._reset()


def each_as_it_is_ready(gradients, ready_seconds, backward_seconds, bucket_size_mb) -> list[Transfer]:
    """One all-reduce per parameter, launched when its gradient is ready."""
    return [Transfer(ready, g.size_bytes) for ready, g in zip(ready_seconds, gradients, strict=True)]


# What the harness and the cost model read of it (ddp.strategies.declarations).
declare(
    OverlapDDP,
    sharding=REPLICATED,
    communicates=True,
    accumulates_locally=True,  # DataParallel.no_sync(): a backward inside it launches nothing
    steps_to_settle=1,
    step_buffers=no_step_buffers,  # all-reduces each gradient in place
    records_collectives=True,  # every gradient collective through launch_all_reduce
    communication_schedule=each_as_it_is_ready,
)
