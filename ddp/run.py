"""``python -m ddp run``: the benchmarked training step of perf_tests/, under ``torchrun``.

``torchrun`` (or any launcher that sets the env:// variables ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) starts one process per
rank, on as many nodes as it likes; every process runs ``main`` here:

    torchrun --standalone --nproc-per-node 2 -m ddp run --strategies naive,bucketed \\
        --model-size tiny --batch-sizes 2 --seq-lens 32 --bucket-sizes 1,100 --rounds 5 --json out.json

Each rank joins the process group from the environment and runs, in-process, the same rank-side
functions that perf_tests/ runs through ``RankGroup`` (``prepare_step``, ``timed_step``,
``summarize`` and ``extra_info`` of ddp/benchmark.py; ``timed_all_reduce`` of ddp/allreduce.py).
Per-rank timings are gathered to every rank with ``all_gather_object`` after each round, so that
every rank takes the same decisions (skip on out of memory), and rank 0 writes ``--json`` in
pytest-benchmark's format, with the test names, groups and ``extra_info`` that perf_tests/
produces: ``pytest-benchmark compare`` and ``python -m ddp report`` read a multi-node run like a
local one.

One difference from perf_tests/: a round's time here is the slowest rank's own step time
(perf_tests/ times the whole ``RankGroup.run`` round trip, which adds the harness's overhead).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
from pathlib import Path

import torch
import torch.distributed as dist
from pytest_benchmark import __version__ as pytest_benchmark_version
from pytest_benchmark.plugin import pytest_benchmark_generate_machine_info
from pytest_benchmark.stats import Stats
from pytest_benchmark.utils import get_commit_info
from tabulate import tabulate

import ddp
from ddp.allreduce import BYTES_PER_MB, FLOAT32_BYTES, algbw_gbps, busbw_gbps, release_buffer, timed_all_reduce
from ddp.benchmark import (
    StepConfig,
    grid_configs,
    device_name,
    extra_info,
    first_out_of_memory,
    oom_reason,
    prepare_step,
    release_step,
    software_info,
    summarize,
    timed_step,
)
from ddp.launcher import (
    RankInfo,
    default_device,
    resolve_backend,
    set_rank_info,
    share_cores,
    unavailable_reason,
)

ENVIRONMENT = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

# The test file and function whose results these rows stand for: pytest-benchmark compare and
# --benchmark-compare match benchmarks on ``fullname``.
STEP_TEST = "perf_tests/test_step.py::test_step"
ALLREDUCE_TEST = "perf_tests/test_allreduce.py::test_allreduce"


def _csv(kind):
    def parse(text: str) -> tuple:
        try:
            values = tuple(kind(part) for part in text.split(",") if part.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {kind.__name__}s, got {text!r}") from None
        return values

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--strategies",
        type=_csv(str),
        default=tuple(ddp.STRATEGIES),
        help=f"strategies to benchmark, comma-separated (default: {','.join(ddp.STRATEGIES)})",
    )
    parser.add_argument("--model-size", default="tiny", help="a size from ddp.model.MODEL_SIZES (default: tiny)")
    parser.add_argument("--batch-sizes", type=_csv(int), default=(2,), help="sequences per rank (default: 2)")
    parser.add_argument("--seq-lens", type=_csv(int), default=(128,), help="tokens per sequence (default: 128)")
    parser.add_argument(
        "--bucket-sizes",
        type=_csv(float),
        default=(1.0, 10.0, 100.0, 1000.0),
        help="bucket caps in MB for bucketed and torch (default: 1,10,100,1000)",
    )
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per benchmark (default: 5)")
    parser.add_argument("--warmup-rounds", type=int, default=1, help="untimed rounds before them (default: 1)")
    parser.add_argument(
        "--allreduce-sizes-mb",
        type=_csv(float),
        default=(),
        help="also run the all-reduce microbenchmark at these float32 sizes in MB, over all the ranks "
        "(what `ddp simulate` fits its link model on), e.g. 1,10,100 (default: none)",
    )
    parser.add_argument(
        "--backend",
        default="auto",
        choices=("auto", "gloo", "nccl"),
        help="auto = nccl when every local rank has a GPU, else gloo on CPU (default: auto)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write pytest-benchmark JSON here (rank 0)")


def step_configs(args: argparse.Namespace) -> list[StepConfig]:
    """The grid, in the order perf_tests/ runs it."""
    return grid_configs(args.model_size, args.strategies, args.batch_sizes, args.seq_lens, args.bucket_sizes)


def join_from_environment(backend: str) -> RankInfo:
    """Join the process group that torchrun's environment describes; set device and threads."""
    missing = [name for name in ENVIRONMENT if name not in os.environ]
    if missing:
        raise SystemExit(
            f"ddp run must be started by torchrun ({', '.join(missing)} not set), e.g.\n"
            "  torchrun --standalone --nproc-per-node 2 -m ddp run --model-size tiny --json out.json"
        )
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, local_world_size = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    # Rank placement is per node: every local rank needs its own GPU.
    backend = resolve_backend(backend, local_world_size)
    reason = unavailable_reason(backend, local_world_size, default_device(backend))
    if reason:
        raise SystemExit(f"{reason} (or fewer --nproc-per-node)")
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        share_cores(local_world_size)
    dist.init_process_group(backend, init_method="env://", **({"device_id": device} if backend == "nccl" else {}))
    info = RankInfo(rank, world_size, backend, device)
    # ddp/benchmark.py and ddp/allreduce.py ask rank_info() where they run; under RankGroup the
    # worker sets it, under torchrun this process is the worker.
    set_rank_info(info)
    return info


