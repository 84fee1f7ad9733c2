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

Rounds go through the one timing loop (``ddp.bench.rounds.loop.timed_rounds``), every size in every
round in rotating order, and the buffers are kept between rounds in the rank's ``RankBench``. On
CPU each rank's threads are bound to its share of the cores while it times
(``ddp.launcher.bind_to_cores``): unbound, where two ranks' threads met on one core decided a
small all-reduce's time more than gloo did. At least one warm-up round runs (the first all-reduce
of a size allocates its buffer and, on a fresh group, connects gloo's pairs).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ddp.bench.collectives.reading import bus_factor
from ddp.bench.config.options import RoundOptions
from ddp.bench.results.records import AllReduceRecord
from ddp.bench.results.stats import median_interval
from ddp.bench.rounds.loop import timed_rounds
from ddp.bench.rounds.rank_state import RankBench, release
from ddp.bench.rounds.spread import active_rank_groups, rank_group_share
from ddp.launcher import Rank, bind_to_cores, on_rank
from ddp.strategies.bucketed import BYTES_PER_MB  # sizes are given in MiB, as bucket sizes are

FLOAT32_BYTES = 4


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


def size_bytes_of(size_mb: float) -> int:
    """Bytes of a float32 buffer of about ``size_mb`` MiB (whole elements)."""
    return int(size_mb * BYTES_PER_MB) // FLOAT32_BYTES * FLOAT32_BYTES


def _tensor(rank: Rank, numel: int) -> torch.Tensor:
    """One buffer per size, kept between rounds in the rank's ``RankBench`` (all sizes of a
    measurement are timed in every round)."""
    buffers, device = rank.keep(RankBench).allreduce_buffers, rank.info.device
    if numel not in buffers or buffers[numel].device != device:
        buffers[numel] = torch.empty(numel, dtype=torch.float32, device=device)
    return buffers[numel]


def _timed_all_reduce(rank: Rank, size_bytes: int) -> AllReduceTiming:
    info = rank.info
    tensor = _tensor(rank, numel_for(size_bytes))
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
    return AllReduceTiming(info.rank, seconds, wrong_elements(tensor, info.world_size))


def wrong_elements(tensor: torch.Tensor, world_size: int) -> int:
    """Elements of a buffer that every rank filled with ``rank + 1`` and then all-reduced (SUM) that
    do not hold 1 + 2 + ... + world_size (exact in float32 for any sane world size).

    One pass of ``aminmax`` settles the usual case (both ends hold the sum: nothing is wrong) and
    only a buffer that fails it is counted element by element (a NaN fails it too). Summing the
    comparison instead widens every element to int64 first: 122 ms a 100 MiB check on this
    project's CPU, against 6 ms, outside the timed all-reduce but inside every round's wall time.
    On CUDA both are device reductions and ``.item()`` synchronizes, after the clock has stopped."""
    expected = world_size * (world_size + 1) / 2
    low, high = torch.aminmax(tensor)
    if low.item() == expected and high.item() == expected:
        return 0
    return int(torch.count_nonzero(tensor != expected).item())


@on_rank
def timed_all_reduces(rank: Rank, sizes_bytes: list[int], round_index: int = 0) -> list[AllReduceTiming]:
    """Run on every rank: one checked, timed all-reduce of each size, in an order that rotates with
    ``round_index`` (as the step rounds do); timings in the order of ``sizes_bytes``."""
    shift = round_index % len(sizes_bytes)
    order = list(range(len(sizes_bytes)))[shift:] + list(range(len(sizes_bytes)))[:shift]
    timings = {index: _timed_all_reduce(rank, sizes_bytes[index]) for index in order}
    return [timings[index] for index in range(len(sizes_bytes))]


@on_rank
def bind_cores(rank: Rank, bound: bool) -> None:
    """``ddp.launcher.bind_to_cores`` on a rank."""
    bind_to_cores(rank.info, bound)


def measure_all_reduces(ranks, sizes_bytes: list[int], policy: RoundOptions, more_groups: Sequence = ()) -> list[AllReduceRecord]:
    """Time all-reduces of every size on ``ranks`` (a ``RankGroup`` or ``InProcessRanks``) through
    the one timing loop, every size in every round, so that each size's rounds are spread over the
    whole measurement rather than a few seconds of its own (the sizes share one benchmark's
    budget: ``policy.budget_seconds``); with ``more_groups`` (groups of ranks
    of the same size, started apart), a block of rounds on each group in turn, each round keeping
    its group, as a step's (``ddp.bench.rounds.spread.measure_in_rank_groups``). Raises if any element held a
    wrong sum."""
    groups = active_rank_groups([ranks, *more_groups], policy)
    warmup, rounds, labels = [], [], []
    for group_index, group in enumerate(groups):
        share = rank_group_share(policy, len(groups), group_index)
        group.run(bind_cores, True)  # as MPI binds its ranks: ``ddp.launcher.bind_to_cores``
        try:
            warmup += [group.run(timed_all_reduces, sizes_bytes, index) for index in range(max(1, share.warmup_rounds))]
            block, _ = timed_rounds(lambda index, group=group: group.run(timed_all_reduces, sizes_bytes, index), share)
        finally:
            group.run(release)
            group.run(bind_cores, False)
        rounds += block
        labels += [group_index] * len(block)
    records = []
    for index, size_bytes in enumerate(sizes_bytes):
        wrong = sum(per_rank[index].wrong for round_ in [*warmup, *rounds] for per_rank in round_)
        if wrong:
            raise RuntimeError(f"{wrong} elements of {size_bytes // FLOAT32_BYTES} held a wrong sum after all_reduce")
        round_seconds = [max(per_rank[index].seconds for per_rank in round_) for round_ in rounds]
        seconds = statistics.median(round_seconds)
        world_size = len(rounds[0])
        records.append(AllReduceRecord(
            backend=ranks.backend, world_size=world_size, size_bytes=size_bytes, seconds=seconds,
            seconds_ci95=list(median_interval(round_seconds, labels)), round_seconds=round_seconds,
            algbw_gbps=algbw_gbps(size_bytes, seconds), busbw_gbps=busbw_gbps(size_bytes, seconds, world_size),
            wrong=wrong, round_groups=labels,
        ))
    return records


def algbw_gbps(size_bytes: int, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (10^9 bytes per second, as nccl-tests reports it)."""
    return size_bytes / seconds / 1e9


def busbw_gbps(size_bytes: int, seconds: float, world_size: int) -> float:
    """Bus bandwidth in GB/s: algbw x 2(n-1)/n (``bus_factor``)."""
    return algbw_gbps(size_bytes, seconds) * bus_factor("AllReduce", world_size)
