"""Reading the suite's recorded steps (``ddp.bench.collectives.recording``) against the profiler's
traces, and what every reader of a trace shares: GPU events classified as Holistic Trace Analysis
classes them (``kernel_kind``), NCCL's kernels named by the collective they run
(``nccl_collective``), a trace file loaded (``load_trace``). Pure functions of step records and
trace events: no tensors, no ranks (the report and ``ddp profile``'s parent read them too).

The suite's traces carry its steps' ``forward``, ``backward``, ``gradient_sync`` and
``optimizer`` ranges, on the ``perf_counter`` clock of its step records: ``cpu_steps_from_trace``
and ``cuda_steps_from_trace`` give each step's collectives their times from them. What bounds a
step, for the suite's traces and a user's alike, is ``ddp.bench.collectives.timeline``.
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from bisect import bisect_right
from pathlib import Path
from typing import NamedTuple

from ddp.bench.config.shape import phases_of, step_span  # the step's phases, named once

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
        # The CPU's ranges only: with CUDA activity Kineto mirrors every annotation (gloo's work
        # among them) on the GPU's timeline as "gpu_user_annotation", which would count each twice
        # (seen with gloo over CUDA tensors on an H200, torch 2.11).
        return sorted(((e["ts"] - offset) / 1e6, (e["ts"] + e.get("dur", 0) - offset) / 1e6, e["name"])
                      for e in events if e.get("ph") == "X" and e.get("cat") in CPU_RANGE_CATEGORIES
                      and _is_collective(e.get("name", ""), prefix))

    calls, executions = spans("c10d::"), spans("gloo:")
    paired = len(calls) == len(executions)
    read = []
    for step in steps:
        window = step_span(step)
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


def comm_source(steps: list[dict]) -> str:
    """Where the communication times of these steps came from: a ``COMM_FROM_*`` value.

    Steps built on the CPU path carry no "comm_source": their collectives are the records.
    """
    sources = {step.get("comm_source", COMM_FROM_COLLECTIVE_RECORDS) for step in steps}
    return sources.pop() if len(sources) == 1 else COMM_FROM_MIXED


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


# NCCL's collectives, as its kernels name them (NCCL's ``src/device/generate.py``, ``all_colls``).
NCCL_COLLECTIVES = ("AllReduce", "Broadcast", "Reduce", "AllGather", "ReduceScatter", "SendRecv")
# A kernel's collective in its name: ``ncclKernel_<Coll>_<algo>_<proto>_<redop>_<type>`` before NCCL
# 2.19 (``ncclKernel_AllReduce_RING_LL_Sum_float``), ``ncclDevKernel_<Coll>[_<redop>_<type>]_<algo>_<proto>``
# since (``ncclDevKernel_AllReduce_Sum_f32_RING_LL``, ``ncclDevKernel_SendRecv``: generate.py's
# ``best_kernel``), and 2.27's symmetric-memory kernels ``ncclSymkDevKernel_<Coll>_...``. Since 2.19 a
# collective without a kernel of its own runs in ``ncclDevKernel_Generic``, whose name says none;
# ``AllGatherV`` (an all-gather of unequal parts) is an all-gather.
_NCCL_KERNEL_COLLECTIVE = re.compile(
    r"nccl(?:Symk)?(?:Dev)?Kernel_(AllReduce|Broadcast|Reduce|AllGather|ReduceScatter|SendRecv)V?(?![A-Za-z0-9])")
# PyTorch's names for a collective, without underscores, by prefix (first match): a kernel's
# "Collective name" argument (c10d's ParamCommsUtils: "allreduce", "_allgather_base", "all_to_all",
# ...) and the profiler's range around the call (ProcessGroupNCCL's profiling title: "nccl:all_reduce",
# "nccl:_reduce_scatter_base", "nccl:send 0->1", ...). NCCL runs all-to-all, gather, scatter, send and
# recv as grouped point-to-point operations: SendRecv kernels.
_COLLECTIVE_OF_OP = (("allreduce", "AllReduce"), ("allgather", "AllGather"), ("reducescatter", "ReduceScatter"),
                     ("reduce", "Reduce"), ("broadcast", "Broadcast"), ("alltoall", "SendRecv"), ("send", "SendRecv"),
                     ("recv", "SendRecv"), ("gather", "SendRecv"), ("scatter", "SendRecv"))
# Bytes per element of the kernel argument "dtype", which PyTorch writes as c10's ScalarType name
# (c10/core/ScalarType.h); a dtype not listed gives no size.
_DTYPE_BYTES = {"Bool": 1, "Byte": 1, "Char": 1, "Float8_e4m3fn": 1, "Float8_e5m2": 1, "Float8_e4m3fnuz": 1,
                "Float8_e5m2fnuz": 1, "Short": 2, "Half": 2, "BFloat16": 2, "UInt16": 2, "Int": 4, "Float": 4,
                "UInt32": 4, "ComplexHalf": 4, "Long": 8, "Double": 8, "UInt64": 8, "ComplexFloat": 8,
                "ComplexDouble": 16}


def collective_of_op(op: str) -> str | None:
    normalized = op.replace("_", "").lower()
    return next((collective for prefix, collective in _COLLECTIVE_OF_OP if normalized.startswith(prefix)), None)


def nccl_collective(kernel_name: str, kernel_args: dict | None = None, cpu_range: str | None = None) -> str | None:
    """The collective (one of ``NCCL_COLLECTIVES``) an NCCL kernel runs; None where nothing says.

    Read, in this order, from the kernel's name (NCCL's naming, both schemes); else from its
    argument "Collective name", which PyTorch's profiler copies onto the kernels of a c10d call
    (the keys of ``torch/csrc/profiler/util.h``; HTA reads the same ones: ``nccl::collective_name``
    in ``hta/configs/default_event_args.py``); else from ``cpu_range``, the name of the profiler's
    ``nccl:<op>`` range in which its launch lies (what names ``ncclDevKernel_Generic``).
    """
    found = _NCCL_KERNEL_COLLECTIVE.search(kernel_name)
    if found:
        return found.group(1)
    ops = [(kernel_args or {}).get("Collective name"), cpu_range.removeprefix("nccl:") if cpu_range else None]
    return next((collective for op in ops if op and (collective := collective_of_op(str(op)))), None)


def nccl_message_bytes(kernel_args: dict) -> int | None:
    """An NCCL kernel's input in bytes from its arguments ("In msg nelems" x the size of "dtype",
    as PyTorch's profiler writes them); None where they do not give it."""
    nelems, itemsize = kernel_args.get("In msg nelems"), _DTYPE_BYTES.get(kernel_args.get("dtype"))
    return int(nelems) * itemsize if isinstance(nelems, (int, float)) and itemsize else None


