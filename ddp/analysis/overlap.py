"""Overlap of communication with backward, from profiled steps: interval arithmetic, reading
CUDA traces, and the figures of ``summary.json``. Pure functions of step records: no tensors, no ranks.

A profiled step (``ddp.bench.profiling``) is a record of ``[start, end]`` of every phase
("forward", "backward", "gradient_sync", "optimizer"), ``backward_compute_end`` (the last gradient
computed) and its ``collectives`` (launch and completion of each), all on the ``time.perf_counter``
clock, one clock for every rank since ``RankGroup`` runs them on one host.

Per step (``step_comm_figures``): ``exposed_comm_seconds`` is the time the step waited for
communication once backward's computation was done (the benchmarks' ``exposed_comm_seconds``),
``overlapped_comm_seconds`` the time collectives were in flight during backward's computation,
``comm_seconds`` their sum, and ``overlap_fraction`` the overlapped share of it.

On CUDA the collectives' futures complete when their kernels are enqueued, not when they end, so
there the intervals come from the trace (``cuda_steps_from_trace``): kernels are classified as
Holistic Trace Analysis does (``kernel_kind``), phases and the backward window come from compute
kernels only, and communication from NCCL kernels where a step has any, else (world size 1, or
gloo over CUDA tensors, where there are none) from the collectives' own launch and completion
records. ``comm_source`` says which.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import NamedTuple

from ddp.bench.records import PHASES  # the step's phases, named once

# Thread id of the track that add_collective_track adds to each trace; no real thread has it.
COLLECTIVE_TRACK_TID = 1_000_000_000
# Where a step's communication intervals come from (the "comm_source" of steps and summary.json):
COMM_FROM_NCCL_KERNELS = "nccl_kernels"  # GPU time of the NCCL kernels in a CUDA trace
COMM_FROM_COLLECTIVE_RECORDS = "collective_records"  # ddp.strategies.tracing's launch and completion stamps
COMM_FROM_MIXED = "mixed"  # a rank whose profiled steps did not all use the same source

Interval = tuple[float, float]


def union_intervals(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering exactly the given ones; empty intervals vanish."""
    merged: list[list[float]] = []
    for start, end in sorted((s, e) for s, e in intervals if e > s):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def covered_seconds(intervals: Iterable[Interval]) -> float:
    """Length of the union: time during which at least one interval is open."""
    return sum(e - s for s, e in union_intervals(intervals))


def covered_seconds_within(intervals: Iterable[Interval], window: Interval) -> float:
    """Length of the union's part that lies inside ``window``."""
    lo, hi = window
    return sum(max(0.0, min(e, hi) - max(s, lo)) for s, e in union_intervals(intervals))


def step_comm_figures(step: dict) -> dict:
    """comm, overlapped and exposed seconds of one step record (see ``profile_rank``).

    Exposed communication is what the step waited for: from the end of backward's computation to
    the start of the optimizer, the figure ``ddp.bench.trainer`` defines as ``exposed_comm_seconds``
    (a wait inside ``loss.backward()``, where PyTorch's DDP waits, counts as any other), so that
    forward + backward compute + exposed + optimizer is the step. Overlapped communication is the
    time collectives were in flight during backward's computation: hidden behind it. A step that
    launched no collective exposes nothing.
    """
    comm = [(c["launch_seconds"], c["done_seconds"]) for c in step["collectives"]]
    if not comm:
        return {"comm_seconds": 0.0, "overlapped_comm_seconds": 0.0, "exposed_comm_seconds": 0.0}
    overlapped = covered_seconds_within(comm, (step["backward"][0], step["backward_compute_end"]))
    exposed = max(0.0, step["optimizer"][0] - step["backward_compute_end"])
    return {"comm_seconds": overlapped + exposed, "overlapped_comm_seconds": overlapped, "exposed_comm_seconds": exposed}


