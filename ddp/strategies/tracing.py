"""When each gradient collective's data was ready, when it was launched and when it completed,
recorded only on request.

Strategies launch every collective through ``launch_all_reduce``, passing their
``collective_recorder`` (``ddp.strategies.base.Strategy``): None, except in the untimed steps a
tool records (``ddp profile``, and a benchmark's traced steps), when it is a
``CollectiveRecorder`` that stamps the launch and, from the work's future, the completion, on the
same ``time.perf_counter`` clock as the caller's own phases. A strategy that launches a collective
later than its data was ready (buckets go out in order; ``naive`` waits for backward to end) passes
when it was ready; otherwise ready is the launch. Without a recorder it costs one comparison with None.

``USED_MASK_LABEL`` names the one collective that carries no gradient: the used-parameter mask of
``naive`` and ``overlap`` (``Strategy._all_reduce_used_mask``). ``ReduceScatter`` is ``fsdp``'s
reduce-scatter, and ``free_sent`` frees a buffer a collective sent once it is waited.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

USED_MASK_LABEL = "used_mask"


@dataclass
class CollectiveSpan:
    label: str
    size_bytes: int
    launch_seconds: float
    done_seconds: float | None = None
    ready_seconds: float | None = None
    """When its data was ready to send (None: at its launch)."""


class CollectiveRecorder:
    """Collects a ``CollectiveSpan`` per collective launched while it is active."""

    def __init__(self) -> None:
        self.spans: list[CollectiveSpan] = []
        self._lock = threading.Lock()

    def launched(self, label: str, tensor: torch.Tensor, work: dist.Work, ready_seconds: float | None = None) -> None:
        launch = time.perf_counter()
        span = CollectiveSpan(label, tensor.numel() * tensor.element_size(), launch,
                              ready_seconds=launch if ready_seconds is None else min(ready_seconds, launch))
        with self._lock:
            self.spans.append(span)

        def done(_future) -> None:
            span.done_seconds = time.perf_counter()

        # The future completes when the collective does (gloo: on its worker thread; NCCL: when
        # the kernel is enqueued, so CUDA profiles take kernel times from the trace instead).
        work.get_future().add_done_callback(done)


def launch_all_reduce(
    tensor: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None, label: str,
    recorder: CollectiveRecorder | None = None, ready_seconds: float | None = None,
) -> dist.Work:
    """``dist.all_reduce(..., async_op=True)``, recorded by ``recorder`` when one is given
    (``ready_seconds``: when the tensor was ready, if earlier than now).

    With one rank the all-reduce is the identity for every op a strategy uses (sum, average, max),
    and nothing is launched: a completed work holding the tensor is returned. NCCL would otherwise
    launch its one-rank kernel for AVG (``oneRankReduce``, a scaling pass over the tensor) but
    nothing for SUM in place, so at world size 1 strategies that average would pay a kernel per
    collective that those that sum (PyTorch's DDP too) do not: a difference of the op chosen, not
    of the strategy's own machinery, which is what a world size 1 run compares."""
    if dist.get_world_size(group) == 1:
        done = torch.futures.Future()
        done.set_result([tensor])
        work = torch._C._distributed_c10d._create_work_from_future(done)
    else:
        work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
    if recorder is not None:
        recorder.launched(label, tensor, work, ready_seconds)
    return work


def free_sent(tensor: torch.Tensor) -> None:
    """Free ``tensor``, the input of a collective already waited, now, whoever else still refers
    to it. gloo: ``wait()`` returns when the work is complete, but the worker thread that ran it
    lets it (and its tensors) go a moment later, so the buffer's lifetime, and a step's memory
    peak, would otherwise depend on which thread runs first. NCCL: ``wait()`` orders the current
    stream after the collective and the caching allocator reuses a freed block in stream order
    (or after the events ``record_stream`` put on it), so freeing here is safe there too."""
    tensor.untyped_storage().resize_(0)


class ReduceScatter:
    """The sum of ``tensor`` over the group's ranks, reduce-scattered: ``wait()`` returns this
    rank's chunk (``tensor``'s length over the world size). ``tensor`` is the collective's to use:
    it is freed, at the latest, when ``wait()`` returns."""

    def __init__(self, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> None:
        self._rank, self._world_size = dist.get_rank(group), dist.get_world_size(group)
        if dist.get_backend(group) == "gloo":
            # gloo's reduce_scatter_tensor is an all-reduce of a clone of its input on gloo's worker
            # thread, this rank's chunk copied out on wait (ProcessGroupGloo::
            # reduce_scatter_tensor_coalesced). Done here on ``tensor`` itself, one copy fewer, and
            # freed when the chunk is out (``free_sent``): gloo's clone was out of reach, so whether
            # the optimizer step still held it was a race (MemTracker saw the root's gradient there
            # once, fsdp on tiny in bf16).
            self._sent: torch.Tensor | None = tensor
            self._piece: torch.Tensor | None = None
            self._work = dist.all_reduce(tensor, group=group, async_op=True)
        else:
            # NCCL: one reduce-scatter kernel (half an all-reduce's traffic) into the piece; the
            # work keeps ``tensor`` until the kernel is done (record_stream or its stash), not us.
            self._sent = None
            self._piece = tensor.new_empty(tensor.numel() // self._world_size)
            self._work = dist.reduce_scatter_tensor(self._piece, tensor, group=group, async_op=True)

    def collect_if_done(self) -> None:
        """On gloo, take this rank's chunk and free ``tensor`` now if the collective is done, as
        gloo's worker would have freed its clone: the owner calls it when it launches the next."""
        if self._sent is not None and self._work.is_completed():
            self.wait()

    def wait(self) -> torch.Tensor:
        self._work.wait()
        if self._sent is not None:
            self._piece = self._sent.chunk(self._world_size)[self._rank].clone()
            free_sent(self._sent)
            self._sent = None
        return self._piece


def ready_stamp(recorder: CollectiveRecorder | None) -> float | None:
    """``time.perf_counter()`` when a recorder is attached, else None (nothing read untraced)."""
    return None if recorder is None else time.perf_counter()
