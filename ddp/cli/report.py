"""``python -m ddp report RUN.json [RUN2.json ...] --out DIR``: tables, plots and commentary from
saved runs (``ddp.analysis.markdown``); the last run is reported, earlier ones compared with it."""

from __future__ import annotations

import argparse

from ddp.analysis.markdown import write_report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "runs", nargs="+", metavar="RUN.json",
        help="saved pytest-benchmark runs (--benchmark-json, or .benchmarks/...); the last is reported, "
        "earlier ones are compared with it",
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="directory for report.md and the PNG plots")


def main(args: argparse.Namespace) -> int:
    print(write_report(args.runs, args.out))
    return 0