def collective_exposure(step: dict) -> list[dict]:
    """Each collective of one step record with its share of the step's exposed communication.

    The exposed window runs from the end of backward's computation to the start of the optimizer
    (``step_comm_figures``). Taken in the order the collectives completed, each holds the part of
    the window from the later of backward's end and the previous completion to its own
    completion: what the step waited for it alone. The shares add up to the window up to the last
    completion; what follows it (copies back, the wake-up) is no collective's
    (``unattributed_exposed_seconds`` of ``rank_figures``).
    """
    start, end = step["backward_compute_end"], step["optimizer"][0]
    shares, waited_until = [], start
    for c in sorted(step["collectives"], key=lambda c: c["done_seconds"]):
        done = min(c["done_seconds"], end)
        shares.append({"label": c["label"], "size_bytes": c["size_bytes"], "exposed_seconds": max(0.0, done - waited_until)})
        waited_until = max(waited_until, done)
    return shares


def comm_source(steps: list[dict]) -> str:
    """Where the communication times of these steps came from: a ``COMM_FROM_*`` value.

    Steps built on the CPU path carry no "comm_source": their collectives are the records.
    """
    sources = {step.get("comm_source", COMM_FROM_COLLECTIVE_RECORDS) for step in steps}
    return sources.pop() if len(sources) == 1 else COMM_FROM_MIXED


def rank_figures(steps: list[dict]) -> dict:
    """Per-step means over the profiled steps of one rank; overlap_fraction is a ratio of totals.

    overlap_fraction is None when nothing was communicated (``local``). collectives_per_step and
    comm_bytes_per_step count what the strategy launched (the records), whatever gave the times.
    """
    n = len(steps)
    per_step = [step_comm_figures(step) for step in steps]
    # CUDA steps keep the records beside the kernel intervals; on the CPU path they are one list.
    records = [step.get("collective_records", step["collectives"]) for step in steps]
    totals = {key: sum(f[key] for f in per_step) for key in per_step[0]}
    figures = {
        "step_seconds": sum(s["optimizer"][1] - s["forward"][0] for s in steps) / n,
        **{f"{phase}_seconds": sum(s[phase][1] - s[phase][0] for s in steps) / n for phase in PHASES},
        "backward_compute_seconds": sum(s["backward_compute_end"] - s["backward"][0] for s in steps) / n,
        **{key: value / n for key, value in totals.items()},
        "overlap_fraction": (
            totals["overlapped_comm_seconds"] / totals["comm_seconds"] if totals["comm_seconds"] > 0 else None
        ),
        **exposure_figures(steps),
        "collectives_per_step": sum(len(r) for r in records) / n,
        "comm_bytes_per_step": sum(c["size_bytes"] for r in records for c in r) / n,
        "comm_source": comm_source(steps),
    }
    return figures


def exposure_figures(steps: list[dict]) -> dict:
    """Per collective label (in the order of the first step's completions), its exposed seconds
    per step (``collective_exposure``, averaged); the ``tail``, the collective exposed the most
    (None if none was); and the exposed seconds no collective accounts for."""
    per_label: dict[str, list[float]] = {}
    attributed = 0.0
    for step in steps:
        for share in collective_exposure(step):
            per_label.setdefault(share["label"], []).append(share["exposed_seconds"])
            attributed += share["exposed_seconds"]
    exposed = {label: sum(values) / len(steps) for label, values in per_label.items()}
    tail = max(exposed, key=exposed.get, default=None)
    total = sum(step_comm_figures(step)["exposed_comm_seconds"] for step in steps)
    return {
        "collective_exposed_seconds": exposed,
        "tail": tail if tail is not None and exposed[tail] > 0 else None,
        "unattributed_exposed_seconds": max(0.0, total - attributed) / len(steps),
    }


def strategy_summary(rank_records: list[dict]) -> dict:
    """Figures of every rank, and at the top level those of the slowest rank (largest step time),
    whose exposed communication is the one the group actually waits for."""
    ranks = [{"rank": r["rank"], **rank_figures(r["steps"]), "trace_file": r["trace_file"]} for r in rank_records]
    slowest = max(ranks, key=lambda f: f["step_seconds"])
    keys = ("step_seconds", "comm_seconds", "overlap_fraction", "exposed_comm_seconds", "overlapped_comm_seconds",
            "comm_source")
    return {**{key: slowest[key] for key in keys}, "slowest_rank": slowest["rank"], "ranks": ranks}


