"""``python -m ddp run``: the benchmarked training step of perf_tests/, under ``torchrun``.

``torchrun`` (or any launcher that sets the env:// variables ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) starts one process per
rank, on as many nodes as it likes; every process runs ``main`` here:

    torchrun --standalone --nproc-per-node 2 -m ddp run --strategies naive,bucketed \\
        --model tiny --batch-sizes 2 --seq-lens 32 --bucket-sizes 1,100 --json out.json

Options are perf_tests' own (``ddp.bench.options``), with the same defaults per backend, and
every rank validates them before joining the process group: a bad option is one line from rank 0
and exit status 2, with no group started. Each rank then runs, in-process, the same timing loop
as perf_tests (``ddp.bench.measure`` through ``InProcessRanks``, which gathers every rank's result
to every rank so that all take the same decisions), and rank 0 writes ``--json`` in
pytest-benchmark's format with perf_tests' names, groups and records: compare, report and
simulate read a multi-node run like a local one.
"""

from __future__ import annotations

import argparse
import platform
from pathlib import Path

import torch.distributed as dist
from pytest_benchmark.plugin import pytest_benchmark_generate_machine_info

from ddp.analysis.tables import interval_ms, ms, table
from ddp.bench.allreduce import measure_all_reduces, size_bytes_of
from ddp.bench.machine import device_name, software_info
from ddp.bench.measure import GridMeasurer, InProcessRanks, MeasuredOutOfMemory, free
from ddp.bench.options import LaunchOptions, add_grid_options, add_launch_options, grid_options
from ddp.bench.records import allreduce_entry, run_document, step_entry, step_record, write_new
from ddp.bench.trainer import grid_configs, oom_reason
from ddp.cli import UsageError
from ddp.launcher import TorchrunRank


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # the ranks are torchrun's: only the backend is chosen here (auto = nccl when every local rank has a GPU)
    add_launch_options(parser.add_argument, only=("--backend",))
    add_grid_options(parser.add_argument, skip=("--allreduce-world-sizes",))
    parser.add_argument("--json", type=Path, default=None, help="write pytest-benchmark JSON here (rank 0)")


def main(args: argparse.Namespace) -> int:
    try:
        placed = TorchrunRank.from_environment()
    except ValueError as error:
        raise UsageError(
            f"ddp run must be started by torchrun ({error}), e.g. "
            "torchrun --standalone --nproc-per-node 2 -m ddp run --model tiny --json out.json"
        ) from None
    # Rank placement is per node: every local rank needs its own GPU. Validated on every rank
    # before any joins the group.
    resolved = LaunchOptions(backend=args.backend, world_size=placed.local_world_size).resolve()
    grid = grid_options(vars(args).get, resolved.backend, resolved.device, skip=("--allreduce-world-sizes",))
    configs = grid_configs(grid)
    if placed.rank == 0 and args.json is not None and args.json.exists():  # rank 0 writes it: rank 0 checks
        raise UsageError(f"--json {args.json} exists: give a new path (nothing saved is overwritten)")
    info = placed.join(resolved.backend, resolved.device)
    ranks = InProcessRanks(info.world_size, info.backend)
    policy = grid.round_options()
    machine = pytest_benchmark_generate_machine_info() if info.rank == 0 else None
    if machine is not None:
        machine["ddp_bench"] = software_info(info.backend, info.device.type, info.world_size, resolved.why)
        machine["ddp_bench"].update(launcher="torchrun", nodes=info.world_size // placed.local_world_size, node=platform.node())
    benchmarks = []
    try:
        measurer = GridMeasurer(ranks, configs, policy, grid.interleave)
        for config in configs:
            result = measurer.measurement(config)
            if isinstance(result, MeasuredOutOfMemory):
                if info.rank == 0:
                    print(f"SKIPPED {config.test_id}: {oom_reason(config, info.world_size, result.marker)}", flush=True)
                continue
            measurement, index, local_index = result
            record = step_record(measurement, info.backend, device_name(info.device), index, local_index)
            benchmarks.append(step_entry(config, record))
            if info.rank == 0:
                print(f"{config.test_id}: {ms(record.step_seconds)} ms {interval_ms(record.step_seconds_ci95)}", flush=True)
        free(ranks)
        records = measure_all_reduces(ranks, [size_bytes_of(mb) for mb in grid.allreduce_sizes_mb], policy)
        benchmarks += [allreduce_entry(record, size_mb) for size_mb, record in zip(grid.allreduce_sizes_mb, records)]
    finally:
        free(ranks)
    if info.rank == 0:
        rows = [[b["name"], ms(b["stats"]["median"], 3), len(b["stats"]["data"])] for b in benchmarks]
        print(table(rows, ["benchmark", "median ms", "rounds"]), flush=True)
        if args.json is not None:
            write_new(args.json, run_document(machine, benchmarks))
            print(f"wrote {len(benchmarks)} benchmarks to {args.json}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0
