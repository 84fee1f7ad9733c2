"""A whole benchmark grid measured outside pytest (``ddp run``, whose process is itself one of
torchrun's ranks): the step benchmarks of a ``GridOptions`` through ``GridMeasurer``, as
``--interleave`` says, then its all-reduce sizes, returned as pytest-benchmark entries under
perf_tests' names (``ddp.bench.results.benchmark_json``), so that a torchrun run
compares, reports and simulates like a pytest one."""

from __future__ import annotations

from collections.abc import Callable

from ddp.bench.config.options import GridOptions
from ddp.bench.config.step_config import StepConfig
from ddp.bench.results.benchmark_json import allreduce_entry, step_entry
from ddp.bench.results.machine import device_name
from ddp.bench.results.records import StepRecord
from ddp.bench.rounds.allreduce import measure_all_reduces, size_bytes_of
from ddp.bench.rounds.grid_measurer import GridMeasurer
from ddp.bench.rounds.loop import NotRun, free
from ddp.bench.rounds.summary import step_record


def measure_grid(ranks, grid: GridOptions, device, on_step: Callable[[StepConfig, StepRecord | str], None]) -> list[dict]:
    """Every benchmark of ``grid`` on ``ranks``; ``on_step(config, record)`` is told of each step
    benchmark once every benchmark is timed (``record`` is the skip reason when it could not be
    measured). The traced steps run last, on the same ranks (``GridMeasurer.trace_all``): this
    process is one of torchrun's ranks and has no group of its own to trace on, and on CUDA no
    timed round may follow the profiler in a process (``ddp.bench.rounds.traced.trace``)."""
    policy = grid.round_options()
    configs = grid.configs()
    benchmarks = []
    try:
        measurer = GridMeasurer(ranks, configs, policy, grid.interleave, memory_bytes=grid.device_memory_bytes)
        results = [(config, measurer.measurement(config)) for config in configs]
        free(ranks)
        records = measure_all_reduces(ranks, [size_bytes_of(mb) for mb in grid.allreduce_sizes_mb], policy)
        measurer.trace_all()
        for config, result in results:
            if isinstance(result, NotRun):
                on_step(config, result.reason(ranks.world_size))
                continue
            measurement, index, local_index = result
            record = step_record(measurement, ranks.backend, device_name(device), index, local_index)
            benchmarks.append(step_entry(config, record, policy))
            on_step(config, record)
        benchmarks += [allreduce_entry(record, size_mb, policy) for size_mb, record in zip(grid.allreduce_sizes_mb, records)]
    finally:
        free(ranks)
    return benchmarks