def trace_offset_us(events: list[dict], steps: list[dict]) -> float:
    """Trace time (µs) minus ``perf_counter`` time (µs), from the first profiled "forward" range,
    whose start was stamped on both clocks within microseconds."""
    forward = min((e for e in events if e.get("name") == "forward" and e.get("cat") == "user_annotation"), key=lambda e: e["ts"])
    return forward["ts"] - steps[0]["forward"][0] * 1e6


def add_collective_track(trace: dict, steps: list[dict]) -> None:
    """Add each collective, launch to completion, as an async event on a track of its own.

    The profiler's own "gloo:all_reduce" events on gloo's threads show only the time a worker
    thread spent on each; these show how long the training loop had it in flight.
    """
    events = trace["traceEvents"]
    offset = trace_offset_us(events, steps)
    pid = next(e["pid"] for e in events if e.get("name") == "forward")
    tid = COLLECTIVE_TRACK_TID
    events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                   "args": {"name": "collectives in flight (ddp-bench)"}})
    index = 0
    for step_index, step in enumerate(steps):
        for c in step["collectives"]:
            common = {"cat": "ddp_bench_collective", "name": c["label"], "id": index, "pid": pid, "tid": tid}
            args = {"size_bytes": c["size_bytes"], "step": step_index}
            events.append({**common, "ph": "b", "ts": c["launch_seconds"] * 1e6 + offset, "args": args})
            events.append({**common, "ph": "e", "ts": c["done_seconds"] * 1e6 + offset})
            index += 1


# GPU event categories of a PyTorch (Kineto) CUDA trace; kernel_kind classifies these only.
GPU_EVENT_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset", "cuda_sync")
# NCCL's kernels: ncclDevKernel_<coll>_<op>_<type>_<algo>_<proto> since NCCL 2.19, ncclKernel_...
# before; HTA's communication pattern, less its ROCm/HCCL alternatives.
_NCCL_KERNEL_NAME = re.compile(r"^nccl|ncclDevKernel|ncclKernel")


def kernel_kind(name: str, category: str) -> str:
    """What a GPU event of a CUDA trace does: "communication", "memory", "sync" or "compute".

    The classification of Meta's Holistic Trace Analysis (HTA: ``get_kernel_type`` in
    ``hta/utils/utils.py``, patterns in ``hta/common/types.py``): kernels named like NCCL's are
    communication; memcpy and memset events (categories "gpu_memcpy", "gpu_memset", or a name that
    starts with "Memcpy" or "Memset") are memory; every other kernel is compute. Events of category
    "cuda_sync" (a stream or device waiting) are "sync", which HTA leaves out of kernel time too.

    As in HTA, NCCL's one-rank reduction (``oneRankReduce``, world size 1 with a pre-multiplied sum
    such as AVG on floats) is compute: its name is not NCCL's.

    ``category`` is the event's "cat", one of ``GPU_EVENT_CATEGORIES``; a name is matched
    case-sensitively, as HTA does.
    """
    if category == "cuda_sync":
        return "sync"
    if category in ("gpu_memcpy", "gpu_memset"):
        return "memory"
    if category != "kernel":
        raise ValueError(f"{name!r}: {category!r} is not a GPU event category; expected one of {GPU_EVENT_CATEGORIES}")
    if _NCCL_KERNEL_NAME.search(name):
        return "communication"
    if name.startswith(("Memcpy", "Memset")):
        return "memory"
    return "compute"


class GpuEvent(NamedTuple):
    """One GPU event of a CUDA trace, on the ``perf_counter`` clock (seconds)."""

    launch_seconds: float
    """When the CPU launched it (its cuda_runtime/cuda_driver event with the same correlation id)."""
    start_seconds: float
    end_seconds: float
    name: str
    kind: str
    """``kernel_kind`` of the event."""


