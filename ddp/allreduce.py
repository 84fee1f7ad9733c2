"""The all-reduce microbenchmark, measured the way nccl-tests measures it.

Each timed round, on every rank: fill a float32 tensor with ``rank + 1``, meet at a barrier (so
that every rank starts together and the slowest rank's time is the collective's), time one
``all_reduce(SUM)`` (with ``torch.cuda.synchronize()`` on CUDA), then count the elements that
differ from ``world_size * (world_size + 1) / 2``: the check runs inside the performance run, and
a benchmark that computed wrong values must fail. Warm-up rounds are the caller's to discard.

Bandwidths follow nccl-tests (``doc/PERFORMANCE.md``)::

    algbw = size_bytes / seconds
    busbw = algbw * 2 * (n - 1) / n

algbw is what the caller sees; busbw corrects for the 2(n-1)/n of the data that a ring
all-reduce moves over each rank's link, so that it compares with the hardware's link bandwidth
whatever the number of ranks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ddp.launcher import rank_info

BYTES_PER_MB = 2**20  # sizes are given in MiB, as bucket sizes are
FLOAT32_BYTES = 4

_buffer: torch.Tensor | None = None


@dataclass(frozen=True)
class AllReduceTiming:
    """One rank's figures for one timed all-reduce."""

    rank: int
    seconds: float
    wrong: int
    """Elements that did not hold the expected sum afterwards (must be 0)."""


def numel_for(size_bytes: int) -> int:
    """float32 elements in ``size_bytes`` (at least one)."""
    return max(1, size_bytes // FLOAT32_BYTES)


def _tensor(numel: int, device: torch.device) -> torch.Tensor:
    """One buffer kept between rounds; replaced (and the old one freed) when the size changes."""
    global _buffer
    if _buffer is None or _buffer.numel() != numel or _buffer.device != device:
        _buffer = None  # free the old one before allocating: 1 GiB buffers add up
        if device.type == "cuda":
            torch.cuda.empty_cache()
        _buffer = torch.empty(numel, dtype=torch.float32, device=device)
    return _buffer


def timed_all_reduce(size_bytes: int) -> AllReduceTiming:
    """Run on every rank: one checked, timed all-reduce of ``size_bytes`` of float32."""
    info = rank_info()
    tensor = _tensor(numel_for(size_bytes), info.device)
    tensor.fill_(float(info.rank + 1))
    cuda = info.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(info.device)
    dist.barrier()
    start = time.perf_counter()
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    if cuda:
        torch.cuda.synchronize(info.device)
    seconds = time.perf_counter() - start
    expected = info.world_size * (info.world_size + 1) / 2  # exact in float32 for any sane world size
    wrong = int((tensor != expected).sum().item())
    return AllReduceTiming(info.rank, seconds, wrong)


def release_buffer() -> None:
    """Run on every rank: free the benchmark's buffer."""
    global _buffer
    _buffer = None
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def algbw_gbps(size_bytes: int, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (10^9 bytes per second, as nccl-tests reports it)."""
    return size_bytes / seconds / 1e9


def busbw_gbps(size_bytes: int, seconds: float, world_size: int) -> float:
    """Bus bandwidth in GB/s: algbw x 2(n-1)/n."""
    return algbw_gbps(size_bytes, seconds) * 2 * (world_size - 1) / world_size