def _gather(result) -> list:
    """Every rank's result, by rank, on every rank."""
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, result)
    return results


def _stats(round_seconds: list[float]) -> dict:
    stats = Stats()
    for seconds in round_seconds:
        stats.update(seconds)
    return {**stats.as_dict(), "data": list(round_seconds), "iterations": 1}


def _options(args: argparse.Namespace, timer: str) -> dict:
    return {
        "disable_gc": False,
        "timer": timer,
        "min_rounds": args.rounds,
        "max_time": 1.0,
        "min_time": 5e-06,
        "warmup": False,
    }


def run_step(config: StepConfig, info: RankInfo, args: argparse.Namespace) -> dict | None:
    """Benchmark one configuration on every rank; its pytest-benchmark entry (None if skipped)."""
    setups = _gather(prepare_step(config, warmup_steps=1))
    marker = first_out_of_memory(setups)
    rounds = []
    for index in range(args.warmup_rounds + args.rounds):
        if marker is not None:
            break
        timings = _gather(timed_step(config))
        marker = first_out_of_memory(timings)
        if index >= args.warmup_rounds:
            rounds.append(timings)
    if marker is not None:
        release_step()
        if info.rank == 0:
            print(f"SKIPPED {config.test_id}: {oom_reason(config, info.world_size, marker)}", flush=True)
        return None
    summary = summarize(config, info.world_size, rounds)
    return {
        "group": config.group_name,
        "name": f"test_step[{config.test_id}]",
        "fullname": f"{STEP_TEST}[{config.test_id}]",
        # What pytest-benchmark itself records for the StepConfig parameter of perf_tests/.
        "params": {"step_config": f"UNSERIALIZABLE[{config!r}]"},
        "param": config.test_id,
        "extra_info": extra_info(
            config, info.backend, device_name(info.device), info.world_size, setups[0], summary
        ),
        "options": _options(args, "perf_counter"),
        "stats": _stats([max(t.step_seconds for t in timings) for timings in rounds]),
    }


