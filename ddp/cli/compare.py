"""``python -m ddp compare OLD.json NEW.json --fail-slower 10%``: each benchmark's ratio new / old
with its 95% interval and a verdict (``ddp.analysis.compare``). Exit status 1 only when some
benchmark is slower by more than the threshold with its interval entirely beyond it; 0 otherwise;
2 on bad input. Reads what ``--benchmark-json`` and ``--benchmark-save`` write."""

from __future__ import annotations

import argparse
import sys

from ddp.analysis.compare import compare, failed, machine_notes, suspect_differences, table
from ddp.bench.options import percent_type
from ddp.bench.records import load_run
from ddp.cli import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("old", metavar="OLD.json", help="the baseline run")
    parser.add_argument("new", metavar="NEW.json", help="the run to check")
    parser.add_argument("--fail-slower", default=0.10, metavar="PERCENT", type=percent_type("--fail-slower"),
                        help="fail when a benchmark is resolved slower by more than this, e.g. 10%% (default: 10%%)")


def main(args: argparse.Namespace) -> int:
    old, new = load_run(args.old), load_run(args.new)
    if not set(old.by_name()) & set(new.by_name()):
        raise UsageError(f"{args.old} and {args.new} have no benchmark in common: compare runs of the same suite")
    differences = suspect_differences(old, new)
    if differences:
        facts = "; ".join(f"{key}: {a} vs {b}" for key, (a, b) in differences.items())
        print(f"WARNING: the runs come from different machines or setups ({facts}): the ratios measure the "
              "machine as much as the code", file=sys.stderr)
    rows = compare(old, new, args.fail_slower)
    print(table(rows))
    for line in machine_notes(rows):
        print(line)
    slower = failed(rows)
    counts = {v: sum(r.verdict == v for r in rows) for v in dict.fromkeys(r.verdict for r in rows)}
    print(", ".join(f"{n} {v}" for v, n in counts.items()) + f" (threshold {args.fail_slower:.0%})")
    if slower:
        print(f"FAIL: {len(slower)} benchmark(s) slower by more than {args.fail_slower:.0%}: "
              + ", ".join(r.name for r in slower))
        return 1
    return 0
