"""Reading recorded steps (``ddp.bench.step_trace``) and the profiler's traces: where each
collective's times come from, and each collective's share of a step's exposed communication. Pure
functions of step records and trace events: no tensors, no ranks (the report and ``ddp profile``'s
parent read them too)."""

from __future__ import annotations

import re
import statistics
from typing import NamedTuple

from ddp.bench.records import PHASES  # the step's phases, named once
from ddp.strategies.tracing import USED_MASK_LABEL

# Where a step's communication intervals come from (the "comm_source" of steps and records):
COMM_FROM_NCCL_KERNELS = "nccl_kernels"  # GPU time of the NCCL kernels in a CUDA trace
COMM_FROM_COLLECTIVE_RECORDS = "collective_records"  # ddp.strategies.tracing's stamps
COMM_FROM_PROFILER = "profiler"  # c10d's calls and gloo's work in the profiler's record
COMM_FROM_MIXED = "mixed"  # steps that did not all use the same source


def _is_collective(name: str, prefix: str) -> bool:
    return name.startswith(prefix) and "barrier" not in name and "coalesced" not in name


def _buckets_at(positions: list[int], bucket_sizes_bytes: list[int] | None) -> dict[int, tuple[str, int]]:
    """The strategy's buckets, ``(label, bytes)`` by place among a step's collectives, where the
    collectives at ``positions`` are as many as its plan has buckets; else none."""
    if bucket_sizes_bytes is None or len(bucket_sizes_bytes) != len(positions):
        return {}
    return {i: (f"bucket{b}", bucket_sizes_bytes[b]) for b, i in enumerate(positions)}


def cpu_steps_from_trace(events: list[dict], steps: list[dict], bucket_sizes_bytes: list[int] | None) -> list[dict]:
    """The step records with their ``collectives`` read from a CPU profiler trace (gloo): c10d's
    calls (``c10d::allreduce_``, ...) are the launches, gloo's executions (``gloo:all_reduce``, ...,
    on gloo's threads, in the order they were queued) the completions, paired in order. A step whose
    collectives cannot be paired keeps none (``comm_source`` "profiler", with ``unpaired``)."""
    offset = trace_offset_us(events, steps)

    def spans(prefix: str) -> list[tuple[float, float, str]]:
        return sorted(((e["ts"] - offset) / 1e6, (e["ts"] + e.get("dur", 0) - offset) / 1e6, e["name"])
                      for e in events if e.get("ph") == "X" and _is_collective(e.get("name", ""), prefix))

    calls, executions = spans("c10d::"), spans("gloo:")
    paired = len(calls) == len(executions)
    read = []
    for step in steps:
        window = (step["forward"][0], step["optimizer"][1])
        mine = [(call[0], execution[1], call[2].removeprefix("c10d::").strip("_"))
                for call, execution in zip(calls, executions) if window[0] <= call[0] <= window[1]]
        # All-reduces are the buckets where there are as many as the plan has (DDP's forward may
        # also broadcast the module's buffers); any other collective is named by its operator.
        buckets = _buckets_at([i for i, (*_, op) in enumerate(mine) if op == "allreduce"], bucket_sizes_bytes)
        collectives = [
            {"label": buckets[i][0] if i in buckets else f"{op}{i}", "size_bytes": buckets[i][1] if i in buckets else 0,
             "ready_seconds": launch, "launch_seconds": launch, "done_seconds": done}
            for i, (launch, done, op) in enumerate(mine)
        ] if paired else []
        read.append({**step, "collectives": collectives, "comm_source": COMM_FROM_PROFILER, "unpaired": not paired})
    return read


def tail_of(done_seconds: dict[str, list[float]]) -> str | None:
    """The tail: among collectives by label, each with its completion times over steps (from
    backward's end), the gradient collective with the latest median completion (the used mask
    carries no gradient); None if there is none."""
    gradients = {label: times for label, times in done_seconds.items() if label != USED_MASK_LABEL and times}
    return max(gradients, key=lambda label: statistics.median(gradients[label]), default=None)


def comm_source(steps: list[dict]) -> str:
    """Where the communication times of these steps came from: a ``COMM_FROM_*`` value.

    Steps built on the CPU path carry no "comm_source": their collectives are the records.
    """
    sources = {step.get("comm_source", COMM_FROM_COLLECTIVE_RECORDS) for step in steps}
    return sources.pop() if len(sources) == 1 else COMM_FROM_MIXED


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
        shares.append({**c, "exposed_seconds": max(0.0, done - waited_until)})
        waited_until = max(waited_until, done)
    return shares


def trace_offset_us(events: list[dict], steps: list[dict]) -> float:
    """Trace time (µs) minus ``perf_counter`` time (µs), from the first profiled "forward" range,
    whose start was stamped on both clocks within microseconds."""
    forward = min((e for e in events if e.get("name") == "forward" and e.get("cat") == "user_annotation"), key=lambda e: e["ts"])
    return forward["ts"] - steps[0]["forward"][0] * 1e6


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


def _named_kernels(kernels: list[GpuEvent], step: dict, bucket_sizes_bytes: list[int] | None) -> list[dict]:
    """A step's NCCL kernels as collectives, in launch order: named by the step's records where
    there is one per kernel; else those launched before the optimizer are the buckets where the
    strategy's plan has as many; any other is ``collective{i}``."""
    records = step["collectives"]
    if len(records) != len(kernels):
        buckets = _buckets_at([i for i, k in enumerate(kernels) if k.launch_seconds < step["optimizer"][0]], bucket_sizes_bytes)
        records = [dict(zip(("label", "size_bytes"), buckets.get(i, (f"collective{i}", 0)))) for i in range(len(kernels))]
    return [{"label": r["label"], "size_bytes": r["size_bytes"], "ready_seconds": None, "launch_seconds": k.start_seconds,
             "done_seconds": k.end_seconds} for k, r in zip(kernels, records)]


def cuda_steps_from_trace(events: list[dict], steps: list[dict], bucket_sizes_bytes: list[int] | None = None) -> list[dict]:
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

        nccl_kernels = sorted(launched_in((step["forward"][0], step["optimizer"][1]), "communication"))
        if nccl_kernels:
            gpu_step = {"comm_source": COMM_FROM_NCCL_KERNELS,
                        "collectives": _named_kernels(nccl_kernels, step, bucket_sizes_bytes)}
        else:
            gpu_step = {"comm_source": COMM_FROM_COLLECTIVE_RECORDS, "collectives": list(step["collectives"])}
        gpu_step["collective_records"] = step["collectives"]
        gpu_step.update({key: value for key, value in step.items() if key not in gpu_step and key not in PHASES})
        for phase in PHASES:
            compute = launched_in(step[phase], "compute")
            # A phase that launched no compute kernel (gradient_sync of most strategies) keeps its CPU span.
            gpu_step[phase] = (
                [min(k.start_seconds for k in compute), max(k.end_seconds for k in compute)] if compute else step[phase]
            )
        # Backward's computation: the kernels launched before the engine's end-of-compute callback,
        # not those a reducer launches while it waits inside backward (gloo over CUDA copies back).
        backward_compute = launched_in((step["backward"][0], step["backward_compute_end"]), "compute")
        gpu_step["backward_compute_end"] = (  # replaces the CPU's stamp kept above
            max(k.end_seconds for k in backward_compute) if backward_compute else gpu_step["backward"][1]
        )
        gpu_steps.append(gpu_step)
    return gpu_steps