def run_allreduce(size_mb: float, info: RankInfo, args: argparse.Namespace) -> dict:
    """The all-reduce microbenchmark of perf_tests/test_allreduce.py over all the ranks."""
    size_bytes = int(size_mb * BYTES_PER_MB) // FLOAT32_BYTES * FLOAT32_BYTES
    rounds = [_gather(timed_all_reduce(size_bytes)) for _ in range(args.warmup_rounds + args.rounds)]
    release_buffer()
    timed = rounds[args.warmup_rounds :]
    round_seconds = [max(t.seconds for t in timings) for timings in timed]
    stats = _stats(round_seconds)
    wrong = sum(t.wrong for timings in rounds for t in timings)
    if wrong:
        raise RuntimeError(f"{wrong} elements of {size_bytes // FLOAT32_BYTES} held a wrong sum after all_reduce")
    param = f"n{info.world_size}-{size_mb:g}mb"
    return {
        "group": f"all_reduce: {info.backend}, {info.world_size} ranks",
        "name": f"test_allreduce[{param}]",
        "fullname": f"{ALLREDUCE_TEST}[{param}]",
        "params": {"allreduce_world_size": info.world_size, "allreduce_size_mb": size_mb},
        "param": param,
        "extra_info": {
            "backend": info.backend,
            "world_size": info.world_size,
            "size_bytes": size_bytes,
            "algbw_gbps": algbw_gbps(size_bytes, stats["median"]),
            "busbw_gbps": busbw_gbps(size_bytes, stats["median"], info.world_size),
            "wrong": wrong,
        },
        "options": _options(args, "slowest_rank_clock"),
        "stats": stats,
    }


def machine_info(info: RankInfo) -> dict:
    """pytest-benchmark's machine info, plus what the root conftest.py adds for a local run."""
    machine = pytest_benchmark_generate_machine_info()
    ddp_bench = software_info(info.backend, info.device.type, info.world_size)
    ddp_bench.update(
        launcher="torchrun",
        nodes=info.world_size // int(os.environ["LOCAL_WORLD_SIZE"]),
        node=platform.node(),
    )
    machine["ddp_bench"] = ddp_bench
    return machine


def summary_table(benchmarks: list[dict]) -> str:
    """One row per benchmark: median time, and the figure a reader looks at next."""
    rows = []
    for entry in benchmarks:
        extra = entry["extra_info"]
        if "size_bytes" in extra:
            detail = f"busbw {extra['busbw_gbps']:.3f} GB/s"
        else:
            detail = f"comm wait {extra['comm_wait_seconds'] * 1e3:.1f} ms, {extra['tokens_per_second']:.0f} tokens/s"
        rows.append([entry["name"], f"{entry['stats']['median'] * 1e3:.2f}", detail])
    return tabulate(rows, headers=["benchmark", "median ms", ""])


def main(args: argparse.Namespace) -> int:
    configs = step_configs(args)  # bad options fail here, before any rank joins a group
    if args.rounds < 1 or args.warmup_rounds < 0:
        raise SystemExit(f"--rounds must be at least 1 and --warmup-rounds at least 0, got {args.rounds}, {args.warmup_rounds}")
    info = join_from_environment(args.backend)
    machine = machine_info(info) if info.rank == 0 else None
    commit = get_commit_info() if info.rank == 0 else None
    benchmarks = []
    try:
        for config in configs:
            entry = run_step(config, info, args)
            if entry is not None:
                benchmarks.append(entry)
                if info.rank == 0:
                    print(f"{entry['name']}: {entry['stats']['median'] * 1e3:.2f} ms", flush=True)
        release_step()
        for size_mb in args.allreduce_sizes_mb:
            entry = run_allreduce(size_mb, info, args)
            benchmarks.append(entry)
            if info.rank == 0:
                print(f"{entry['name']}: {entry['stats']['median'] * 1e3:.3f} ms", flush=True)
    finally:
        release_step()
    if info.rank == 0:
        print(summary_table(benchmarks), flush=True)
    if info.rank == 0 and args.json is not None:
        output = {
            "machine_info": machine,
            "commit_info": commit,
            "benchmarks": benchmarks,
            "datetime": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "version": pytest_benchmark_version,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(output, indent=4))
        print(f"wrote {len(benchmarks)} benchmarks to {args.json}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0