class GpuEvent(NamedTuple):
    """One GPU event of a CUDA trace, in seconds: on the ``perf_counter`` clock for the suite's
    traces, from the trace's first event for a user's (``read_trace``)."""

    launch_seconds: float
    """When the CPU launched it (its cuda_runtime/cuda_driver event with the same correlation id)."""
    start_seconds: float
    end_seconds: float
    name: str
    kind: str
    """``kernel_kind`` of the event."""
    collective: str | None = None
    """An NCCL kernel's collective (``nccl_collective``); None for any other event, or where nothing says."""
    size_bytes: int | None = None
    """An NCCL kernel's input in bytes where its arguments give it (``nccl_message_bytes``), else None."""
    thread: tuple | None = None
    """``(pid, tid)`` of the thread that launched it."""


# Categories of the CPU's ranges: operators (the autograd engine's among them) and record_function's
# annotations (ProfilerStep#N, Optimizer.step#..., nccl:<op>, the suite's phases). Kineto mirrors
# annotations on the GPU's timeline as "gpu_user_annotation": not CPU ranges.
CPU_RANGE_CATEGORIES = ("cpu_op", "user_annotation")


def _innermost_nccl_ranges(events: list[dict]):
    """A function of a launch event: the name of the innermost ``nccl:<op>`` range on its thread
    that contains it, or None. A collective's range and its kernel's launch are on the thread
    that called it (NCCL launches from the caller), so the thread is matched."""
    by_thread: dict[tuple, list[tuple[float, float, str]]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in CPU_RANGE_CATEGORIES and e.get("name", "").startswith("nccl:"):
            by_thread.setdefault((e.get("pid"), e.get("tid")), []).append((e["ts"], e["ts"] + e.get("dur", 0), e["name"]))
    ranges = {thread: sorted(mine) for thread, mine in by_thread.items()}
    starts = {thread: [start for start, _, _ in mine] for thread, mine in ranges.items()}

    def around(launch: dict) -> str | None:
        thread, t = (launch.get("pid"), launch.get("tid")), launch["ts"]
        mine = ranges.get(thread, [])
        for start, end, name in reversed(mine[:bisect_right(starts.get(thread, []), t)]):
            if t <= end:  # the latest-starting range that still runs at t is the innermost
                return name
        return None

    return around


def read_gpu_events(events: list[dict], offset_us: float) -> list[GpuEvent]:
    """Every GPU event whose CPU launch is in the trace, classified, times in seconds of trace
    time minus ``offset_us``. Launches are the "cuda_runtime" (cudaLaunchKernel,
    cudaLaunchKernelExC: NCCL's, cudaMemcpyAsync, ...) and "cuda_driver" (cuLaunchKernelEx) events,
    paired with their GPU event by correlation id, as Kineto writes them."""
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    nccl_range_around = _innermost_nccl_ranges(events)
    gpu_events = []
    for e in events:
        correlation = e.get("args", {}).get("correlation")
        if e.get("cat") in GPU_EVENT_CATEGORIES and correlation in launches:
            launch = launches[correlation]
            kind = kernel_kind(e["name"], e["cat"])
            collective = size_bytes = None
            if kind == "communication":
                collective = nccl_collective(e["name"], e["args"], nccl_range_around(launch))
                size_bytes = nccl_message_bytes(e["args"])
            start = (e["ts"] - offset_us) / 1e6
            gpu_events.append(GpuEvent(
                launch_seconds=(launch["ts"] - offset_us) / 1e6,
                start_seconds=start,
                end_seconds=start + e.get("dur", 0) / 1e6,
                name=e["name"],
                kind=kind,
                collective=collective,
                size_bytes=size_bytes,
                thread=(launch.get("pid"), launch.get("tid")),
            ))
    return gpu_events


def gpu_events_from_trace(events: list[dict], steps: list[dict]) -> list[GpuEvent]:
    """Every GPU event of the suite's trace whose CPU launch is in the trace, classified by
    ``kernel_kind`` (NCCL's kernels by ``nccl_collective`` too), on the steps' ``perf_counter`` clock."""
    return read_gpu_events(events, trace_offset_us(events, steps))


def _collective_label(collective: str | None, place: int) -> str:
    """A kernel named by its collective and its place among its step's NCCL kernels: ``broadcast0``,
    ``allreduce3`` (c10d's names for them, as ``cpu_steps_from_trace`` gives them); ``collective{i}``
    where nothing says which collective it runs."""
    return f"{(collective or 'collective').lower()}{place}"


def _kernel_labels(kernels: list[GpuEvent], optimizer_start: float,
                   bucket_sizes_bytes: list[int] | None) -> list[tuple[str, int]]:
    """``(label, bytes)`` of a step's NCCL kernels, in launch order. The plan's buckets are the
    all-reduces launched before the optimizer, where the plan has as many (``_buckets_at``);
    every other kernel is named by its collective and place, with its bytes from its arguments
    where they give them. PyTorch's DDP broadcasts the module's buffers in every forward
    (``broadcast_buffers=True``: an NCCL Broadcast kernel before the buckets), and an optimizer may
    gather parameters: neither is a bucket, and neither must stop the buckets from being named."""
    gradients = [i for i, k in enumerate(kernels) if k.collective == "AllReduce" and k.launch_seconds < optimizer_start]
    buckets = _buckets_at(gradients, bucket_sizes_bytes)
    return [buckets.get(i, (_collective_label(k.collective, i), k.size_bytes or 0)) for i, k in enumerate(kernels)]


def _named_kernels(kernels: list[GpuEvent], step: dict, bucket_sizes_bytes: list[int] | None) -> list[dict]:
    """A step's NCCL kernels as collectives, in launch order: named by the step's records where
    there is one per kernel; else by ``_kernel_labels`` (the plan's buckets, the others by
    collective and place)."""
    records = step["collectives"]
    if len(records) != len(kernels):
        labels = _kernel_labels(kernels, step["optimizer"][0], bucket_sizes_bytes)
        records = [{"label": label, "size_bytes": size_bytes} for label, size_bytes in labels]
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

        nccl_kernels = sorted(launched_in(step_span(step), "communication"),
                              key=lambda k: k.launch_seconds)
        if nccl_kernels:
            gpu_step = {"comm_source": COMM_FROM_NCCL_KERNELS,
                        "collectives": _named_kernels(nccl_kernels, step, bucket_sizes_bytes)}
        else:
            gpu_step = {"comm_source": COMM_FROM_COLLECTIVE_RECORDS, "collectives": list(step["collectives"])}
        gpu_step["collective_records"] = step["collectives"]
        phases = phases_of(step)
        gpu_step.update({key: value for key, value in step.items() if key not in gpu_step and key not in phases})
        for phase in phases:
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


# ---------------------------------------------------------------------------------------------
# A user's own trace (ddp trace)


class TraceFileError(Exception):
    """A file that is not a PyTorch profiler trace; the message names it and says what to give."""


WHAT_TO_GIVE = "give one rank's trace as torch.profiler writes it (export_chrome_trace or tensorboard_trace_handler)"


def load_trace(path: Path) -> dict:
    """A PyTorch profiler (Chrome JSON) trace, gzipped or not (told by its first bytes, not its
    name), as its JSON object; ``TraceFileError`` if the file is missing or is not one."""
    if not path.exists():
        raise TraceFileError(f"{path}: no such file")
    if path.is_dir():
        raise TraceFileError(f"{path} is a folder: {WHAT_TO_GIVE}")
    raw = path.read_bytes()
    try:
        trace = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
    except (OSError, EOFError, zlib.error, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise TraceFileError(f"{path} is not JSON ({error}): {WHAT_TO_GIVE}") from None
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise TraceFileError(f"{path} has no traceEvents, so it is not a profiler trace: {WHAT_TO_GIVE}")
    return trace


def trace_header(trace: dict) -> dict:
    """Who recorded a trace, as far as it says: world size, rank, backend and NCCL version
    (``distributedInfo``), and the GPU its kernels ran on (``deviceProperties``); None where not said."""
    info = trace.get("distributedInfo") or {}
    names = {d.get("id"): d.get("name") for d in trace.get("deviceProperties") or [] if isinstance(d, dict)}
    device = next((e["args"].get("device") for e in trace["traceEvents"]
                   if e.get("cat") == "kernel" and isinstance(e.get("args"), dict)), None)
    gpu = names.get(device, next(iter(names.values()), None))
    return {"world_size": info.get("world_size"), "rank": info.get("rank"), "backend": info.get("backend"),
            "nccl_version": info.get("nccl_version"), "gpu": gpu}
