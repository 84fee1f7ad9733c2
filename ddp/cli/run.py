"""``python -m ddp run``: the benchmarked training step of perf_tests/, under ``torchrun``.

``torchrun`` (or any launcher that sets the env:// variables ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) starts one process per
rank, on as many nodes as it likes; every process runs ``main`` here:

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m ddp run --strategies naive,bucketed \\
        --model tiny --batch-sizes 2 --seq-lens 32 --bucket-sizes 1,100 --json out.json

(``python -m torch.distributed.run`` is ``torchrun`` with this interpreter: a ``torchrun`` found on
PATH may belong to another Python, without ddp-bench or with another torch.)

Options are perf_tests' own (``ddp.bench.config.options``), with the same defaults per backend, and
every rank validates them before joining the process group (``ddp.launcher.TorchrunRank``): a bad
option is one line, printed once (by the first rank of a node to fail; ``ddp.cli.fail``) and
exit status 2, with no group started. Each rank then runs,
in-process, the same timing loop as perf_tests (``ddp.bench.rounds.grid`` through ``InProcessRanks``,
which gathers every rank's result to every rank so that all take the same decisions), and rank 0
writes ``--json`` in pytest-benchmark's format with perf_tests' names, groups and records: compare,
report and simulate read a multi-node run like a local one.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
from pathlib import Path

from pytest_benchmark.plugin import pytest_benchmark_generate_machine_info

from ddp.analysis.tables import interval_ms, ms, table
from ddp.bench.config.options import LaunchOptions, add_grid_options, add_launch_options, grid_options
from ddp.bench.results.benchmark_json import run_document, write_new
from ddp.bench.results.machine import software_info
from ddp.bench.rounds.grid import measure_grid
from ddp.bench.rounds.in_process import InProcessRanks
from ddp.cli import UsageError
from ddp.launcher import TorchrunRank


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # the ranks are torchrun's: only the backend is chosen here (auto = nccl when every local rank has a GPU)
    add_launch_options(parser.add_argument, only=("--backend",))
    add_grid_options(parser.add_argument, skip=("--allreduce-world-sizes", "--rank-groups"))
    parser.add_argument("--json", type=Path, default=None, help="write pytest-benchmark JSON here (rank 0)")


def main(args: argparse.Namespace) -> int:
    try:
        placed = TorchrunRank.from_environment()
    except ValueError as error:
        raise UsageError(
            f"ddp run must be started by torchrun ({error}), e.g. "
            "python -m torch.distributed.run --standalone --nproc-per-node 2 -m ddp run --model tiny --json out.json "
            "(torchrun with this interpreter)"
        ) from None
    # Rank placement is per node: every local rank needs its own GPU. Validated on every rank
    # before any joins the group.
    resolved = LaunchOptions(backend=args.backend, world_size=placed.local_world_size).resolve()
    grid = grid_options(vars(args).get, resolved.backend, resolved.device, skip=("--allreduce-world-sizes", "--rank-groups"))
    grid = dataclasses.replace(grid, rank_groups=1)  # the job is the one group of ranks: its records say so
    if placed.rank == 0 and args.json is not None and args.json.exists():  # rank 0 writes it: rank 0 checks
        raise UsageError(f"--json {args.json} exists: give a new path (nothing saved is overwritten)")
    rank = placed.join(resolved.backend, resolved.device)
    info = rank.info
    ranks = InProcessRanks(rank)
    machine = pytest_benchmark_generate_machine_info() if info.rank == 0 else None
    if machine is not None:
        machine["ddp_bench"] = software_info(info.backend, info.device.type, info.world_size, resolved.why)
        machine["ddp_bench"].update(launcher="torchrun", nodes=info.world_size // placed.local_world_size, node=platform.node())

    def say(config, record) -> None:
        if info.rank == 0:
            if isinstance(record, str):
                print(f"SKIPPED {config.test_id}: {record}", flush=True)
            else:
                print(f"{config.test_id}: {ms(record.step_seconds)} ms {interval_ms(record.step_seconds_ci95)}", flush=True)

    benchmarks = measure_grid(ranks, grid, info.device, say)
    if info.rank == 0:
        rows = [[b["name"], ms(b["stats"]["median"], 3), len(b["stats"]["data"])] for b in benchmarks]
        print(table(rows, ["benchmark", "median ms", "rounds"]), flush=True)
        if args.json is not None:
            write_new(args.json, run_document(machine, benchmarks))
            print(f"wrote {len(benchmarks)} benchmarks to {args.json}", flush=True)
    placed.leave()
    return 0
