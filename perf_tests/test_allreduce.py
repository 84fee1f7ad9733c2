"""The all-reduce microbenchmark: backend x float32 size x world size, measured as nccl-tests does.

Each round times one checked all-reduce of every size on every rank, each after a barrier, in
rotating order; a size's time is the slowest rank's own time, rounds go through the one timing
loop (``ddp.bench.rounds.loop``), spread over ``--rank-groups`` groups of ranks as a step's are, and
every round counts wrong elements, which must be 0. All sizes of one world size are measured
together when its first test runs. Formulas: ddp/bench/rounds/allreduce.py.
"""

from __future__ import annotations

import statistics

import pytest

from ddp.bench.results.benchmark_json import allreduce_group_name
from ddp.bench.rounds.allreduce import measure_all_reduces, size_bytes_of
from perf_tests.conftest import launch


@pytest.fixture(scope="module")
def allreduce_records(grid) -> dict:
    """World size -> {size in MiB: AllReduceRecord}, measured on first use (every size together)."""
    return {}


def test_allreduce(benchmark, allreduce_groups, allreduce_world_size: int, allreduce_size_mb: float, grid, allreduce_records,
                   record_rounds, request) -> None:
    group, *more = allreduce_groups
    benchmark.group = allreduce_group_name(group.backend, group.world_size)
    if allreduce_world_size not in allreduce_records:
        records = measure_all_reduces(group, [size_bytes_of(mb) for mb in grid.allreduce_sizes_mb], grid.round_options(),
                                      more_groups=more)
        if allreduce_world_size != launch(request.config).world_size:
            for extra in allreduce_groups:  # done with: their processes would sit idle through the step benchmarks
                extra.close()
        allreduce_records[allreduce_world_size] = dict(zip(grid.allreduce_sizes_mb, records))
    record = allreduce_records[allreduce_world_size][allreduce_size_mb]
    record_rounds(record.round_seconds, record)
    assert record.wrong == 0  # measure_all_reduces raises before this on a wrong sum
    # nccl-tests' definitions, by hand: algbw = bytes / s; busbw = algbw x 2(n-1)/n
    n, size_bytes = allreduce_world_size, int(allreduce_size_mb * 2**20)
    assert record.algbw_gbps == pytest.approx(size_bytes / record.seconds / 1e9)
    assert record.busbw_gbps == pytest.approx(size_bytes / record.seconds / 1e9 * 2 * (n - 1) / n)
    assert record.seconds == pytest.approx(statistics.median(record.round_seconds))  # the slowest rank's, per round
