"""``python -m ddp trace TRACE.json[.gz] [--json OUT]``: what bounds each step of one rank's
PyTorch profiler trace of your own training.

It reads the Chrome trace torch.profiler writes (``export_chrome_trace``, or
``tensorboard_trace_handler``'s gzipped file) of one rank with CPU and CUDA activity and prints, per
``ProfilerStep#N`` (``torch.profiler.schedule`` writes one per ``profiler.step()``), the partition
of the step's GPU window into its compute, other steps' work, its communication alone, copies alone
and idle (with the host wait), each NCCL kernel as a collective with its phase and its overlapped and
exposed shares, and the inferences with their rules: what bounds the step and the tail. The
definitions are ``ddp.bench.collectives.timeline``'s; docs/profiling.md sets them beside Holistic
Trace Analysis' and nsys'. ``--json`` writes ``{"steps": [...]}`` with every field, in seconds.

Argument parsing and printing only.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ddp.analysis.tables import mib, ms, pct, table
from ddp.bench.collectives.reading import TraceFileError, load_trace
from ddp.bench.collectives.timeline import COMM_FROM_GLOO_RANGES, HOST_BOUND_SHARE, read_trace
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


def bound_text(step: dict) -> str:
    """What bounds the step, in words, with the figure the rule read."""
    window = step["window_seconds"] or 1.0
    share = {"host": ("the GPU waits on the host", step["host_wait_seconds"]),
             "compute": ("the step's compute runs", step["gpu_compute_seconds"]),
             "communication": ("its communication runs alone", step["exposed_comm_seconds"]),
             "copies": ("copies run alone", step["copy_only_seconds"])}[step["bound_by"]]
    return f"bound by {step['bound_by']}: {share[0]} {pct(share[1] / window)} of the window"


def exposed_text(step: dict) -> str:
    """Communication alone, and how much of it each phase's collectives of each kind hold."""
    window = step["window_seconds"] or 1.0
    held_by: dict[str, float] = {}
    for c in step["collectives"]:
        kind = f"{c['phase']} {c['cpu_collective'] or c['collective'] or 'collective'}"
        held_by[kind] = held_by.get(kind, 0.0) + c["exposed_seconds"]
    held = [f"{kind} {pct(seconds / window)}" for kind, seconds in sorted(held_by.items(), key=lambda item: -item[1])
            if seconds >= 0.0005 * window]
    return f"communication alone {pct(step['exposed_comm_seconds'] / window)}" + (f": {', '.join(held)}" if held else "")


def step_text(step: dict) -> str:
    """One step: its partition, its collectives' table and the inferences with their rules."""
    lines = [f"\n{step['name']} ({ms(step['step_seconds'], 1)} ms on the CPU; GPU window {ms(step['window_seconds'], 1)} ms)"]
    parts = [("compute", step["gpu_compute_seconds"]), ("other steps", step["other_steps_seconds"]),
             ("communication alone", step["exposed_comm_seconds"]), ("copies alone", step["copy_only_seconds"]),
             ("idle", step["idle_seconds"]), ("  of it waiting on the host", step["host_wait_seconds"])]
    window = step["window_seconds"] or 1.0
    lines.append(table([[name, ms(seconds), pct(seconds / window)] for name, seconds in parts], ["GPU window", "ms", "share"]))
    lines.append(f"communication {ms(step['comm_seconds'])} ms, of it beside compute {ms(step['overlapped_comm_seconds'])} ms")
    if step["collectives"]:
        rows = [[c["name"] + (f" ({c['cpu_collective']})" if c["cpu_collective"] else ""),
                 c["phase"] + (f": {c['range']}" if c["range"] else ""), ms(c["start_seconds"]), ms(c["end_seconds"]),
                 mib(c["size_bytes"]) if c["size_bytes"] else "", ms(c["overlapped_seconds"]), ms(c["exposed_seconds"])]
                for c in step["collectives"]]
        lines.append(table(rows, ["collective", "phase", "GPU start ms", "GPU end ms", "MiB", "overlapped ms", "exposed ms"]))
    if step["collectives_without_kernel"]:
        names = sorted({c["name"] or "?" for c in step["collectives_without_kernel"]})
        lines.append(f"{len(step['collectives_without_kernel'])} NCCL collectives launched no GPU kernel "
                     f"({', '.join(names)}: world size 1, or nothing to send)")
    if step["comm_source"] == COMM_FROM_GLOO_RANGES:
        lines.append("communication: gloo's ranges on the host (gloo over CUDA tensors launches no NCCL kernel)")
    lines.append(f"{bound_text(step)} [rule: {step['bound_by_rule']}]")
    lines.append(exposed_text(step))
    if step["tail"] is not None:
        lines.append(f"tail {step['tail']} [rule: {step['tail_rule']}]")
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
    if not reading.gpu_events:
        raise UsageError(f"{args.trace}: no GPU event: record it with activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]")
    print(header_line(args.trace, reading.header, len(reading.steps)))
    if not reading.from_profiler_steps:
        print("no ProfilerStep#N annotation (torch.profiler.schedule and profiler.step() write them): "
              "read as one step spanning the whole trace")
    if not reading.nccl_kernels:
        print("no NCCL kernel in this trace" + ("" if any(s["collectives_without_kernel"] or s["collectives"] for s in reading.steps)
                                                else ": its rank ran no NCCL collective while it was recorded"))
    print(f"Each step's GPU window (its first own GPU event to its last) classed instant by instant; times from the "
          f"step's start. Host-bound: host wait >= {HOST_BOUND_SHARE:.0%} of the window.")
    for step in reading.steps:
        print(step_text(step))
    if args.json is not None:
        try:
            with args.json.open("x") as out:  # "x": never overwrite, even a file written since the check above
                json.dump({"trace": str(args.trace), **reading.header, "from_profiler_steps": reading.from_profiler_steps,
                           "steps": reading.steps}, out, indent=1)
        except FileExistsError:
            raise UsageError(f"--json {args.json} exists: give a new file name (it is never overwritten)") from None
        print(f"\nwrote {args.json}")
    return 0
