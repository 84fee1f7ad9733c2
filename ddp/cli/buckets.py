"""``python -m ddp buckets --model mypkg.mod:build``: which bucket size for my model? Measures the
bucketing strategies (``bucketed`` and ``torch`` by default) over bucket caps on this machine, each
paired with ``local`` (``ddp.bench.rounds.buckets``), and prints the measured best cap beside the cost
model's recommendation at larger world sizes (``ddp.analysis.costmodel``)."""

from __future__ import annotations

import argparse

from ddp.analysis.costmodel import LINKS, advice, default_overlap_slowdown, fit_link
from ddp.analysis.tables import interval_ms, ms, table
from ddp.bench.config.options import (
    RoundOptions,
    add_config_options,
    add_launch_options,
    add_round_options,
    config_values,
    launch_options,
    round_options,
)
from ddp.bench.config.parsing import argument_type, positive_ints
from ddp.bench.config.step_config import StepConfig
from ddp.bench.rounds.buckets import link_samples, sweep
from ddp.cli import UsageError
from ddp.launcher import RankGroup
from ddp.strategies.registry import BUCKETED_STRATEGIES, takes_bucket_size

# Per cap: 5 to 20 rounds, until the median is within +-2% or 10 s of rounds were spent.
ROUNDS = RoundOptions(min_rounds=6, max_rounds=20, warmup_rounds=1, target_precision=0.02, budget_seconds=10.0)
BUCKET_SIZES_MB = (1.0, 5.0, 25.0, 100.0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_options(parser.add_argument, {"model": "mini", "batch_size": 2, "seq_len": 64, "bucket_size_mb": BUCKET_SIZES_MB,
                                             "strategy": BUCKETED_STRATEGIES}, lists=("strategy", "bucket_size_mb"))
    add_round_options(parser.add_argument, ROUNDS)
    parser.add_argument("--predict-world-sizes", type=argument_type(lambda t: positive_ints(t, "world sizes"), "world_sizes"),
                        default=(8, 64, 512), help="world sizes to recommend a cap for (default: 8,64,512)")
    parser.add_argument("--link", choices=sorted(LINKS), default=None,
                        help="a preset link for the recommendation (default: one fitted on all-reduces measured here)")
    add_launch_options(parser.add_argument)


def main(args: argparse.Namespace) -> int:
    resolved = launch_options(vars(args).get).resolve()
    if resolved.world_size < 2 and args.link is None:
        raise UsageError("one rank measures no link to fit: give --world-size 2 or more, or a --link preset")
    without_cap = [name for name in args.strategy if not takes_bucket_size(name)]
    if without_cap:
        raise UsageError(f"--strategies {', '.join(without_cap)} take no bucket size: give strategies with a bucket_size_mb option")
    values = config_values(vars(args).get)
    caps = values.pop("bucket_size_mb")
    first = [StepConfig.of(strategy, {**values, "bucket_size_mb": caps[0]}) for strategy in args.strategy]  # checked now
    rounds = round_options(vars(args).get, ROUNDS)
    with RankGroup(resolved.world_size, resolved.backend, resolved.device, resolved.timeout_seconds) as group:
        result = sweep(group, values, caps, rounds, args.strategy)
        samples = [] if args.link else link_samples(group, rounds)
    link = LINKS[args.link] if args.link else fit_link(samples, name=f"fitted on {resolved.backend} {resolved.world_size} ranks here")
    for reason in result.skipped:
        print(f"skipped: {reason}")
    if not result.records:
        raise UsageError(f"no cap could be measured ({result.skipped[0]})")
    rows = [[r.label, r.num_buckets, ms(r.step_seconds, 1), f"{ms(r.overhead_seconds, 1)} {interval_ms(r.overhead_seconds_ci95, 1)}"]
            for r in result.records]
    print(f"{first[0].group_label()}, {resolved.describe()}")
    print(table(rows, ["strategy", "buckets", "step ms", "overhead over local ms [95%]"]))
    for strategy in args.strategy:
        best = result.best(strategy)
        if best is not None:
            verdict = "resolved" if result.resolved_best(strategy) else "not resolved from the next best: their intervals overlap"
            print(f"measured best cap for {strategy}: {best.config.bucket_size_mb:g} MiB ({verdict})")
    local = sorted(r for rec in result.records for r in rec.local_round_seconds)
    local_seconds = local[len(local) // 2]
    slowdown = default_overlap_slowdown(resolved.backend == "gloo" and resolved.device == "cpu")
    print(f"\ncost model ({link.name}; compute = local step {ms(local_seconds, 1)} ms) recommends for bucketed:")
    recommendations = advice(args.model, first[0].step_shape, local_seconds,
                             sorted(set(args.predict_world_sizes) | {resolved.world_size}), link, slowdown)
    print(table([[r.world_size, f"{r.bucket_size_mb:g}", ms(r.step_seconds, 1)] for r in recommendations],
                ["ranks", "best cap MiB", "predicted step ms"]))
    return 0
