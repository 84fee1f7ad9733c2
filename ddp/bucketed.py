"""Bucketed data parallelism: all-reduce buckets of gradients of at most ``bucket_size_mb``,
each launched during backward as soon as it is complete.

Gradients live in the buckets' flat buffers: after the first step each parameter's ``.grad`` is a
view into its bucket, so autograd accumulates straight into the buffer, the all-reduce averages it
in place (ReduceOp.AVG), and nothing is copied back out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ddp.base import DataParallel, average_op, check_bucket_size_mb
from ddp.tracing import launch_all_reduce

BYTES_PER_MB = 2**20  # bucket_size_mb counts MiB, as PyTorch's bucket_cap_mb does


@dataclass
class Bucket:
    """Parameters reduced together, and the flat buffer their gradients live in.

    The buffer holds every gradient back to back, then one flag per parameter: 1 where this rank
    produced the gradient. After averaging, a zero flag means no rank did.
    """

    params: list[nn.Parameter]
    buffer: torch.Tensor
    views: list[torch.Tensor] = field(default_factory=list)
    pending: int = 0
    work: dist.Work | None = None

    @property
    def flags(self) -> torch.Tensor:
        return self.buffer[-len(self.params) :]

    @property
    def gradient_bytes(self) -> int:
        return sum(p.numel() for p in self.params) * self.buffer.element_size()


def plan_buckets(params: list[nn.Parameter], bucket_size_mb: float) -> list[list[nn.Parameter]]:
    """Group parameters, in the given order, into buckets of at most ``bucket_size_mb``.

    A tensor larger than the cap gets a bucket of its own; tensors of different dtype or device
    never share a bucket.
    """
    cap_bytes = bucket_size_mb * BYTES_PER_MB
    buckets: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    current_bytes = 0
    for param in params:
        nbytes = param.numel() * param.element_size()
        same_kind = not current or (current[0].dtype, current[0].device) == (param.dtype, param.device)
        if current and (not same_kind or current_bytes + nbytes > cap_bytes):
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(param)
        current_bytes += nbytes
    if current:
        buckets.append(current)
    return buckets


class BucketedDDP(DataParallel):
    """Asynchronous all-reduce of gradient buckets, overlapped with the backward pass."""

    def __init__(self, module, *, bucket_size_mb: float = 25.0, process_group=None) -> None:
        self.bucket_size_mb = check_bucket_size_mb(bucket_size_mb)
        super().__init__(module, process_group=process_group)
        self._op = average_op(process_group)
        self._names = {id(p): name for name, p in module.named_parameters()}
        # Reverse registration order approximates the order backward produces gradients.
        self.buckets: list[Bucket] = []
        self._slot: dict[int, tuple[Bucket, int]] = {}
        for params in plan_buckets(list(reversed(self.parameters_to_sync)), self.bucket_size_mb):
            numel = sum(p.numel() for p in params)
            buffer = torch.zeros(numel + len(params), dtype=params[0].dtype, device=params[0].device)
            bucket = Bucket(params, buffer)
            offset = 0
            for index, param in enumerate(params):
                bucket.views.append(buffer[offset : offset + param.numel()].view_as(param))
                offset += param.numel()
                self._slot[id(param)] = (bucket, index)
            self.buckets.append(bucket)
        self._reset()
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_gradient_ready) for p in self.parameters_to_sync]

    @property
    def bucket_sizes_bytes(self) -> list[int]:
        """Gradient bytes in each bucket, in launch order."""
        return [b.gradient_bytes for b in self.buckets]

    @property
    def num_allreduce_calls_per_step(self) -> int:
        return len(self.buckets)

    def _reset(self) -> None:
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
            bucket.work = None
        self._ready: set[int] = set()
        self._next_to_launch = 0

    def _on_gradient_ready(self, param: nn.Parameter) -> None:
        if not self._sync_this_backward:
            return
        if id(param) in self._ready:
            raise RuntimeError(
                f"the gradient of {self._names.get(id(param), 'a parameter')!r} was produced twice without "
                "finish_gradient_synchronization() in between: call it after every backward, or "
                "accumulate inside no_sync()"
            )
        self._ready.add(id(param))
        bucket, index = self._slot[id(param)]
        view = bucket.views[index]
        if param.grad.data_ptr() != view.data_ptr():
            # autograd made a fresh gradient (the first step, or after zero_grad(set_to_none=True))
            view.copy_(param.grad)
            param.grad = view
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_complete_buckets()

    def _launch(self, bucket: Bucket) -> None:
        bucket.work = launch_all_reduce(bucket.buffer, self._op, self.process_group, f"bucket{self._next_to_launch}")
        self._next_to_launch += 1

    def _launch_complete_buckets(self) -> None:
        # Buckets go out in index order on every rank so that collectives always pair up, even
        # when a rank completes them in another order.
        while self._next_to_launch < len(self.buckets) and self.buckets[self._next_to_launch].pending == 0:
            bucket = self.buckets[self._next_to_launch]
            bucket.flags.fill_(1)
            self._launch(bucket)

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        if not self._sync_this_backward:
            return
        # Buckets still waiting hold parameters that got no gradient on this rank. They take part
        # in the same order, contributing zeros (or the gradient they already hold); what they
        # held is kept in case no rank produced a gradient for them.
        missing: list[tuple[Bucket, int, torch.Tensor | None]] = []
        for bucket in self.buckets[self._next_to_launch :]:
            for index, (param, view) in enumerate(zip(bucket.params, bucket.views)):
                ready = id(param) in self._ready
                bucket.flags[index] = 1 if ready else 0
                if ready:
                    continue
                previous = None if param.grad is None else param.grad.clone()
                if previous is None:
                    view.zero_()
                else:
                    view.copy_(previous)
                missing.append((bucket, index, previous))
            self._launch(bucket)
        for bucket in self.buckets:
            bucket.work.wait()
        for bucket, index, previous in missing:
            param, view = bucket.params[index], bucket.views[index]
            if bucket.flags[index].item() > 0:
                param.grad = view
            else:
                param.grad = previous
        self._reset()
