"""``python -m ddp buckets --model mypkg.mod:build``: which bucket size for my model? Measures
``bucketed`` and ``torch`` over bucket caps on this machine, each paired with ``local``
(``ddp.analysis.buckets``), and prints the measured best cap beside the cost model's recommendation
at larger world sizes."""

from __future__ import annotations

import argparse

from tabulate import tabulate

from ddp.analysis.buckets import advice, fitted_link, sweep
from ddp.analysis.costmodel import LINKS, default_overlap_slowdown
from ddp.bench.measure import RoundPolicy
from ddp.bench.options import (
    add_config_options, add_launch_options, argument_type, check_seq_len, launch_options, non_negative_int, positive_float,
    positive_floats, positive_int, positive_ints, step_numerics,
)
from ddp.cli import UsageError
from ddp.launcher import RankGroup


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_options(parser.add_argument, model="mini", batch_size=2, seq_len=64, bucket_size_mb=None)
    parser.add_argument("--bucket-sizes", type=argument_type(lambda t: positive_floats(t, "bucket sizes in MiB"), "bucket_sizes"),
                        default=(1.0, 5.0, 25.0, 100.0), help="caps to measure, MiB (default: 1,5,25,100)")
    parser.add_argument("--rounds", type=argument_type(positive_int, "rounds"), default=5,
                        help="timed rounds per cap at least (default: 5)")
    parser.add_argument("--max-rounds", type=argument_type(positive_int, "max_rounds"), default=20,
                        help="timed rounds per cap at most (default: 20)")
    parser.add_argument("--round-budget", type=argument_type(positive_float, "round_budget"), default=10.0,
                        help="seconds of rounds per cap after which no more are added (default: 10)")
    parser.add_argument("--warmup-rounds", type=argument_type(non_negative_int, "warmup_rounds"), default=1)
    parser.add_argument("--predict-world-sizes", type=argument_type(lambda t: positive_ints(t, "world sizes"), "world_sizes"),
                        default=(8, 64, 512), help="world sizes to recommend a cap for (default: 8,64,512)")
    parser.add_argument("--link", choices=sorted(LINKS), default=None,
                        help="a preset link for the recommendation (default: one fitted on all-reduces measured here)")
    add_launch_options(parser.add_argument)


def _overhead(record) -> str:
    low, high = record.overhead_seconds_ci95
    return f"{record.overhead_seconds * 1e3:.1f} [{low * 1e3:.1f}, {high * 1e3:.1f}]"


def main(args: argparse.Namespace) -> int:
    resolved = launch_options(vars(args).get).resolve()
    check_seq_len(args.model, args.seq_len)
    if resolved.world_size < 2 and args.link is None:
        raise UsageError("one rank measures no link to fit: give --world-size 2 or more, or a --link preset")
    if args.rounds > args.max_rounds:
        raise UsageError(f"--rounds {args.rounds} exceeds --max-rounds {args.max_rounds}: raise --max-rounds")
    policy = RoundPolicy(args.rounds, args.max_rounds, args.warmup_rounds, 0.02, args.round_budget)
    with RankGroup(resolved.world_size, resolved.backend, resolved.device, resolved.timeout_seconds) as group:
        result = sweep(group, args.model, args.batch_size, args.seq_len, args.bucket_sizes, policy,
                       **step_numerics(vars(args).get))
        link = LINKS[args.link] if args.link else fitted_link(group, policy)
    for reason in result.skipped:
        print(f"skipped: {reason}")
    if not result.records:
        raise UsageError("every cap ran out of memory: use a smaller --batch-size or --seq-len")
    rows = [[r.strategy, f"{r.bucket_size_mb:g}", r.num_buckets, f"{r.step_seconds * 1e3:.1f}", _overhead(r)] for r in result.records]
    print(f"model {args.model}, {resolved.describe()}, batch {args.batch_size}, seq len {args.seq_len}, {args.precision}")
    print(tabulate(rows, headers=["strategy", "cap MiB", "buckets", "step ms", "overhead over local ms [95%]"], disable_numparse=True))
    for strategy in ("bucketed", "torch"):
        best = result.best(strategy)
        if best is not None:
            verdict = "resolved" if result.resolved_best(strategy) else "not resolved from the next best: their intervals overlap"
            print(f"measured best cap for {strategy}: {best.bucket_size_mb:g} MiB ({verdict})")
    local = sorted(r for rec in result.records for r in rec.local_round_seconds)
    local_seconds = local[len(local) // 2]
    slowdown = default_overlap_slowdown(resolved.backend == "gloo" and resolved.device == "cpu")
    print(f"\ncost model ({link.name}; compute = local step {local_seconds * 1e3:.1f} ms) recommends for bucketed:")
    recommendations = advice(args.model, args.batch_size, args.seq_len, local_seconds,
                             sorted(set(args.predict_world_sizes) | {resolved.world_size}), link, slowdown)
    print(tabulate([[r["world_size"], f"{r['bucket_size_mb']:g}", f"{r['step_seconds'] * 1e3:.1f}"] for r in recommendations],
                   headers=["ranks", "best cap MiB", "predicted step ms"], disable_numparse=True))
    return 0