def gpu_events_from_trace(events: list[dict], steps: list[dict]) -> list[GpuEvent]:
    """Every GPU event of the trace whose CPU launch is in the trace, classified by ``kernel_kind``."""
    offset = trace_offset_us(events, steps)
    launch_us = {
        e["args"]["correlation"]: e["ts"]
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    gpu_events = []
    for e in events:
        correlation = e.get("args", {}).get("correlation")
        if e.get("cat") in GPU_EVENT_CATEGORIES and correlation in launch_us:
            start = (e["ts"] - offset) / 1e6
            gpu_events.append(GpuEvent(
                launch_seconds=(launch_us[correlation] - offset) / 1e6,
                start_seconds=start,
                end_seconds=start + e["dur"] / 1e6,
                name=e["name"],
                kind=kernel_kind(e["name"], e["cat"]),
            ))
    return gpu_events


def cuda_steps_from_trace(events: list[dict], steps: list[dict]) -> list[dict]:
    """Step records whose phases and collectives are GPU time, read from a CUDA trace.

    A GPU event belongs to the CPU range (phase) in which it was launched, through the launch's
    correlation id; one launched inside no phase is ignored. Each phase runs from the first to the
    last compute kernel (``kernel_kind``) launched inside it; memcpy, memset and sync events never
    count. Backward compute ends with the last compute kernel launched inside "backward".

    Communication: the NCCL kernels launched during the step, if there are any
    (``comm_source`` "nccl_kernels"); else the step's own collective records, kept as recorded
    (``comm_source`` "collective_records"). The second is the case of gloo over CUDA, which copies
    each bucket to the host, reduces it there and copies it back (only memcpys on the GPU), and of
    NCCL at world size 1. A record runs from the CPU's call to the completion of the work's future
    (gloo: once the copy back is enqueued), so it includes any wait for the GPU to produce the
    gradient. The records stay under "collective_records" in both cases. Times stay on the
    ``perf_counter`` clock.
    """
    gpu_events = gpu_events_from_trace(events, steps)
    gpu_steps = []
    for step in steps:

        def launched_in(window, kind: str) -> list[GpuEvent]:
            return [e for e in gpu_events if e.kind == kind and window[0] <= e.launch_seconds <= window[1]]

        nccl_kernels = launched_in((step["forward"][0], step["optimizer"][1]), "communication")
        if nccl_kernels:
            gpu_step = {"comm_source": COMM_FROM_NCCL_KERNELS, "collectives": [
                {"label": k.name, "size_bytes": 0, "launch_seconds": k.start_seconds, "done_seconds": k.end_seconds}
                for k in nccl_kernels
            ]}
        else:
            gpu_step = {"comm_source": COMM_FROM_COLLECTIVE_RECORDS, "collectives": list(step["collectives"])}
        gpu_step["collective_records"] = step["collectives"]
        for phase in PHASES:
            compute = launched_in(step[phase], "compute")
            # A phase that launched no compute kernel (gradient_sync of most strategies) keeps its CPU span.
            gpu_step[phase] = (
                [min(k.start_seconds for k in compute), max(k.end_seconds for k in compute)] if compute else step[phase]
            )
        # Backward's computation: the kernels launched before the engine's end-of-compute callback,
        # not those a reducer launches while it waits inside backward (gloo over CUDA copies back).
        backward_compute = launched_in((step["backward"][0], step["backward_compute_end"]), "compute")
        gpu_step["backward_compute_end"] = (
            max(k.end_seconds for k in backward_compute) if backward_compute else gpu_step["backward"][1]
        )
        gpu_steps.append(gpu_step)
    return gpu_steps


# ---------------------------------------------------------------------------------------------
# Timelines


def timeline_record(strategy: str, summary: dict, rank_records: list[dict]) -> dict:
    """What ``ddp.analysis.timeline`` draws: every rank's steps, in seconds since the earliest rank's first step."""
    origin = min(r["steps"][0]["forward"][0] for r in rank_records)

    def shift(step: dict) -> dict:
        shifted = {phase: [t - origin for t in step[phase]] for phase in PHASES}
        shifted["backward_compute_end"] = step["backward_compute_end"] - origin
        shifted["collectives"] = [
            {**c, "launch_seconds": c["launch_seconds"] - origin, "done_seconds": c["done_seconds"] - origin}
            for c in step["collectives"]
        ]
        return shifted

    keys = ("comm_seconds", "overlap_fraction", "exposed_comm_seconds", "slowest_rank", "comm_source")
    figures = {k: summary[k] for k in keys}
    return {
        "strategy": strategy,
        **figures,
        "ranks": [{"rank": r["rank"], "steps": [shift(s) for s in r["steps"]]} for r in rank_records],
    }
