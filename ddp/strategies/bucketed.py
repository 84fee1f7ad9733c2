"""Bucketed data parallelism: all-reduce buckets of gradients of at most ``bucket_size_mb``,
each launched during backward as soon as it is complete.

Gradients live in the buckets' flat buffers: each parameter's ``.grad`` ends up a view into its
bucket, the all-reduce works on the buffer in place, and nothing is copied back out. A gradient
that autograd made fresh (every step, when the optimizer's ``zero_grad`` sets gradients to None)
is copied into its view already divided by the world size, and the buckets are summed: gloo
implements ReduceOp.AVG as a sum followed by a separate pass dividing the whole bucket, so folding
the division into the copy that happens anyway saves one pass over every gradient (PyTorch's
reducer does the same).

With ``comm_dtype`` (e.g. ``torch.bfloat16``) each bucket is copied into a buffer of that dtype
for its all-reduce and the sum copied back into the gradients' buffer: gradients are communicated
in bf16 and accumulated back in fp32, as PyTorch's ``bf16_compress_hook`` does (which casts the
bucket and divides it in bf16; here the division happens in fp32 before the cast).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ddp.strategies.base import DataParallel, check_bucket_size_mb, check_comm_dtype
from ddp.strategies.declarations import REPLICATED, MemoryPlan, StepBuffers, Transfer, declare
from ddp.strategies.tracing import launch_all_reduce, ready_stamp

BYTES_PER_MB = 2**20  # bucket_size_mb counts MiB, as PyTorch's bucket_cap_mb does
DEFAULT_BUCKET_SIZE_MB = 25.0  # PyTorch's DDP's default bucket_cap_mb, and every bucketing strategy's here
# The first bucket (the last layers' gradients, ready first) holds at most 1 MiB whatever the cap,
# as PyTorch's reducer plans it (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES), so that
# communication starts early in backward: under a cap larger than the model, one bucket sent once
# backward is done left every all-reduce exposed (1,000 small tensors on 2 gloo ranks at 25 MiB:
# bucketed / torch 1.024 [1.009, 1.047] with one bucket, docs/strategies.md).
FIRST_BUCKET_MB = 1.0


@dataclass
class Bucket:
    """Parameters reduced together, and the flat buffer their gradients live in.

    The buffer holds every gradient back to back, then one flag per parameter: 1 where this rank
    produced the gradient. After averaging, a zero flag means no rank did.
    """

    params: list[nn.Parameter]
    buffer: torch.Tensor
    views: list[torch.Tensor] = field(default_factory=list)
    """Each parameter's gradient in ``buffer``, shaped as the parameter."""
    held: list[bool] = field(default_factory=list)
    """Per parameter: its view holds a gradient accumulated before this backward (``no_sync()``, or
    a gradient not zeroed), which this backward's adds to."""
    pending: int = 0
    """Gradients of this backward not yet in (by hook per gradient, before the plan follows the
    ready order); 0 once the bucket is complete."""
    triggered: bool = False
    """Its trigger's hook ran in this backward (once the plan follows the ready order)."""
    work: dist.Work | None = None
    comm_buffer: torch.Tensor | None = None
    """The buffer in ``comm_dtype`` that is all-reduced instead of ``buffer``; None without one."""
    ready_seconds: float | None = None
    """When its last gradient came in, stamped only while a collective recorder is attached."""

    flags: torch.Tensor = field(init=False)
    """``buffer``'s last elements, one per parameter."""
    gradients: torch.Tensor = field(init=False)
    """Every gradient of the bucket, back to back: ``buffer`` without its flags."""

    def __post_init__(self) -> None:
        self.flags = self.buffer[-len(self.params) :]  # views made once, not per step
        self.gradients = self.buffer[: -len(self.params)]

    @property
    def gradient_bytes(self) -> int:
        return sum(p.numel() for p in self.params) * self.buffer.element_size()


