"""``python -m ddp profile``: a few training steps under ``torch.profiler`` on every rank
(``ddp.bench.rounds.profiling``), and how much of the gradient communication the backward pass hides
(``ddp.analysis.overlap``): per-rank traces, ``summary.json`` and timelines in ``--out``."""

from __future__ import annotations

import argparse
from pathlib import Path

from tabulate import tabulate

from ddp.analysis.profiles import write_profiles
from ddp.bench.collectives.timeline import BOUND_BY_RULE
from ddp.bench.config.options import add_config_options, add_launch_options, config_values, launch_options
from ddp.bench.config.parsing import argument_type, non_negative_int, positive_int
from ddp.bench.config.step_config import AXES, StepConfig
from ddp.bench.results.records import ProfileSummary
from ddp.bench.rounds.profiling import ProfileConfig, profile_on, traced_by_comm_hook
from ddp.bench.rounds.trainer import CannotRun
from ddp.cli import UsageError
from ddp.launcher import RankGroup
from ddp.strategies.bucketed import DEFAULT_BUCKET_SIZE_MB
from ddp.strategies.registry import traits


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_options(parser.add_argument, {"strategy": None, "model": "small", "batch_size": 2, "seq_len": 64,
                                             "bucket_size_mb": DEFAULT_BUCKET_SIZE_MB}, lists=("strategy",), required=("strategy",))
    parser.add_argument("--warmup-steps", type=argument_type(non_negative_int, "warmup_steps"), default=None,
                        help="untraced steps before profiling (default: the steps after which the strategy's plan "
                        "settles, e.g. 3 for torch, whose DDP rebuilds its buckets in its second step)")
    parser.add_argument("--steps", type=argument_type(positive_int, "steps"), default=2, help="profiled steps (default: 2)")
    add_launch_options(parser.add_argument)
    parser.add_argument("--out", required=True, type=Path, help="folder for traces, summary.json and timelines")


def summary_table(summary: ProfileSummary) -> str:
    """The figures a reader wants first, one row per strategy (slowest rank)."""
    rows = []
    for name, s in summary.strategies.items():
        slowest = next(r for r in s.ranks if r["rank"] == s.slowest_rank)
        tail = slowest.get("tail")
        tail_text = f"{tail} ({slowest['collective_exposed_seconds'][tail] * 1e3:.1f} ms)" if tail else None
        rows.append([name, s.step_seconds * 1e3, s.comm_seconds * 1e3, s.overlap_fraction, s.exposed_comm_seconds * 1e3,
                     tail_text, s.bound_by, s.slowest_rank, s.comm_source])
    headers = ["strategy", "step_ms", "comm_ms/step", "overlap_fraction", "exposed_comm_ms/step", "tail collective (exposed)",
               "bound_by", "slowest_rank", "comm_from"]
    return (tabulate(rows, headers=headers, floatfmt=("", ".0f", ".0f", ".2f", ".0f", "", "", "", ""), missingval="-")
            + f"\nbound_by: {BOUND_BY_RULE}")


def main(args: argparse.Namespace) -> int:
    resolved = launch_options(vars(args).get).resolve()
    values = config_values(vars(args).get)
    hooked = [name for name in args.strategy if traced_by_comm_hook(name)]
    if values["grad_comm"] != AXES["grad_comm"].default and hooked and resolved.backend != "nccl":
        raise UsageError(
            f"profiling {', '.join(hooked)} with --grad-comm {values['grad_comm']} needs nccl: on {resolved.backend} its "
            "collectives are recorded through a comm hook, and DDP takes one (PyTorch's compress hook); drop it or --grad-comm"
        )
    if args.out.exists() and not args.out.is_dir():
        raise UsageError(f"--out {args.out} is a file: give a folder (it is created if missing)")
    configs = [
        ProfileConfig(
            StepConfig.of(name, values),
            warmup_steps=traits(name).steps_to_settle if args.warmup_steps is None else args.warmup_steps,
            steps=args.steps, out_dir=str(args.out.resolve()),
        )
        for name in args.strategy
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    with RankGroup(resolved.world_size, resolved.backend, resolved.device, resolved.timeout_seconds) as group:
        try:
            rank_records = profile_on(group, configs)
        except CannotRun as error:
            raise UsageError(str(error)) from None
    summary = write_profiles(resolved.world_size, resolved.backend, resolved.device, configs, rank_records, args.out)
    print(summary_table(summary))
    print(f"\nwrote {args.out / 'summary.json'}, traces trace_<strategy>_rank<r>.json and timeline_<strategy>.png")
    return 0
