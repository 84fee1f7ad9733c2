"""``python -m ddp trace TRACE.json[.gz] [--json OUT]``: one rank's PyTorch profiler trace of your own
training, read collective by collective, with the definitions ``ddp profile`` uses.

It reads the Chrome trace torch.profiler writes (``export_chrome_trace``, or
``tensorboard_trace_handler``'s gzipped file) of one rank with CPU and CUDA activity, and prints,
per ``ProfilerStep#N`` (``torch.profiler.schedule`` writes one per ``profiler.step()``): each NCCL
kernel as a collective (its collective and place, ``AllReduce 3``), its GPU start and end in ms from
the step's start and its share of the step's exposed communication; the step's exposed
communication, its communication overlapped with backward's computation, and the tail; and how
each phase was found. Definitions (``ddp.bench.collectives.reading.read_trace``, figures by
``ddp.analysis.overlap.trace_step_figures``):

- a GPU event belongs to the step whose ``ProfilerStep#N`` range contains its CPU launch (its
  correlation id); a trace without any is read as one step spanning the whole trace;
- backward's computation ends with the last compute kernel launched inside an
  ``autograd::engine::evaluate_function`` range (or inside the suite's own "backward" range);
- the optimizer starts with the first compute kernel launched inside an ``Optimizer.step#...``
  range (or the suite's "optimizer" range);
- the exposed window runs from the end of backward's computation to the optimizer's start, on the
  GPU's clock; each collective's share of it is the part from the later of backward's end and the
  previous completion to its own completion (``collective_exposure``); the tail is the collective
  that completed last among those that started before the optimizer (``tail_of``);
- where a range is missing the step falls back to something near (the kernels launched before the
  optimizer's first, the first compute kernel after the last NCCL kernel), and says so.

Argument parsing and printing only: the reading is ``ddp.bench.collectives.reading``, the figures
``ddp.analysis.overlap``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ddp.analysis.overlap import trace_step_figures
from ddp.analysis.tables import mib, ms, table
from ddp.bench.collectives.reading import TraceFileError, load_trace, read_trace
from ddp.cli import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", type=Path, metavar="TRACE",
                        help="one rank's PyTorch profiler trace (Chrome JSON, gzipped or not) with CUDA activity")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT",
                        help="also write the figures to this JSON file, times in seconds (never overwritten)")


def header_line(path: Path, header: dict, steps: int) -> str:
    """Who recorded the trace, as far as it says: rank, world size, backend, NCCL, GPU."""
    said = []
    if header["rank"] is not None or header["world_size"] is not None:
        said.append(f"rank {header['rank'] if header['rank'] is not None else '?'} of "
                    f"{header['world_size'] if header['world_size'] is not None else '?'}")
    if header["backend"]:
        said.append(f"backend {header['backend']}" + (f" (NCCL {header['nccl_version']})" if header["nccl_version"] else ""))
    said.append(f"GPU {header['gpu']}" if header["gpu"] else "GPU not recorded")
    return f"{path.name}: {', '.join(said)}; {steps} step{'s' if steps != 1 else ''}"


def step_text(figures: dict) -> str:
    """One step: its collectives' table and what the step waited for."""
    lines = [f"\n{figures['name']} ({ms(figures['step_seconds'], 1)} ms)"]
    if figures["collectives"]:
        rows = [[c["name"], ms(c["start_seconds"]), ms(c["end_seconds"]), mib(c["size_bytes"]) if c["size_bytes"] else "",
                 ms(c["exposed_seconds"])] for c in figures["collectives"]]
        lines.append(table(rows, ["collective", "GPU start ms", "GPU end ms", "MiB", "exposed ms"]))
    else:
        lines.append("no NCCL kernel launched in this step")
    attributed = sum(c["exposed_seconds"] for c in figures["collectives"])
    lines.append(f"exposed communication {ms(figures['exposed_comm_seconds'])} ms (backward's computation ends at "
                 f"{ms(figures['backward_compute_end_seconds'])} ms, the optimizer starts at "
                 f"{ms(figures['optimizer_start_seconds'])} ms), of which the collectives hold {ms(attributed)} ms")
    lines.append(f"overlapped with backward's computation {ms(figures['overlapped_comm_seconds'])} ms; "
                 f"tail {figures['tail'] or '-'}")
    lines.append(f"found: backward's end from {figures['found']['backward']}; "
                 f"the optimizer's start from {figures['found']['optimizer']}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    if args.json is not None and args.json.exists():
        raise UsageError(f"--json {args.json} exists: give a new file name (it is never overwritten)")
    if args.json is not None and not args.json.parent.is_dir():
        raise UsageError(f"--json {args.json}: no folder {args.json.parent}")
    try:
        trace = load_trace(args.trace)
    except TraceFileError as error:
        raise UsageError(str(error)) from None
    try:
        reading = read_trace(trace)
    except (KeyError, TypeError, ValueError) as error:  # a file of the right shape with events of another
        raise UsageError(f"{args.trace}: an event is not as torch.profiler writes it ({error!r})") from None
    if not reading.nccl_kernels:
        print(f"{args.trace.name}: no NCCL kernel in this trace, " + (
            f"{reading.gpu_events} GPU events and none NCCL's: its rank ran no NCCL collective while it was recorded"
            if reading.gpu_events else
            "and no GPU event: record it with activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]"))
        return 0
    print(header_line(args.trace, reading.header, len(reading.steps)))
    if not reading.from_profiler_steps:
        print("no ProfilerStep#N annotation (torch.profiler.schedule and profiler.step() write them): "
              "read as one step spanning the whole trace")
    print("GPU times in ms from the step's start (its ProfilerStep range's); exposed: each collective's share of the "
          "step's exposed communication")
    figures = [trace_step_figures(step) for step in reading.steps]
    for step in figures:
        print(step_text(step))
    if args.json is not None:
        try:
            with args.json.open("x") as out:  # "x": never overwrite, even a file written since the check above
                json.dump({"trace": str(args.trace), **reading.header, "from_profiler_steps": reading.from_profiler_steps,
                           "steps": figures}, out, indent=1)
        except FileExistsError:
            raise UsageError(f"--json {args.json} exists: give a new file name (it is never overwritten)") from None
        print(f"\nwrote {args.json}")
    return 0
