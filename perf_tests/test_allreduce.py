"""The all-reduce microbenchmark: backend x float32 size x world size, measured as nccl-tests does.

Each round times one checked all-reduce on every rank after a barrier; the round's time is the
slowest rank's own time, rounds go through the one timing loop (``ddp.bench.measure``), and every
round counts wrong elements, which must be 0. Formulas: ddp/bench/allreduce.py.
"""

from __future__ import annotations

from ddp.bench.allreduce import measure_all_reduce, size_bytes_of
from ddp.bench.measure import RoundPolicy, free
from ddp.bench.records import to_extra_info
from ddp.bench.timing import record_rounds


def test_allreduce(benchmark, allreduce_group, allreduce_world_size: int, allreduce_size_mb: float, grid, record_precision) -> None:
    group = allreduce_group
    benchmark.group = f"all_reduce: {group.backend}, {group.world_size} ranks"
    try:
        record = measure_all_reduce(group, size_bytes_of(allreduce_size_mb), RoundPolicy.of(grid))
    finally:
        free(group)
    record_rounds(benchmark, record.round_seconds)
    benchmark.extra_info.update(to_extra_info(record))
    assert record.wrong == 0
