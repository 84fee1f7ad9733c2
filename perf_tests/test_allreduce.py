"""The all-reduce microbenchmark: backend x float32 size x world size, measured as nccl-tests does.

Each round times one checked all-reduce of every size on every rank, each after a barrier, in
rotating order; a size's time is the slowest rank's own time, rounds go through the one timing
loop (``ddp.bench.measure``), and every round counts wrong elements, which must be 0. All sizes of
one world size are measured together when its first test runs. Formulas: ddp/bench/allreduce.py.
"""

from __future__ import annotations

import pytest

from ddp.bench.allreduce import measure_all_reduces, size_bytes_of
from ddp.bench.measure import RoundPolicy
from ddp.bench.records import to_extra_info
from ddp.bench.timing import record_rounds


@pytest.fixture(scope="module")
def allreduce_records(grid) -> dict:
    """World size -> {size in MiB: AllReduceRecord}, measured on first use (every size together)."""
    return {}


def test_allreduce(benchmark, allreduce_group, allreduce_world_size: int, allreduce_size_mb: float, grid, allreduce_records) -> None:
    group = allreduce_group
    benchmark.group = f"all_reduce: {group.backend}, {group.world_size} ranks"
    if allreduce_world_size not in allreduce_records:
        records = measure_all_reduces(group, [size_bytes_of(mb) for mb in grid.allreduce_sizes_mb], RoundPolicy.of(grid))
        allreduce_records[allreduce_world_size] = dict(zip(grid.allreduce_sizes_mb, records))
    record = allreduce_records[allreduce_world_size][allreduce_size_mb]
    record_rounds(benchmark, record.round_seconds)
    benchmark.extra_info.update(to_extra_info(record))  # measure_all_reduces raised if any sum was wrong
    assert record.size_bytes == size_bytes_of(allreduce_size_mb) and record.world_size == allreduce_world_size