def plan_buckets(sizes_bytes: Sequence[int], kinds: Sequence[Hashable], bucket_size_mb: float,
                 first_bucket_mb: float | None = None) -> list[list[int]]:
    """Group tensors, in the given order, into buckets of at most ``bucket_size_mb`` (the first of
    at most ``first_bucket_mb`` where given); returns each bucket's indices into ``sizes_bytes``.

    A tensor larger than the cap gets a bucket of its own; tensors of different kinds (for
    gradients: dtype and device) never share a bucket. Takes sizes rather than parameters so that
    the simulator plans a model it never builds with the same rule.
    """
    cap_bytes = bucket_size_mb * BYTES_PER_MB
    first_bytes = cap_bytes if first_bucket_mb is None else first_bucket_mb * BYTES_PER_MB
    buckets: list[list[int]] = []
    current: list[int] = []
    current_bytes = 0
    for index, (nbytes, kind) in enumerate(zip(sizes_bytes, kinds, strict=True)):
        same_kind = not current or kinds[current[0]] == kind
        if current and (not same_kind or current_bytes + nbytes > (cap_bytes if buckets else first_bytes)):
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(index)
        current_bytes += nbytes
    if current:
        buckets.append(current)
    return buckets


def buffer_bytes(gradient_bytes: int, num_tensors: int, element_size: int) -> int:
    """Bytes one bucket all-reduces: its gradients, then one flag element per tensor (see ``Bucket``)."""
    return gradient_bytes + num_tensors * element_size


