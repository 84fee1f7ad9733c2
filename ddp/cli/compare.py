"""``python -m ddp compare OLD.json NEW.json --fail-slower 10%``: each benchmark's ratio new / old
with its 95% interval and a verdict (``ddp.analysis.compare``). Exit status 1 when some benchmark
is slower by the rule (its ratio beyond the threshold and its interval above 1); 0 otherwise, with
a line per benchmark left open saying about how many groups of ranks would decide it; 2 on bad input. Reads
what ``--benchmark-json`` and ``--benchmark-save`` write."""

from __future__ import annotations

import argparse
import sys

from ddp.analysis.compare import DEFAULT_THRESHOLD, gate
from ddp.bench.config.parsing import percent_type
from ddp.bench.results.records import load_run
from ddp.cli import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("old", metavar="OLD.json", help="the baseline run")
    parser.add_argument("new", metavar="NEW.json", help="the run to check")
    parser.add_argument("--fail-slower", default=DEFAULT_THRESHOLD, metavar="PERCENT", type=percent_type("--fail-slower"),
                        help="fail when a benchmark is slower by more than this and its interval lies above 1, e.g. 10%% "
                             f"(default: {DEFAULT_THRESHOLD * 100:g}%%)")


def main(args: argparse.Namespace) -> int:
    old, new = load_run(args.old), load_run(args.new)
    if not set(old.by_name()) & set(new.by_name()):
        raise UsageError(f"{args.old} and {args.new} have no benchmark in common: compare runs of the same suite")
    judged = gate(old, new, args.fail_slower)
    for warning in judged.warnings:
        print(warning, file=sys.stderr)
    print("\n".join(judged.lines))
    return 1 if judged.failed else 0
