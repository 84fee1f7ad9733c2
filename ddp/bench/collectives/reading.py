"""What every reader of a PyTorch profiler trace shares: GPU events classified as Holistic Trace
Analysis classes them (``kernel_kind``), NCCL's kernels named by the collective they run
(``nccl_collective``) with their bytes, a collective's bus bandwidth factor, where a step's
communication times come from (``COMM_FROM_*``), a trace file loaded (``load_trace``). Pure
functions of trace events: no tensors, no ranks.

The one reader of a trace, for the suite's traced steps, ``ddp profile`` and ``ddp trace`` alike,
is ``ddp.bench.collectives.timeline``.
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from bisect import bisect_right
from pathlib import Path
from typing import NamedTuple

from ddp.bench.config.shape import RecordedStep

# Where a step's communication intervals come from (the "comm_source" of steps and records):
COMM_FROM_NCCL_KERNELS = "nccl_kernels"  # GPU time of the NCCL kernels in a CUDA trace
COMM_FROM_COLLECTIVE_RECORDS = "collective_records"  # ddp.strategies.tracing's stamps, launch to completion
COMM_FROM_PROFILER = "profiler"  # c10d's calls paired with gloo's work in the profiler's record
COMM_FROM_GLOO_RANGES = "gloo_ranges"  # a partition's: gloo's work on the host (gloo over CUDA tensors)
COMM_NONE = "none"  # a partition's: the step communicated nothing
COMM_FROM_MIXED = "mixed"  # steps that did not all use the same source


def comm_source(steps: list[RecordedStep]) -> str:
    """Where the communication times of these steps came from: a ``COMM_FROM_*`` value (a step
    without one holds the strategy's own records)."""
    sources = {step.comm_source or COMM_FROM_COLLECTIVE_RECORDS for step in steps}
    return sources.pop() if len(sources) == 1 else COMM_FROM_MIXED


def trace_offset_us(events: list[dict], steps: list[RecordedStep]) -> float:
    """Trace time (µs) minus ``perf_counter`` time (µs), from the first profiled "forward" range,
    whose start was stamped on both clocks within microseconds."""
    forward = min((e for e in events if e.get("name") == "forward" and e.get("cat") == "user_annotation"), key=lambda e: e["ts"])
    return forward["ts"] - steps[0].phases["forward"][0] * 1e6


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
    """When the CPU launched it (its cuda_runtime/cuda_driver event with the same correlation id);
    ``LAUNCHED_BEFORE_THE_TRACE`` where the trace holds no launch (the profiler started while it
    was queued): no step owns it and the GPU did not wait on the host for it."""
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
    """``(pid, tid)`` of the thread that launched it; None where the launch is not in the trace."""
    nccl_range: str | None = None
    """An NCCL kernel's innermost ``nccl:<op>`` range around its launch on its thread, else None."""


LAUNCHED_BEFORE_THE_TRACE = float("-inf")


# Categories of the CPU's ranges: operators (the autograd engine's among them) and record_function's
# annotations (ProfilerStep#N, Optimizer.step#..., nccl:<op>, the suite's phases). Kineto mirrors
# annotations on the GPU's timeline as "gpu_user_annotation": not CPU ranges.
CPU_RANGE_CATEGORIES = ("cpu_op", "user_annotation")


def is_collective_range(name: str, prefix: str) -> bool:
    """Whether a CPU range named ``name`` is one collective's (``nccl:all_reduce``, ``gloo:broadcast``,
    ``c10d::allreduce_``): its ``prefix``, and neither a barrier nor a coalesced group's range."""
    return name.startswith(prefix) and "barrier" not in name and "coalesced" not in name


def _innermost_nccl_ranges(events: list[dict]):
    """A function of a launch event: the name of the innermost ``nccl:<op>`` range on its thread
    that contains it, or None. A collective's range and its kernel's launch are on the thread
    that called it (NCCL launches from the caller), so the thread is matched."""
    by_thread: dict[tuple, list[tuple[float, float, str]]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in CPU_RANGE_CATEGORIES and is_collective_range(e.get("name", ""), "nccl:"):
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
    """Every GPU event of the trace, classified, times in seconds of trace time minus
    ``offset_us``. Launches are the "cuda_runtime" (cudaLaunchKernel, cudaLaunchKernelExC: NCCL's,
    cudaMemcpyAsync, ...) and "cuda_driver" (cuLaunchKernelEx) events, paired with their GPU event
    by correlation id, as Kineto writes them; an event whose launch the trace does not hold keeps
    ``LAUNCHED_BEFORE_THE_TRACE`` (it still runs, and covers what it runs beside)."""
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    nccl_range_around = _innermost_nccl_ranges(events)
    gpu_events = []
    for e in events:
        if e.get("cat") not in GPU_EVENT_CATEGORIES or "ts" not in e:
            continue
        launch = launches.get((e.get("args") or {}).get("correlation"))
        kind = kernel_kind(e["name"], e["cat"])
        collective = size_bytes = nccl_range = None
        if kind == "communication":
            nccl_range = nccl_range_around(launch) if launch else None
            collective = nccl_collective(e["name"], e.get("args"), nccl_range)
            size_bytes = nccl_message_bytes(e.get("args") or {})
        start = (e["ts"] - offset_us) / 1e6
        gpu_events.append(GpuEvent(
            launch_seconds=(launch["ts"] - offset_us) / 1e6 if launch else LAUNCHED_BEFORE_THE_TRACE,
            start_seconds=start,
            end_seconds=start + e.get("dur", 0) / 1e6,
            name=e["name"],
            kind=kind,
            collective=collective,
            size_bytes=size_bytes,
            thread=(launch.get("pid"), launch.get("tid")) if launch else None,
            nccl_range=nccl_range,
        ))
    return gpu_events


# Bus bandwidth (nccl-tests' doc/PERFORMANCE.md): what a collective of S bytes moves over the
# slowest link of a ring of n ranks, as a multiple of S / time (algbw). S is the buffer nccl-tests
# names: an all-reduce's buffer, an all-gather's output and a reduce-scatter's input (n times the
# other side), a broadcast's or reduce's buffer.
def bus_factor(collective: str, world_size: int) -> float | None:
    """busbw / algbw of ``collective`` (one of ``NCCL_COLLECTIVES``) on ``world_size`` ranks: 2(n-1)/n
    for an all-reduce, (n-1)/n for an all-gather and a reduce-scatter, 1 for a broadcast and a
    reduce; None for point-to-point (SendRecv: its bytes per peer are not in the kernel's name)."""
    n = world_size
    return {"AllReduce": 2 * (n - 1) / n, "AllGather": (n - 1) / n, "ReduceScatter": (n - 1) / n,
            "Broadcast": 1.0, "Reduce": 1.0}.get(collective)


def bus_bandwidth(collective: str, input_bytes: int, seconds: float, world_size: int) -> float | None:
    """Bytes per second of bus bandwidth of one collective whose rank gave ``input_bytes`` (an NCCL
    kernel's "In msg nelems" x its dtype's size) and ran ``seconds``: S / seconds x ``bus_factor``,
    S the input except for an all-gather, whose buffer is n inputs. None where the factor is none."""
    factor = bus_factor(collective, world_size)
    if factor is None or seconds <= 0:
        return None
    size = input_bytes * world_size if collective == "AllGather" else input_bytes
    return size / seconds * factor


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