class BucketedDDP(DataParallel):
    """Asynchronous all-reduce of gradient buckets, overlapped with the backward pass.

    Its first synchronizing backward hooks every gradient, to learn the order they come in, and
    re-plans the buckets in that order. From then on a bucket's gradients come in together, its
    last one last, and only that one is hooked (the bucket's *trigger*): when it runs, every
    gradient of the bucket is in, and the bucket is filled and launched at once (``_fill``). A
    hook per gradient cost a model of 1,000 small tensors about 1.6 us of the host each, a step's
    share PyTorch's reducer, which hooks in C++, does not pay. Where a backward comes in another
    order (a gradient of the bucket still missing when its trigger runs), the bucket is launched
    by ``finish_gradient_synchronization`` instead: later, never wrong.

    So that a trigger can tell a gradient of this backward, every forward sets the gradients
    already held aside in their buckets (``_set_aside``): backward then makes fresh ones, which
    the bucket adds to what it holds.

    On CUDA the trigger runs on autograd's device thread: its foreach copy and its multiply are
    kernels queued on the stream backward computes on, and NCCL's all-reduce, on its own stream,
    waits for them through the event ProcessGroupNCCL records on the current stream before each
    collective; what the trigger saves is host time between backward's launches, the share
    docs/gpu-runs/2026-11-27-h200 measured (+33 ms over ``local`` against PyTorch's +10.7 on xl
    in bf16 at one rank, a per-gradient hook then). Not measured on a GPU since.
    """

    def __init__(self, module, *, bucket_size_mb: float = DEFAULT_BUCKET_SIZE_MB, comm_dtype: torch.dtype | None = None, process_group=None) -> None:
        """``comm_dtype``: all-reduce gradients in this dtype (None: in their own; see the module docstring)."""
        self.bucket_size_mb = check_bucket_size_mb(bucket_size_mb)
        self.comm_dtype = check_comm_dtype(comm_dtype)
        super().__init__(module, process_group=process_group)
        self._grad_scale = 1.0 / self.world_size
        self._names = {id(p): name for name, p in module.named_parameters()}
        # Reverse registration order approximates the order backward produces gradients; the
        # first synchronizing backward tells the real order, and the buckets are rebuilt in it.
        self._build_buckets(list(reversed(self.parameters_to_sync)))
        self._buckets_follow_ready_order = False
        self._reset()
        self._hook_gradients(self.parameters_to_sync, self._on_gradient_ready)

    def _build_buckets(self, order: list[nn.Parameter]) -> None:
        self.buckets: list[Bucket] = []
        self._slot: dict[int, tuple[Bucket, int]] = {}
        sizes = [p.numel() * p.element_size() for p in order]
        kinds = [(p.dtype, p.device) for p in order]
        for indices in plan_buckets(sizes, kinds, self.bucket_size_mb, min(self.bucket_size_mb, FIRST_BUCKET_MB)):
            params = [order[i] for i in indices]
            numel = sum(p.numel() for p in params)
            buffer = torch.zeros(numel + len(params), dtype=params[0].dtype, device=params[0].device)
            bucket = Bucket(params, buffer, held=[False] * len(params))
            if self.comm_dtype is not None and self.comm_dtype != buffer.dtype:
                # The flags ride along: bf16 holds whole numbers exactly up to 256, so their sum
                # over up to 256 ranks survives the cast.
                bucket.comm_buffer = torch.empty_like(buffer, dtype=self.comm_dtype)
            offset = 0
            for index, param in enumerate(params):
                bucket.views.append(buffer[offset : offset + param.numel()].view_as(param))
                offset += param.numel()
                self._slot[id(param)] = (bucket, index)
            self.buckets.append(bucket)

    @torch.no_grad()
    def _rebuild_buckets_in_ready_order(self) -> None:
        """Re-plan the buckets in the order this backward produced gradients, as PyTorch's reducer
        does after its first iteration: a model whose modules are registered in another order
        than they run would otherwise complete its first bucket only at the end of backward.

        Collectives pair up by launch order, so every rank takes rank 0's order. Parameters that
        got no gradient go last, in reverse registration order. Then each bucket's last gradient
        in that order is its trigger, and the only one hooked (the class docstring).
        """
        position = {id(p): i for i, p in enumerate(self.parameters_to_sync)}
        ready = [position[key] for key in self._ready]
        ready_set = set(ready)
        order = ready + [i for i in reversed(range(len(position))) if i not in ready_set]
        device = self.parameters_to_sync[0].device if dist.get_backend(self.process_group) != "gloo" else torch.device("cpu")
        order_tensor = torch.tensor(order, dtype=torch.int64, device=device)
        src = dist.get_global_rank(self.process_group, 0) if self.process_group is not None else 0
        dist.broadcast(order_tensor, src=src, group=self.process_group)
        params = [self.parameters_to_sync[i] for i in order_tensor.tolist()]
        if [id(p) for p in params] != [id(p) for bucket in self.buckets for p in bucket.params]:
            old_views = {id(p): bucket.views[index] for bucket in self.buckets for index, p in enumerate(bucket.params)}
            self._build_buckets(params)
            for param in params:
                if param.grad is not None and param.grad.data_ptr() == old_views[id(param)].data_ptr():
                    bucket, index = self._slot[id(param)]
                    bucket.views[index].copy_(param.grad)
                    param.grad = bucket.views[index]
        self._unhook_gradients()  # the hook on every gradient, replaced by one per bucket
        self._hook_gradients([bucket.params[-1] for bucket in self.buckets], self._on_trigger)

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
            bucket.triggered = False
            bucket.work = None
            bucket.ready_seconds = None
            bucket.held = [False] * len(bucket.params)
        self._ready: dict[int, None] = {}  # ids of the parameters whose gradient is in, in that order
        self._next_to_launch = 0

    def forward(self, *args, **kwargs):
        if self._buckets_follow_ready_order:
            self._set_aside()
        return super().forward(*args, **kwargs)

    @torch.no_grad()
    def _set_aside(self) -> None:
        """Every gradient held now (accumulated inside ``no_sync()``, or not zeroed since the last
        step) into its bucket's view, marked held, and ``.grad`` None: the next backward makes
        fresh gradients, which its triggers can tell from these (the class docstring)."""
        for bucket in self.buckets:
            grads = [param.grad for param in bucket.params]
            if all(grad is None for grad in grads):
                continue  # the usual case: zero_grad(set_to_none=True) ran since the last step
            for index, (param, view, grad) in enumerate(zip(bucket.params, bucket.views, grads)):
                if grad is None:
                    continue
                if grad.data_ptr() != view.data_ptr():
                    if bucket.held[index]:
                        view.add_(grad)
                    else:
                        view.copy_(grad)
                bucket.held[index] = True
                param.grad = None

    def _on_gradient_ready(self, param: nn.Parameter) -> None:
        # The first synchronizing backward's hook, on every gradient: it notes the order they come
        # in (the buckets are re-planned in it) and launches each bucket as its last one is in.
        if not self._sync_this_backward:
            self._accumulate_in_bucket(param)
            return
        if id(param) in self._ready:
            raise self._produced_twice(param)
        self._ready[id(param)] = None
        bucket = self._slot[id(param)][0]
        bucket.pending -= 1
        if bucket.pending == 0:
            bucket.ready_seconds = ready_stamp(self.collective_recorder)
            self._launch_complete_buckets()

    def _on_trigger(self, param: nn.Parameter) -> None:
        # A bucket's last gradient in the ready order is in: on autograd's thread, between two of
        # backward's kernels, so it does no more than check the bucket and launch it.
        bucket = self._slot[id(param)][0]
        if not self._sync_this_backward:
            self._accumulate_bucket(bucket)
            return
        if bucket.triggered:
            raise self._produced_twice(param)
        bucket.triggered = True
        if all(p.grad is not None for p in bucket.params):  # else one comes later: finish launches it
            bucket.pending = 0
            bucket.ready_seconds = ready_stamp(self.collective_recorder)
            self._launch_complete_buckets()

    def _produced_twice(self, param: nn.Parameter) -> RuntimeError:
        return RuntimeError(
            f"the gradient of {self._names.get(id(param), 'a parameter')!r} was produced twice without "
            "finish_gradient_synchronization() in between: call it after every backward, or "
            "accumulate inside no_sync()"
        )

    def _accumulate_in_bucket(self, param: nn.Parameter) -> None:
        """Inside ``no_sync()``, before the plan follows the ready order: a fresh gradient moves
        into its bucket's view, unscaled, where the next backwards accumulate in place, so
        accumulating keeps one copy of the gradients, not the buckets and a second set beside them
        (the synchronizing backward then scales the sum in place)."""
        bucket, index = self._slot[id(param)]
        view = bucket.views[index]
        if param.grad.data_ptr() != view.data_ptr():
            view.copy_(param.grad)
            param.grad = view

    @torch.no_grad()
    def _accumulate_bucket(self, bucket: Bucket) -> None:
        """Inside ``no_sync()``, once the plan follows the ready order: the bucket's fresh gradients
        added to what its views hold (or copied in), each ``.grad`` its view, so that accumulating
        keeps one copy of the gradients beside the buckets only until each bucket is in."""
        self._gather(bucket)

    def _gather(self, bucket: Bucket) -> None:
        """The bucket's fresh gradients into its views, unscaled, each such ``.grad`` its view. The
        usual bucket (every gradient fresh, none held: ``zero_grad(set_to_none=True)`` ran) takes
        one foreach copy and no other work per gradient than pointing its ``.grad`` at its view
        (a gradient that is its view already, accumulated in place, is copied onto itself, which
        changes nothing). Otherwise (``no_sync()``'s accumulation, a gradient missing) one
        foreach call for those copied and one for those added to what a view holds. On CUDA a
        foreach copy of one dtype and device is one multi-tensor kernel on the current stream;
        pointing ``.grad`` is host work only."""
        grads = [param.grad for param in bucket.params]
        if not any(bucket.held) and all(grad is not None for grad in grads):
            torch._foreach_copy_(bucket.views, grads)
            for param, view in zip(bucket.params, bucket.views):
                param.grad = view
            bucket.held = [True] * len(grads)
            return
        copied, added = ([], []), ([], [])
        for index, (param, view, grad) in enumerate(zip(bucket.params, bucket.views, grads)):
            if grad is None or grad.data_ptr() == view.data_ptr():
                continue  # none this backward, or accumulated in place already
            into = added if bucket.held[index] else copied
            into[0].append(view)
            into[1].append(grad)
            param.grad = view
            bucket.held[index] = True
        if copied[0]:
            torch._foreach_copy_(*copied)
        if added[0]:
            torch._foreach_add_(*added)

    @torch.no_grad()
    def _fill(self, bucket: Bucket) -> None:
        """Every gradient of a complete bucket into its buffer (``_gather``: one foreach call for
        the fresh ones autograd made, after ``zero_grad(set_to_none=True)``, the usual case), then
        the whole buffer divided by the world size in one multiply, which also scales what was
        held before this backward (none at one rank: nothing to divide). A multiply fused into
        the copy (``_foreach_mul.Scalar_out``) read 4.3 ms against 2.1 for copy and multiply, on
        1,000 tensors of 4,160 elements (torch 2.13, CPU): its out variant is generated, the
        product allocated and then copied."""
        self._gather(bucket)
        if self._grad_scale != 1.0:
            bucket.gradients.mul_(self._grad_scale)

    def _launch(self, bucket: Bucket) -> None:
        sent = bucket.buffer
        if bucket.comm_buffer is not None:
            sent = bucket.comm_buffer.copy_(bucket.buffer)
        bucket.work = launch_all_reduce(
            sent, dist.ReduceOp.SUM, self.process_group, f"bucket{self._next_to_launch}", self.collective_recorder,
            bucket.ready_seconds,
        )
        self._next_to_launch += 1

    def _launch_complete_buckets(self) -> None:
        # Buckets go out in index order on every rank so that collectives always pair up, even
        # when a rank completes them in another order.
        while self._next_to_launch < len(self.buckets) and self.buckets[self._next_to_launch].pending == 0:
            bucket = self.buckets[self._next_to_launch]
            self._fill(bucket)
            bucket.flags.fill_(1)
            self._launch(bucket)

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        if not self._sync_this_backward:
            return
        # Buckets still waiting hold parameters that got no gradient in this backward on this
        # rank (or whose trigger ran before them). They take part in the same order, contributing
        # zeros, or their share of the gradient they already hold (accumulated inside no_sync():
        # used in this accumulation window, so flagged as used, as PyTorch's reducer keeps its used
        # map over no_sync); what they held is kept in case no rank has a gradient for them.
        missing: list[tuple[Bucket, int, torch.Tensor | None]] = []
        for bucket in self.buckets[self._next_to_launch :]:
            for index, (param, view) in enumerate(zip(bucket.params, bucket.views)):
                grad = param.grad
                outside = grad is not None and grad.data_ptr() != view.data_ptr()
                if id(param) in self._ready or (self._buckets_follow_ready_order and outside):
                    bucket.flags[index] = 1  # produced in this backward (a fresh gradient, once the plan follows the ready order)
                    continue
                if outside:  # held outside its bucket (set by hand): into it, as a held gradient
                    if bucket.held[index]:
                        view.add_(grad)
                    else:
                        view.copy_(grad)
                    param.grad = view
                held = bucket.held[index] or grad is not None
                bucket.flags[index] = 1 if held else 0
                previous = view.clone() if held else None
                if previous is None:
                    view.zero_()
                missing.append((bucket, index, previous))
            self._fill(bucket)  # what it holds (the previous gradients too) into the buffer, scaled
            self._launch(bucket)
        for bucket in self.buckets:
            bucket.work.wait()
            if bucket.comm_buffer is not None:
                bucket.buffer.copy_(bucket.comm_buffer)  # after wait(): on CUDA, ordered after the collective
        for bucket, index, previous in missing:
            param, view = bucket.params[index], bucket.views[index]
            if bucket.flags[index].item() > 0:
                param.grad = view
            else:
                param.grad = previous
        if not self._buckets_follow_ready_order:
            self._rebuild_buckets_in_ready_order()
            self._buckets_follow_ready_order = True
        self._reset()


