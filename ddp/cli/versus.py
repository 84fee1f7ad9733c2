"""``python -m ddp versus``: strategies raced on one rank group (``ddp.bench.rounds.race``), by default
``bucketed`` against PyTorch's DistributedDataParallel, with ``local`` as the floor. Prints each
median with its 95% interval, each contender's paired ratio over the reference (the last one
given; below 1: faster) and its overhead over its floor (``local``, or ``local_mixed`` for FSDP
in bf16); ``--json`` saves the ``RaceRecord``."""

from __future__ import annotations

import argparse
from pathlib import Path

from tabulate import tabulate

from ddp.analysis.tables import interval_ms, ms
from ddp.bench.config.options import (
    RoundOptions,
    add_config_options,
    add_launch_options,
    add_round_options,
    config_values,
    launch_options,
    round_options,
)
from ddp.bench.results.benchmark_json import race_entry, run_document, write_new
from ddp.bench.results.machine import software_info
from ddp.bench.rounds.race import check_contenders, race, race_configs
from ddp.bench.rounds.trainer import CannotRun
from ddp.cli import UsageError
from ddp.launcher import RankGroup
from ddp.strategies.bucketed import DEFAULT_BUCKET_SIZE_MB
from ddp.strategies.registry import DEFAULT_CONTENDERS

# Exactly 10 timed rounds after 2 untimed ones unless told otherwise: a race is read by eye.
ROUNDS = RoundOptions(min_rounds=10, max_rounds=10, warmup_rounds=2, target_precision=1.0, budget_seconds=float("inf"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_options(parser.add_argument, {"model": "small", "batch_size": 1, "seq_len": 64, "bucket_size_mb": DEFAULT_BUCKET_SIZE_MB,
                                             "strategy": DEFAULT_CONTENDERS}, lists=("strategy",))
    add_round_options(parser.add_argument, ROUNDS)
    add_launch_options(parser.add_argument)
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the result, every round included, as JSON")


def table(record) -> str:
    rows = []
    for name in record.contenders:
        row = [name, ms(record.step_seconds[name], 1), interval_ms(record.step_seconds_ci95[name], 1)]
        if name in record.overhead_over_local_seconds:
            row += [ms(record.overhead_over_local_seconds[name], 1), interval_ms(record.overhead_over_local_seconds_ci95[name], 1)]
        else:
            row += ["", ""]
        if name in record.ratio_over_reference:
            low, high = record.ratio_over_reference_ci95[name]
            row.append(f"{record.ratio_over_reference[name]:.3f} [{low:.3f}, {high:.3f}]")
        else:
            row.append("reference" if name == record.reference else "")
        rows.append(row)
    headers = ["strategy", "median step ms", "95% interval", "overhead over its floor ms", "95% interval",
               f"step / {record.reference} [95%]"]
    return tabulate(rows, headers=headers, disable_numparse=True)


def main(args: argparse.Namespace) -> int:
    resolved = launch_options(vars(args).get).resolve()
    values = config_values(vars(args).get)
    try:
        contenders = check_contenders(args.strategy)
    except ValueError as error:
        raise UsageError(f"--strategies: {error}") from None
    race_configs(contenders, values)  # every contender's configuration checked before any rank starts
    if args.json is not None and args.json.exists():
        raise UsageError(f"--json {args.json} exists: give a new path (nothing saved is overwritten)")
    rounds = round_options(vars(args).get, ROUNDS)
    with RankGroup(resolved.world_size, resolved.backend, resolved.device, resolved.timeout_seconds) as group:
        try:
            result = race(group, values, rounds, contenders)
        except CannotRun as error:
            raise UsageError(str(error)) from None
    record = result.record
    print(f"{record.configs[-1].describe()}: {record.num_parameters / 1e6:.1f}M parameters, {resolved.describe()}, "
          f"{len(record.local_round_seconds)} rounds")
    print(f"contenders raced {result.interleaving}")
    print(table(record))
    if result.weights_differ is not None:
        print(f"FAIL: trained differently: {result.weights_differ}")
        return 1
    print(f"{', '.join(contenders)} ended with the same weights")
    if args.json:  # under perf_tests/test_versus_torch.py's name: the two compare
        machine = {"ddp_bench": software_info(resolved.backend, resolved.device, resolved.world_size, resolved.why)}
        write_new(args.json, run_document(machine, [race_entry(record, rounds)]))
    return 0
