"""When each gradient collective was launched and when it completed, recorded only on request.

Strategies launch every collective through ``launch_all_reduce``; while a ``CollectiveRecorder``
is active (``ddp profile`` and the benchmarks use one) it stamps the launch and, from the work's
future, the completion, on the same ``time.perf_counter`` clock as the caller's own phases. With
no recorder active it costs one attribute check.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class CollectiveSpan:
    label: str
    size_bytes: int
    launch_seconds: float
    done_seconds: float | None = None


class CollectiveRecorder:
    """Collects a ``CollectiveSpan`` per collective launched while it is active."""

    def __init__(self) -> None:
        self.spans: list[CollectiveSpan] = []
        self._lock = threading.Lock()

    def launched(self, label: str, tensor: torch.Tensor, work: dist.Work) -> None:
        span = CollectiveSpan(label, tensor.numel() * tensor.element_size(), time.perf_counter())
        with self._lock:
            self.spans.append(span)

        def done(_future) -> None:
            span.done_seconds = time.perf_counter()

        # The future completes when the collective does (gloo: on its worker thread; NCCL: when
        # the kernel is enqueued, so CUDA profiles take kernel times from the trace instead).
        work.get_future().add_done_callback(done)

    def clear(self) -> None:
        with self._lock:
            self.spans = []


_active: CollectiveRecorder | None = None


@contextlib.contextmanager
def recording(recorder: CollectiveRecorder | None = None) -> Iterator[CollectiveRecorder]:
    """Record every collective the strategies launch inside this block."""
    global _active
    recorder = recorder or CollectiveRecorder()
    previous, _active = _active, recorder
    try:
        yield recorder
    finally:
        _active = previous


def launch_all_reduce(
    tensor: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None, label: str
) -> dist.Work:
    """``dist.all_reduce(..., async_op=True)``, recorded when a recorder is active."""
    work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
    if _active is not None:
        _active.launched(label, tensor, work)
    return work
