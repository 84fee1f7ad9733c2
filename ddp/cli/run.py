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
import os
import platform
from pathlib import Path

import torch
import torch.distributed as dist
from pytest_benchmark.plugin import pytest_benchmark_generate_machine_info
from tabulate import tabulate

from ddp.bench.allreduce import measure_all_reduces, size_bytes_of
from ddp.bench.machine import device_name, software_info
from ddp.bench.measure import GridMeasurer, InProcessRanks, MeasuredOutOfMemory, RoundPolicy, free
from ddp.bench.options import LaunchOptions, add_grid_options, grid_options
from ddp.bench.records import ALLREDUCE_TEST, STEP_TEST, benchmark_entry, run_document, step_record, write_new
from ddp.bench.config import grid_configs
from ddp.bench.rank_state import oom_reason
from ddp.cli import UsageError
from ddp.launcher import BACKENDS, Rank, RankInfo, enter_rank, share_cores

ENVIRONMENT = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default="auto", choices=BACKENDS,
                        help="auto = nccl when every local rank has a GPU, else gloo on CPU (default: auto)")
    add_grid_options(parser.add_argument, skip=("--allreduce-world-sizes",))
    parser.add_argument("--json", type=Path, default=None, help="write pytest-benchmark JSON here (rank 0)")


def _environment() -> dict[str, int]:
    missing = [name for name in ENVIRONMENT if name not in os.environ]
    if missing:
        raise UsageError(
            f"ddp run must be started by torchrun ({', '.join(missing)} not set), e.g. "
            "torchrun --standalone --nproc-per-node 2 -m ddp run --model tiny --json out.json"
        )
    return {name: int(os.environ[name]) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}


def join(backend: str, env: dict[str, int]) -> Rank:
    """Join the process group that torchrun's environment describes; set device and threads."""
    if backend == "nccl":
        device = torch.device("cuda", env["LOCAL_RANK"])
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        share_cores(env["LOCAL_WORLD_SIZE"])
    dist.init_process_group(backend, init_method="env://", **({"device_id": device} if backend == "nccl" else {}))
    return enter_rank(RankInfo(env["RANK"], env["WORLD_SIZE"], backend, device))  # this process is the rank


def main(args: argparse.Namespace) -> int:
    env = _environment()
    # Rank placement is per node: every local rank needs its own GPU. Validated on every rank
    # before any joins the group.
    resolved = LaunchOptions(backend=args.backend, world_size=env["LOCAL_WORLD_SIZE"]).resolve()
    grid = grid_options(vars(args).get, resolved.backend, resolved.device, skip=("--allreduce-world-sizes",))
    configs = grid_configs(grid)
    if env["RANK"] == 0 and args.json is not None and args.json.exists():  # rank 0 writes it: rank 0 checks
        raise UsageError(f"--json {args.json} exists: give a new path (nothing saved is overwritten)")
    rank = join(resolved.backend, env)
    info = rank.info
    ranks = InProcessRanks(rank)
    policy = RoundPolicy.of(grid)
    machine = pytest_benchmark_generate_machine_info() if info.rank == 0 else None
    if machine is not None:
        machine["ddp_bench"] = software_info(info.backend, info.device.type, info.world_size, resolved.why)
        machine["ddp_bench"].update(launcher="torchrun", nodes=info.world_size // env["LOCAL_WORLD_SIZE"], node=platform.node())
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
            benchmarks.append(benchmark_entry(
                f"test_step[{config.test_id}]", f"{STEP_TEST}[{config.test_id}]", config.group_name, config.test_id,
                {"step_config": f"UNSERIALIZABLE[{config!r}]"}, record, record.round_seconds,
            ))
            if info.rank == 0:
                print(f"{config.test_id}: {record.step_seconds * 1e3:.2f} ms "
                      f"[{record.step_seconds_ci95[0] * 1e3:.2f}, {record.step_seconds_ci95[1] * 1e3:.2f}]", flush=True)
        free(ranks)
        records = measure_all_reduces(ranks, [size_bytes_of(mb) for mb in grid.allreduce_sizes_mb], policy)
        for size_mb, record in zip(grid.allreduce_sizes_mb, records):
            param = f"n{info.world_size}-{size_mb:g}mb"
            benchmarks.append(benchmark_entry(
                f"test_allreduce[{param}]", f"{ALLREDUCE_TEST}[{param}]", f"all_reduce: {info.backend}, {info.world_size} ranks",
                param, {"allreduce_world_size": info.world_size, "allreduce_size_mb": size_mb}, record, record.round_seconds,
            ))
    finally:
        free(ranks)
    if info.rank == 0:
        rows = [[b["name"], f"{b['stats']['median'] * 1e3:.3f}", len(b["stats"]["data"])] for b in benchmarks]
        print(tabulate(rows, headers=["benchmark", "median ms", "rounds"]), flush=True)
        if args.json is not None:
            write_new(args.json, run_document(machine, benchmarks))
            print(f"wrote {len(benchmarks)} benchmarks to {args.json}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0