def scheduled_buckets(gradients, bucket_size_mb) -> list[list[int]]:
    """The cost model's bucket plan of ``gradients`` (``GradientSize``, in backward order): the
    indices of each bucket, the first capped at ``FIRST_BUCKET_MB``."""
    return plan_buckets([g.size_bytes for g in gradients], [g.element_size for g in gradients], bucket_size_mb,
                        min(bucket_size_mb, FIRST_BUCKET_MB))


def buckets_as_they_fill(gradients, ready_seconds, backward_seconds, bucket_size_mb) -> list[Transfer]:
    """The buckets of ``plan_buckets`` in backward order, each launched when its last gradient is
    ready (and, on one channel, after its predecessors)."""
    plan = scheduled_buckets(gradients, bucket_size_mb)
    return [
        Transfer(
            max(ready_seconds[i] for i in bucket),
            buffer_bytes(sum(gradients[i].size_bytes for i in bucket), len(bucket), gradients[bucket[0]].element_size),
        )
        for bucket in plan
    ]


def gradients_in_buckets(plan: MemoryPlan) -> StepBuffers:
    """The gradients live in the buckets, whole all step; with ``comm_dtype`` each bucket has a copy
    in that dtype, kept too. In backward, the fresh gradients of the bucket being filled wait
    beside it until its last one is in (``BucketedDDP._on_trigger``): a bucket's worth at most."""
    copies = plan.gradient_bytes * plan.comm_itemsize // plan.gradient_itemsize if plan.comm_itemsize else 0
    pending = plan.gradient_bytes if plan.bucket_bytes is None else min(plan.gradient_bytes, plan.bucket_bytes)
    return StepBuffers(kept_bytes=copies, gradients_kept=True, pending_gradient_bytes=pending)


# What the harness, the memory prediction and the cost model read of it (ddp.strategies.declarations).
declare(
    BucketedDDP,
    sharding=REPLICATED,
    communicates=True,
    accumulates_locally=True,  # DataParallel.no_sync(): a backward inside it launches nothing
    records_collectives=True,  # every gradient collective through launch_all_reduce
    steps_to_settle=3,  # re-plans its buckets in the order of its first backward (_rebuild_buckets_in_ready_order)
    communication_schedule=buckets_as_they_fill,
    step_buffers=gradients_in_buckets,
)
