"""When each gradient collective was launched and when it completed, recorded only on request.

Strategies launch every collective through ``launch_all_reduce``, passing their
``collective_recorder`` (``ddp.strategies.base.Strategy``): None, except while ``ddp profile``
records a step, when it is a ``CollectiveRecorder`` that stamps the launch and, from the work's
future, the completion, on the same ``time.perf_counter`` clock as the caller's own phases.
Without a recorder it costs one comparison with None.
"""

from __future__ import annotations

import threading
import time
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


def launch_all_reduce(
    tensor: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None, label: str,
    recorder: CollectiveRecorder | None = None,
) -> dist.Work:
    """``dist.all_reduce(..., async_op=True)``, recorded by ``recorder`` when one is given."""
    work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
    if recorder is not None:
        recorder.launched(label, tensor, work)
    return work
