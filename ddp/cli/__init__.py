"""``python -m ddp COMMAND`` (also ``ddp-bench COMMAND``): the command line of ddp-bench.

This package holds argument parsing and printing only; the work is done by ``ddp.bench`` and
``ddp.analysis``. Each command is a module with ``add_arguments(parser)`` and ``main(args)``,
imported only when it runs. Every error a user can cause (a bad option, a file that is not a run)
is one line, ``ddp-bench COMMAND: error: what to do``, with exit status 2 and no traceback, before
any rank starts; under torchrun only rank 0 prints it.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from ddp.bench.options import OptionError
from ddp.bench.records import RunFileError
from ddp.strategies.registry import StrategyError

COMMANDS = {
    "report": ("ddp.cli.report", "tables, plots and commentary from saved benchmark runs"),
    "compare": ("ddp.cli.compare", "regression check of two saved runs, with intervals: exit 1 on a resolved slowdown"),
    "profile": ("ddp.cli.profile", "profile a few training steps: traces, overlap of communication with backward"),
    "run": ("ddp.cli.run", "the benchmarked training step under torchrun, any number of nodes"),
    "simulate": ("ddp.cli.simulate", "predict step time at other world sizes from a measured run"),
    "versus": ("ddp.cli.versus", "bucketed against PyTorch's DDP, alternating on one rank group"),
    "gpu-check": ("ddp.cli.gpu_check", "everything one GPU can check: correctness on CUDA, xl steps, out of memory, profiles"),
    "buckets": ("ddp.cli.buckets", "which bucket size for my model: a measured sweep beside the cost model's advice"),
}


class UsageError(Exception):
    """A mistake on the command line or in its input; printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        fail(self.prog, message)


def fail(prog: str, message: str):
    """Print ``prog: error: message`` (rank 0 only, under torchrun) and exit 2."""
    if os.environ.get("RANK", "0") == "0":
        print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def parser_for(command: str | None) -> argparse.ArgumentParser:
    """The parser of ``ddp-bench``, with ``command``'s arguments added (only that command's module
    is imported)."""
    parser = _Parser(prog="ddp-bench", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    for name, (module_name, summary) in COMMANDS.items():
        sub = commands.add_parser(name, help=summary, description=summary)
        if name == command:
            module = importlib.import_module(module_name)
            module.add_arguments(sub)
            sub.set_defaults(run_command=module.main, prog=sub.prog)
    return parser


def command_parser(command: str) -> argparse.ArgumentParser:
    """One command's parser on its own, its options bound as ``main`` binds them."""
    module_name, summary = COMMANDS[command]
    parser = _Parser(prog=f"ddp-bench {command}", description=summary)
    importlib.import_module(module_name).add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser_for(argv[0] if argv else None).parse_args(argv)
    try:
        return args.run_command(args) or 0
    except (UsageError, OptionError, RunFileError, StrategyError) as error:
        fail(args.prog, str(error))
