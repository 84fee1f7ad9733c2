"""The interface every data-parallel strategy implements, and the pieces they share.

A strategy wraps any ``nn.Module``. On construction every rank receives rank 0's parameters and
buffers; after ``loss.backward()`` a call to ``finish_gradient_synchronization()`` leaves every
trainable parameter's gradient averaged over the ranks, exactly as one process training on the
whole batch would have it. ``no_sync()`` skips communication for gradient accumulation.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from ddp.tracing import launch_all_reduce


def require_process_group(strategy: str, process_group: dist.ProcessGroup | None) -> None:
    """Fail with an instruction when a strategy is built before ``init_process_group``."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{strategy} needs a process group: call torch.distributed.init_process_group(...) "
            "before wrapping the model (torchrun or ddp.launcher.RankGroup do this for you)"
        )
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed.ProcessGroup, got {type(process_group).__name__}")


def check_bucket_size_mb(bucket_size_mb: object) -> float:
    """Return ``bucket_size_mb`` as a float, or raise saying what a valid value looks like."""
    if (
        isinstance(bucket_size_mb, bool)
        or not isinstance(bucket_size_mb, (int, float))
        or not math.isfinite(bucket_size_mb)
        or bucket_size_mb <= 0
    ):
        raise ValueError(
            f"bucket_size_mb must be a positive finite number of MiB (e.g. 25.0), got {bucket_size_mb!r}"
        )
    return float(bucket_size_mb)


def trainable_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Parameters that get gradients, each once: a tied weight appears a single time, frozen ones never."""
    return [p for p in module.parameters() if p.requires_grad]


def average_op(process_group: dist.ProcessGroup | None) -> dist.ReduceOp:
    """AVG folds the division by world size into the collective; both gloo and NCCL implement it."""
    return dist.ReduceOp.AVG


@torch.no_grad()
def broadcast_from_rank0(module: nn.Module, process_group: dist.ProcessGroup | None) -> None:
    """Give every rank rank 0's parameters and buffers, one collective per dtype and device."""
    src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
    tensors = [t for t in (*module.parameters(), *module.buffers())]
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    for group in groups.values():
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        dist.broadcast(flat, src=src, group=process_group)
        offset = 0
        for t in group:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


class DataParallel(nn.Module):
    """Base class: holds the wrapped module, the process group and the ``no_sync`` state.

    Subclasses implement ``finish_gradient_synchronization()``. Whether a backward pass
    communicates is decided when ``forward`` runs, as in PyTorch's DistributedDataParallel: a
    forward inside ``no_sync()`` produces a backward that communicates nothing.
    """

    def __init__(self, module: nn.Module, *, process_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        require_process_group(type(self).__name__, process_group)
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.parameters_to_sync = trainable_parameters(module)
        self._require_sync = True  # toggled by no_sync()
        self._sync_this_backward = True  # captured at forward time
        broadcast_from_rank0(module, process_group)

    def forward(self, *args, **kwargs):
        self._sync_this_backward = self._require_sync
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first backward after leaving synchronizes them."""
        previous = self._require_sync
        self._require_sync = False
        try:
            yield
        finally:
            self._require_sync = previous

    def finish_gradient_synchronization(self) -> None:
        raise NotImplementedError

    @property
    def num_allreduce_calls_per_step(self) -> int:
        """Gradient collectives one synchronizing step launches (reports and benchmarks read it)."""
        raise NotImplementedError

    def _all_reduce_used_mask(self, used_locally: list[bool]) -> dist.Work:
        """Launch a MAX all-reduce of which parameters got a gradient on this rank.

        Needed because a parameter may be used on some ranks only: the others contribute zeros,
        and a parameter no rank used must keep the gradient single-process training leaves it.
        """
        device = self.parameters_to_sync[0].device if self.parameters_to_sync else torch.device("cpu")
        if dist.get_backend(self.process_group) == "gloo":
            device = torch.device("cpu")
        self._used_mask = torch.tensor(used_locally, dtype=torch.int32, device=device)
        return launch_all_reduce(self._used_mask, dist.ReduceOp.MAX, self.process_group, "used_mask")
