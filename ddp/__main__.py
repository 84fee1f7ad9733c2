"""``python -m ddp COMMAND`` (also ``ddp-bench COMMAND``): the command-line front of ddp-bench.

Each command lives in its own module, which defines ``add_arguments(parser)`` and ``main(args)``;
modules are imported only when their command runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "report": ("ddp.report", "tables, plots and commentary from saved benchmark runs"),
    "profile": ("ddp.profile", "profile a few training steps: traces, overlap of communication with backward"),
    "run": ("ddp.run", "the benchmarked training step under torchrun, any number of nodes"),
    "simulate": ("ddp.simulate", "predict step time at other world sizes from a measured run"),
    "versus": ("ddp.versus", "bucketed against PyTorch's DDP, alternating on one rank group"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ddp-bench", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    argv = sys.argv[1:] if argv is None else argv
    for name, (module_name, summary) in COMMANDS.items():
        sub = commands.add_parser(name, help=summary, description=summary)
        # Only the chosen command's module is imported (and asked for its options).
        if argv and argv[0] == name:
            module = importlib.import_module(module_name)
            module.add_arguments(sub)
            sub.set_defaults(run_command=module.main)
    args = parser.parse_args(argv)
    return args.run_command(args) or 0


if __name__ == "__main__":
    sys.exit(main())
