"""``python -m ddp trace TRACE.json[.gz] [--json OUT]``: what bounds each step of one rank's
PyTorch profiler trace of your own training.

It reads the Chrome trace torch.profiler writes (``export_chrome_trace``, or
``tensorboard_trace_handler``'s gzipped file) of one rank with CPU and CUDA activity and prints, per
``ProfilerStep#N`` (``torch.profiler.schedule`` writes one per ``profiler.step()``), the partition
of the step's GPU window into its compute, other steps' work, its communication alone, copies alone
and idle (with the host wait), each NCCL kernel as a collective with its phase, its overlapped and
exposed shares and its bus bandwidth (where the trace gives its size and the world size), and the
inferences: what bounds the step and the tail; the rules once, first; then a summary over the
steps (medians, lowest and highest, how many steps each verdict had). The definitions are
``ddp.bench.collectives.timeline``'s; docs/profiling.md sets them beside Holistic Trace Analysis'
and nsys'. ``--json`` writes ``{"steps": [...], "summary": {...}}`` with every field, in seconds.

Argument parsing and printing only.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ddp.analysis.tables import mib, ms, pct, table
from ddp.bench.collectives.reading import COMM_FROM_GLOO_RANGES, TraceFileError, load_trace
from ddp.bench.collectives.timeline import BOUND_BY_RULE, PARTS, TAIL_RULE, over_steps, read_trace
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


# The parts of the window as printed, host wait apart from the rest of idle (what the verdict reads).
PART_NAMES = {"gpu_compute_seconds": "compute", "other_steps_seconds": "other steps",
              "exposed_comm_seconds": "communication alone", "copy_only_seconds": "copies alone",
              "host_wait_seconds": "idle waiting on the host", "idle_not_host_seconds": "idle not waiting on the host"}
VERDICT_PART = {"host": "host_wait_seconds", "compute": "gpu_compute_seconds", "communication": "exposed_comm_seconds",
                "copies": "copy_only_seconds"}


def _parts(step: dict) -> dict[str, float]:
    parts = {key: step[key] for key in PARTS if key != "idle_seconds"}
    return {**parts, "host_wait_seconds": step["host_wait_seconds"],
            "idle_not_host_seconds": max(0.0, step["idle_seconds"] - step["host_wait_seconds"])}


def bound_text(step: dict) -> str:
    """What bounds the step, in words, with the figure the rule read, and the largest part of the
    window where it is another (idle apart from host wait)."""
    window = step["window_seconds"] or 1.0
    parts = _parts(step)
    read = VERDICT_PART[step["bound_by"]]
    text = f"bound by {step['bound_by']}: {PART_NAMES[read]} {pct(parts[read] / window)} of the window"
    largest = max(parts, key=parts.get)
    if largest != read and parts[largest] > parts[read]:
        text += f"; the largest part is {PART_NAMES[largest]}, {pct(parts[largest] / window)}"
    return text


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
                 mib(c["size_bytes"]) if c["size_bytes"] else "",
                 f"{c['bus_bandwidth_bytes_per_second'] / 1e9:.1f}" if c.get("bus_bandwidth_bytes_per_second") else "",
                 ms(c["overlapped_seconds"]), ms(c["exposed_seconds"])]
                for c in step["collectives"]]
        lines.append(table(rows, ["collective", "phase", "GPU start ms", "GPU end ms", "MiB", "busbw GB/s",
                                  "overlapped ms", "exposed ms"]))
    if step["collectives_without_kernel"]:
        names = sorted({c["name"] or "?" for c in step["collectives_without_kernel"]})
        lines.append(f"{len(step['collectives_without_kernel'])} NCCL collectives launched no GPU kernel "
                     f"({', '.join(names)}: world size 1, or nothing to send)")
    if step["comm_source"] == COMM_FROM_GLOO_RANGES:
        lines.append("communication: gloo's ranges on the host (gloo over CUDA tensors launches no NCCL kernel)")
    lines.append(bound_text(step))
    lines.append(exposed_text(step))
    if step["tail"] is not None:
        lines.append(f"tail {step['tail']}")
    return "\n".join(lines)


RULES = (f"Each step's GPU window (its first own GPU event to its last) is classed instant by instant; times from the "
         f"step's start.\nbound by: {BOUND_BY_RULE}.\ntail: {TAIL_RULE}.\nbusbw: nccl-tests' bus bandwidth, "
         f"the collective's buffer over its kernel's time x 2(n-1)/n for an all-reduce, (n-1)/n for an all-gather "
         f"or a reduce-scatter, 1 for a broadcast or a reduce.")


def summary_text(summary: dict) -> str:
    """The steps together: each part's median and spread, the verdicts, the usual tail."""
    median, lowest, highest = summary["median"], summary["lowest"], summary["highest"]
    window = median["window_seconds"] or 1.0
    keys = ["window_seconds", *[k for k in PARTS], "host_wait_seconds", "comm_seconds", "overlapped_comm_seconds"]
    rows = [[key.removesuffix("_seconds").replace("_", " "), ms(median[key]), f"{ms(lowest[key])} - {ms(highest[key])}",
             pct(median[key] / window)] for key in keys]
    verdicts = ", ".join(f"{verdict} in {count}" for verdict, count in summary["bound_by_steps"].items())
    lines = [f"\nover {summary['steps']} steps", table(rows, ["GPU window", "median ms", "lowest - highest ms", "share of the median window"]),
             f"bound by, step by step: {verdicts}; by the rule on the medians: {median['bound_by']}"]
    if summary["tail"] is not None:
        lines.append(f"tail most often: {summary['tail']}")
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
    print(RULES)
    for step in reading.steps:
        print(step_text(step))
    summary = over_steps(reading.steps) if reading.steps else None
    if summary is not None and summary["steps"] > 1:
        print(summary_text(summary))
    if args.json is not None:
        try:
            with args.json.open("x") as out:  # "x": never overwrite, even a file written since the check above
                json.dump({"trace": str(args.trace), **reading.header, "from_profiler_steps": reading.from_profiler_steps,
                           "steps": reading.steps, "summary": summary}, out, indent=1)
        except FileExistsError:
            raise UsageError(f"--json {args.json} exists: give a new file name (it is never overwritten)") from None
        print(f"\nwrote {args.json}")
    return 0
