"""``python -m ddp versus``: ``bucketed`` against PyTorch's DistributedDataParallel, raced on one
rank group (``ddp.bench.race``), with ``local`` as the floor. Prints each median with its 95%
interval, the paired ratio bucketed / torch (below 1: bucketed is faster) and each DDP's overhead
over local; ``--json`` saves the ``RaceRecord``."""

from __future__ import annotations

import argparse
from pathlib import Path

from tabulate import tabulate

from ddp.bench.measure import RoundPolicy
from ddp.bench.options import (
    add_config_options, add_launch_options, argument_type, check_seq_len, launch_options, non_negative_int, positive_int,
    step_numerics,
)
from ddp.bench.race import CONTENDERS, race
from ddp.bench.machine import software_info
from ddp.bench.records import benchmark_entry, run_document, write_new
from ddp.cli import UsageError
from ddp.launcher import RankGroup


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_options(parser.add_argument, model="small", batch_size=1, seq_len=64)
    parser.add_argument("--rounds", type=argument_type(positive_int, "rounds"), default=10,
                        help="timed rounds, one step of each strategy per round (default: 10)")
    parser.add_argument("--warmup-rounds", type=argument_type(non_negative_int, "warmup_rounds"), default=2,
                        help="untimed rounds first (default: 2)")
    add_launch_options(parser.add_argument)
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the result, every round included, as JSON")


def _interval(values: list[float]) -> str:
    return f"[{values[0] * 1e3:.1f}, {values[1] * 1e3:.1f}]"


def table(record) -> str:
    rows = []
    for name in CONTENDERS:
        row = [name, f"{record.median_step_seconds[name] * 1e3:.1f}", _interval(record.median_step_seconds_ci95[name])]
        if name == "local":
            row += ["", ""]
        else:
            row += [f"{record.overhead_over_local_seconds[name] * 1e3:.1f}", _interval(record.overhead_over_local_seconds_ci95[name])]
        rows.append(row)
    return tabulate(rows, headers=["strategy", "median step ms", "95% interval", "overhead over local ms", "95% interval"],
                    disable_numparse=True)


def main(args: argparse.Namespace) -> int:
    resolved = launch_options(vars(args).get).resolve()
    check_seq_len(args.model, args.seq_len)
    if args.json is not None and args.json.exists():
        raise UsageError(f"--json {args.json} exists: give a new path (nothing saved is overwritten)")
    policy = RoundPolicy.fixed(args.rounds, args.warmup_rounds)
    with RankGroup(resolved.world_size, resolved.backend, resolved.device, resolved.timeout_seconds) as group:
        try:
            result = race(group, args.model, args.batch_size, args.seq_len, args.bucket_size_mb, policy,
                          **step_numerics(vars(args).get))
        except MemoryError as error:
            raise UsageError(str(error)) from None
    record = result.record
    print(f"model {record.model}: {record.parameters / 1e6:.1f}M parameters, {resolved.describe()}, "
          f"bucket {args.bucket_size_mb:g} MiB, {record.precision}, {args.rounds} rounds")
    print(table(record))
    low, high = record.ratio_bucketed_over_torch_ci95
    print(f"bucketed / torch, paired over rounds: {record.ratio_bucketed_over_torch:.3f} [{low:.3f}, {high:.3f}]")
    if result.weights_differ is not None:
        print(f"FAIL: bucketed and torch trained differently: {result.weights_differ}")
        return 1
    print("bucketed and torch ended with the same weights")
    if args.json:
        name = f"test_bucketed_versus_torch[{record.model}]"
        entry = benchmark_entry(name, f"ddp versus::{name}", f"versus: {record.model}, bucket {record.bucket_size_mb:g} MiB",
                                record.model, {}, record, record.round_seconds["bucketed"])
        write_new(args.json, run_document({"ddp_bench": software_info(resolved.backend, resolved.device, resolved.world_size,
                                                                      resolved.why)}, [entry]))
    return 0
