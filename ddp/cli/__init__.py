"""``python -m ddp COMMAND`` (also ``ddp-bench COMMAND``): the command line of ddp-bench.

This package holds argument parsing and printing only; the work is done by ``ddp.bench`` and
``ddp.analysis``. Each command is a module with ``add_arguments(parser)`` and ``main(args)``,
imported only when it runs. Every error a user can cause (a bad option, a file that is not a run)
is one line, ``ddp-bench COMMAND: error: what to do``, with exit status 2 and no traceback, before
any rank starts. Under torchrun every rank validates the same options, and the line is printed
exactly once on each node (see ``fail``).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import os
import sys
import tempfile
import time
from pathlib import Path

from ddp.bench.config.options import OptionError
from ddp.bench.results.records import RunFileError
from ddp.strategies.registry import StrategyError

COMMANDS = {
    "report": ("ddp.cli.report", "tables, plots and commentary from saved benchmark runs"),
    "compare": ("ddp.cli.compare", "regression check of two saved runs, with intervals: exit 1 on a significant slowdown beyond the threshold"),
    "profile": ("ddp.cli.profile", "profile a few training steps: traces, overlap of communication with backward"),
    "run": ("ddp.cli.run", "the benchmarked training step under torchrun, any number of nodes"),
    "simulate": ("ddp.cli.simulate", "predict step time at other world sizes from a measured run"),
    "versus": ("ddp.cli.versus", "bucketed against PyTorch's DDP, alternating on one rank group"),
    "gpu-check": ("ddp.cli.gpu_check", "every claim only a GPU can check, in 8 minutes on one H100 (--rehearse: on the CPU)"),
    "buckets": ("ddp.cli.buckets", "which bucket size for my model: a measured sweep beside the cost model's advice"),
    "memory": ("ddp.cli.memory", "will it fit? predicted peak memory per rank by category, and the largest batch that fits"),
    "trace": ("ddp.cli.trace", "read your own training's profiler trace: each NCCL collective's GPU time, exposed communication, the tail"),
}


class UsageError(Exception):
    """A mistake on the command line or in its input; printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        fail(self.prog, message)


# How long a rank that did not print waits for the one that did before exiting (see fail).
PRINTED_WAIT_SECONDS = 10.0


def fail(prog: str, message: str):
    """Print ``prog: error: message`` once and exit 2.

    Under torchrun every rank of a node fails alike, and torchrun ends the other ranks as soon as
    one exits: printing from rank 0 only loses the line when another rank exits first, and
    printing from every rank repeats it. So the first rank of the node to fail takes a lock file
    that names the job and prints; the others wait until it has printed before they exit.
    """
    line = f"{prog}: error: {message}"
    if "LOCAL_RANK" not in os.environ:  # not under torchrun: this process is the only one
        print(line, file=sys.stderr, flush=True)
        raise SystemExit(2)
    lock, printed = _job_files()
    try:
        os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:  # another rank prints it; do not exit (and be ended) before it has
        deadline = time.monotonic() + PRINTED_WAIT_SECONDS
        while not printed.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not printed.exists():  # it died before printing: better twice than never
            print(line, file=sys.stderr, flush=True)
    else:
        print(line, file=sys.stderr, flush=True)
        printed.touch()
    raise SystemExit(2)


def _job_files() -> tuple[Path, Path]:
    """The lock and the printed marker of this torchrun job on this node: torchrun gives each job
    (and each restart of it) its own run id and rendezvous port."""
    job = "/".join(os.environ.get(name, "") for name in
                   ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "MASTER_ADDR", "MASTER_PORT"))
    stem = Path(tempfile.gettempdir()) / f"ddp-bench-error-{hashlib.sha1(job.encode()).hexdigest()[:16]}"
    return stem.with_suffix(".lock"), stem.with_suffix(".printed")


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
