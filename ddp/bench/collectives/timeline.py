"""What bounds a step: one reading of a GPU timeline, the same for a user's trace (``ddp trace``)
and for the suite's traced steps on CUDA, and its twin on CPU from what the suite records.

**The partition (a fact).** A step owns the GPU events whose CPU launch (correlation id) lies in
its window of the CPU clock (its ``ProfilerStep#N`` range; a suite step's phases). Its window W
runs from its first own GPU event's start to its last one's end. Every instant of W, over every
stream at once (kernels that overlap count once), is classed once, first class that applies:

1. ``gpu_compute_seconds``: one of the step's own compute kernels runs;
2. ``other_steps_seconds`` (added to 4's): a compute kernel of another step, or of none
   (launched before the trace), runs;
3. ``exposed_comm_seconds``: one of the step's NCCL kernels runs and no compute kernel of any step;
4. ``other_steps_seconds``: another step's or an unowned NCCL kernel runs, alone;
5. ``copy_only_seconds``: only copies (memcpy, memset) run;
6. ``idle_seconds``: nothing runs; its part ``host_wait_seconds`` is each gap whose next event was
   launched by the host after the gap began (the GPU waited for a launch).

The five add up to W (``window_seconds``). Also ``comm_seconds``, the union of the step's NCCL
kernels, and ``overlapped_comm_seconds``, its part beside a compute kernel of any step
(= comm - exposed). Kernels are classed as Holistic Trace Analysis classes them
(``ddp.bench.collectives.reading.kernel_kind``). Each of the step's NCCL kernels is a collective
with its own share: instants where several run are split equally among them, so the shares add up
to the step's figures; its phase is where its launch lies (``phase_of``).

Where the trace has no NCCL kernel but gloo ran (gloo over CUDA tensors reduces on the host),
communication is gloo's CPU ranges (``COMM_FROM_GLOO_RANGES``), placed on the same clock, each
owned by the step that launched it (its ``c10d::`` call).

**One reader.** ``read_steps`` is the only reader of a trace's events: ``ddp trace``
(``read_trace``), ``ddp profile`` and the suite's traced steps (``read_recorded``, which takes the
recorded steps' GPU phases and collectives from the same reading) all go through it. Every
collective is named one way (``collective_label``).

**Inferences**, each computed from the facts by its own function with its rule (``tail``:
``TAIL_RULE``; ``bound_by``: ``BOUND_BY_RULE``): the tail, and what bounds the step; over several
steps, ``medians`` and ``usual_tail``, the one aggregation of the suite and ``ddp profile``.

**On CPU with gloo** (``cpu_partition``) nothing runs on a GPU: compute is the training thread's
phases (forward, backward until its last gradient, optimizer, accumulation), communication each
collective's launch to completion, idle the rest; no copies, no host wait, so ``bound_by`` is
``compute`` or ``communication``.

Definitions beside HTA's and nsys': docs/profiling.md.
"""

from __future__ import annotations

import re
import statistics
from bisect import bisect_left, bisect_right
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import replace
from typing import NamedTuple

from ddp.bench.collectives.reading import (
    COMM_FROM_COLLECTIVE_RECORDS,
    COMM_FROM_GLOO_RANGES,
    COMM_FROM_NCCL_KERNELS,
    COMM_FROM_PROFILER,
    COMM_NONE,
    CPU_RANGE_CATEGORIES,
    GpuEvent,
    bus_bandwidth,
    collective_of_op,
    is_collective_range,
    read_gpu_events,
    trace_header,
    trace_offset_us,
)
from ddp.bench.config.shape import ACCUMULATE, RecordedStep

Interval = tuple[float, float]

# The parts of W, in the order they are classed (module docstring); they add up to W.
PARTS = ("gpu_compute_seconds", "other_steps_seconds", "exposed_comm_seconds", "copy_only_seconds", "idle_seconds")
# Every figure of a step's partition, medians of which a suite's record keeps.
FIGURES = ("window_seconds", *PARTS, "host_wait_seconds", "comm_seconds", "overlapped_comm_seconds")

BOUND_BY = ("host", "compute", "communication", "copies")
HOST_BOUND_SHARE = 0.30
BOUND_BY_RULE = (f"host when the GPU waits on the host at least {HOST_BOUND_SHARE:.0%} of the window "
                 "(host_wait_seconds >= 0.3 x window_seconds); else whichever of the step's compute, its "
                 "communication alone and copies alone holds the most of the window")
EXPOSED_RESOLUTION_SECONDS = 1e-6
"""Exposed time below this is none: the interval arithmetic's float noise (a collective "exposed"
1.1e-16 s, v100_ws2_rank1_alltoall's steps 1013 and 1014), far below a trace's 1 us timestamps."""
TAIL_RULE = ("among the collectives holding at least 1 us of exposed time that started before the optimizer's first "
             "compute kernel (or the window's end where no optimizer range is found), the one that ended last, an end "
             "after that kernel's start counted at it")

# The phases a collective is placed in (``StepPlaces.phase_of``).
PHASES = ("forward", "backward", "accumulate", "gradient_sync", "optimizer", "other")


# ---------------------------------------------------------------------------------------------
# Interval arithmetic over sorted, disjoint intervals


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering exactly the given ones; empty intervals vanish."""
    merged: list[list[float]] = []
    for start, end in sorted((s, e) for s, e in intervals if e > s):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def length(intervals: Iterable[Interval]) -> float:
    """Total length of disjoint intervals."""
    return sum(e - s for s, e in intervals)


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """The parts of disjoint sorted ``a`` that lie in disjoint sorted ``b``."""
    out, j = [], 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            lo, hi = max(s, b[k][0]), min(e, b[k][1])
            if hi > lo:
                out.append((lo, hi))
            k += 1
    return out


def subtract(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """The parts of disjoint sorted ``a`` outside disjoint sorted ``b``."""
    out, j = [], 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        k, cursor = j, s
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cursor:
                out.append((cursor, b[k][0]))
            cursor = max(cursor, b[k][1])
            k += 1
        if cursor < e:
            out.append((cursor, e))
    return out


class _Cover:
    """Disjoint sorted intervals, asked how much of ``[a, b]`` they cover, in O(log n)."""

    def __init__(self, intervals: list[Interval]) -> None:
        self.starts = [s for s, _ in intervals]
        self.ends = [e for _, e in intervals]
        self.before = [0.0]
        for s, e in intervals:
            self.before.append(self.before[-1] + e - s)

    def within(self, a: float, b: float) -> float:
        lo, hi = bisect_right(self.ends, a), bisect_left(self.starts, b)
        if hi <= lo:
            return 0.0
        covered = self.before[hi] - self.before[lo]
        covered -= max(0.0, a - self.starts[lo])  # the first interval may start before a
        covered -= max(0.0, self.ends[hi - 1] - b)  # and the last end after b
        return covered


# ---------------------------------------------------------------------------------------------
# The partition of one step's window


class Comm(NamedTuple):
    """One communication interval of a step: an NCCL kernel, or a gloo range on the host."""

    start: float
    end: float
    name: str
    """Its label: its collective and place among the step's (``collective_label``: ``allreduce3``)."""
    collective: str | None
    cpu_collective: str | None
    """The CPU range's collective (``all_to_all``) where it names another than the kernel, else None."""
    phase: str
    range: str | None
    """For phase ``other``: the innermost CPU range its launch lies in."""
    size_bytes: int | None = None
    launch: float | None = None
    """When the host launched it (an NCCL kernel's launch, gloo's ``c10d::`` call), None where unknown."""


def split_shares(comms: list[Comm], compute: list[Interval]) -> list[tuple[float, float]]:
    """``(overlapped, exposed)`` seconds of each of ``comms``: each instant a collective runs is
    overlapped where a compute kernel runs (``compute``, disjoint sorted) and exposed where none
    does, and is split equally among the collectives that run at that instant."""
    shares = [[0.0, 0.0] for _ in comms]
    cover = _Cover(compute)
    bounds = sorted({t for c in comms for t in (c.start, c.end)})
    for a, b in zip(bounds, bounds[1:]):
        running = [i for i, c in enumerate(comms) if c.start <= a and c.end >= b and c.end > c.start]
        if not running:
            continue
        overlapped = min(b - a, cover.within(a, b))
        exposed = max(0.0, (b - a) - overlapped)  # not -0.0 where float arithmetic says "all of it"
        for i in running:
            shares[i][0] += overlapped / len(running)
            shares[i][1] += exposed / len(running)
    return [(o, e) for o, e in shares]


def bound_by(figures: dict) -> str:
    """What bounds a step, by ``BOUND_BY_RULE``."""
    window = figures["window_seconds"]
    if window > 0 and figures["host_wait_seconds"] >= HOST_BOUND_SHARE * window:
        return "host"
    held = {"compute": figures["gpu_compute_seconds"], "communication": figures["exposed_comm_seconds"],
            "copies": figures["copy_only_seconds"]}
    return max(held, key=held.get)


def partition(window: Interval, own_compute: list[Interval], all_compute: list[Interval], own_comm: list[Comm],
              all_comm: list[Interval], copies: list[Interval], host_waits: list[Interval]) -> dict:
    """The figures of one step (module docstring) from its events' intervals, times in any unit:
    its own compute and communication, every compute and communication interval of the trace
    (its own among them), every copy, and ``host_waits``, the gaps in which the GPU waited for a
    launch (``idle_gaps``), whose part that nothing ran in is ``host_wait_seconds``."""
    w = [window] if window[1] > window[0] else []
    mine = intersect(union(own_compute), w)
    compute_all = union([*own_compute, *all_compute])
    comm_mine = union((c.start, c.end) for c in own_comm)
    comm_all = union([*comm_mine, *all_comm])
    busy = union([*compute_all, *comm_all, *copies])
    idle = subtract(w, busy)
    figures = {
        "window_seconds": length(w),
        "gpu_compute_seconds": length(mine),
        "other_steps_seconds": length(subtract(intersect(compute_all, w), mine))
        + length(intersect(subtract(subtract(comm_all, comm_mine), compute_all), w)),
        "exposed_comm_seconds": length(intersect(subtract(comm_mine, compute_all), w)),
        "copy_only_seconds": length(intersect(subtract(subtract(union(copies), compute_all), comm_all), w)),
        "idle_seconds": length(idle),
        "host_wait_seconds": length(intersect(idle, union(host_waits))),
        "comm_seconds": length(comm_mine),
        "overlapped_comm_seconds": length(intersect(comm_mine, compute_all)),
    }
    return figures


def idle_gaps(events: list[tuple[float, float, float]]) -> list[Interval]:
    """The gaps in the union of GPU events ``(start, end, launch)`` after which the GPU waited on the
    host: the first event to start at the gap's end was launched after the gap began (HTA's "host
    wait", over every stream at once rather than per stream)."""
    by_start = sorted(events)
    gaps, reach = [], None
    for i, (start, end, _) in enumerate(by_start):
        if reach is not None and start > reach:
            first_launch, j = by_start[i][2], i  # the earliest launch among the events that start here
            while j < len(by_start) and by_start[j][0] == start:
                first_launch, j = min(first_launch, by_start[j][2]), j + 1
            if first_launch > reach:
                gaps.append((reach, start))
        reach = end if reach is None else max(reach, end)
    return gaps


def collective_rows(comms: list[Comm], compute_all: list[Interval], origin: float) -> tuple[list[dict], dict]:
    """Each communication interval as a row of the step's ``collectives`` (times from ``origin``)
    with its overlapped and exposed shares (``split_shares``), and the sums per phase."""
    shares = split_shares(comms, compute_all)
    rows = [{"name": c.name, "label": c.name, "collective": c.collective, "cpu_collective": c.cpu_collective, "phase": c.phase,
             "range": c.range, "size_bytes": c.size_bytes, "start_seconds": c.start - origin,
             "end_seconds": c.end - origin, "overlapped_seconds": overlapped, "exposed_seconds": exposed}
            for c, (overlapped, exposed) in zip(comms, shares)]
    phases: dict[str, dict] = {}
    for row in rows:
        sums = phases.setdefault(row["phase"], {"collectives": 0, "exposed_seconds": 0.0, "overlapped_seconds": 0.0})
        sums["collectives"] += 1
        sums["exposed_seconds"] += row["exposed_seconds"]
        sums["overlapped_seconds"] += row["overlapped_seconds"]
    return rows, phases


def tail(comms: list[Comm], rows: list[dict], optimizer_start: float) -> str | None:
    """The name of the step's tail (``TAIL_RULE``) among ``comms`` and their ``rows``; None if none."""
    # A collective the optimizer's first kernel waited for ends before it on a GPU; on the CPU its
    # completion is stamped by another thread, possibly just after the optimizer began: counted at it.
    waited = [(c, row) for c, row in zip(comms, rows)
              if row["exposed_seconds"] >= EXPOSED_RESOLUTION_SECONDS and c.start < optimizer_start]
    return max(waited, key=lambda pair: (min(pair[0].end, optimizer_start), pair[0].end))[1]["name"] if waited else None


# ---------------------------------------------------------------------------------------------
# A trace's CPU ranges: where a launch lies


class _Ranges:
    """CPU ranges on one thread, asked which contain an instant. A thread's ranges nest (a
    profiler's ranges open and close as a stack), so each has a parent: the last range that
    started before it and had not ended; the ranges that contain an instant are the last that
    started before it and its parents, those of them that still run."""

    def __init__(self, spans: list[tuple[float, float, str]]) -> None:
        self.spans = sorted(spans, key=lambda span: (span[0], -span[1]))
        self.starts = [s for s, _, _ in self.spans]
        self.parents, stack = [], []
        for i, (start, _, _) in enumerate(self.spans):
            while stack and self.spans[stack[-1]][1] < start:
                stack.pop()
            self.parents.append(stack[-1] if stack else -1)
            stack.append(i)

    def containing(self, t: float) -> list[str]:
        """The names of the ranges that contain ``t``, outermost first."""
        names = []
        i = bisect_right(self.starts, t) - 1
        while i >= 0:
            if self.spans[i][1] >= t:
                names.append(self.spans[i][2])
            i = self.parents[i]
        return names[::-1]


def _is_backward(name: str) -> bool:
    # The autograd engine runs every backward function in an evaluate_function range; a compiled
    # backward runs as an autograd node named ...Backward (AOTAutograd's CompiledFunctionBackward)
    # or under compiled autograd's own range; the suite's phase is "backward".
    return (name.startswith("autograd::engine::evaluate_function") or "CompiledFunctionBackward" in name
            or name.startswith("compiled_autograd") or name == "backward")


def _is_optimizer(name: str) -> bool:
    return name.startswith("Optimizer.step#") or name == "optimizer"


_COLLECTIVE_RANGES = ("nccl:", "c10d::", "record_param_comms", "gloo:")


class _Places:
    """Where a launch lies among a trace's CPU ranges, by thread (``phase_of``)."""

    def __init__(self, cpu: list[dict], to_seconds) -> None:
        by_thread: dict[tuple, list] = {}
        for e in cpu:
            start, end = to_seconds(e["ts"]), to_seconds(e["ts"] + e.get("dur", 0))
            by_thread.setdefault((e.get("pid"), e.get("tid")), []).append((start, end, e.get("name", "")))
        self.threads = {thread: _Ranges(spans) for thread, spans in by_thread.items()}
        # Each thread's backward ranges, for a launch on the engine's thread between them (a
        # reducer's callback at the end of backward lies in no evaluate_function range).
        self.backward = {thread: [(s, e) for s, e, name in r.spans if _is_backward(name)] for thread, r in self.threads.items()}

    def names_at(self, thread, t: float) -> list[str]:
        ranges = self.threads.get(thread)
        return ranges.containing(t) if ranges else []

    def step(self, window: Interval, main_thread) -> StepPlaces:
        return StepPlaces(self, window, main_thread)


class StepPlaces:
    """The places of one step's launches (``phase_of``)."""

    def __init__(self, places: _Places, window: Interval, main_thread) -> None:
        self.places, self.main_thread = places, main_thread
        self.backward_span = {}
        for thread, spans in places.backward.items():
            mine = [(s, e) for s, e in spans if window[0] <= s <= window[1]]
            if mine:
                self.backward_span[thread] = (mine[0][0], max(e for _, e in mine))
        self.first_backward = min((s for s, _ in self.backward_span.values()), default=float("inf"))

    def phase_of(self, thread, t: float) -> tuple[str, str | None]:
        """``(phase, range)`` of a launch on ``thread`` at ``t``, first that applies: ``optimizer``
        inside ``Optimizer.step#`` (the suite's ``optimizer``); the suite's ``accumulate`` and
        ``gradient_sync``; ``backward`` inside the autograd engine, a compiled backward (the suite's
        ``backward``) or on a thread between its backward ranges of this step; ``forward`` on the
        step's main thread before its first backward range (the suite's ``forward``); else
        ``other``, with the innermost range that is not the collective's own."""
        names = self.places.names_at(thread, t)
        if any(_is_optimizer(name) for name in names):
            return "optimizer", None
        for phase in (ACCUMULATE, "gradient_sync"):
            if phase in names:
                return phase, None
        span = self.backward_span.get(thread)
        if any(_is_backward(name) for name in names) or (span and span[0] <= t <= span[1]):
            return "backward", None
        if "forward" in names or (thread == self.main_thread and t < self.first_backward):
            return "forward", None
        inner = [name for name in names if not name.startswith(_COLLECTIVE_RANGES) and not re.fullmatch(r"ProfilerStep#\d+", name)]
        return "other", inner[-1] if inner else None


# ---------------------------------------------------------------------------------------------
# Reading a trace


def collective_label(op: str | None, place: int) -> str:
    """A collective named by what it runs and its place among its step's (by start): ``allreduce3``,
    ``broadcast0``, ``alltoall2``; ``collective1`` where nothing says. ``op`` is c10d's, gloo's or
    NCCL's name for it (``all_reduce``, ``_allgather_base``, ``AllReduce``); one scheme for every
    reader, and the suite's records name the plan's buckets ``bucket0``, ... instead."""
    return f"{_op_key(op).lower() if op else 'collective'}{place}"


def _op_of_range(name: str | None) -> str | None:
    """A collective's name as PyTorch's range gives it: ``nccl:all_to_all`` -> ``all_to_all``."""
    if not name:
        return None
    op = name.split(":", 1)[1] if ":" in name else name
    return op.split()[0].strip("_") or None


def _names_another(kernel_collective: str | None, op: str | None) -> bool:
    """Whether the CPU range's collective ``op`` says more than the kernel's name: another
    collective, or which one a SendRecv kernel runs (``all_to_all``, ``gather``)."""
    if op is None:
        return False
    return collective_of_op(op) != kernel_collective or (kernel_collective == "SendRecv" and not op.startswith(("send", "recv")))


class StepWindow(NamedTuple):
    """A step's CPU window, in seconds on the reading's clock, and the thread it ran on."""

    start: float
    end: float
    name: str
    thread: tuple | None


def _cpu_spans(cpu: list[dict], to_seconds, prefix: str) -> list[tuple[float, float, str, tuple]]:
    """``(start, end, name, thread)`` of one collective's CPU ranges (``is_collective_range``), by start."""
    return sorted((to_seconds(e["ts"]), to_seconds(e["ts"] + e.get("dur", 0)), e["name"], (e.get("pid"), e.get("tid")))
                  for e in cpu if is_collective_range(e.get("name", ""), prefix))


def _op_key(name: str) -> str:
    """A collective's name without its namespace, underscores and variants, the same for its
    launch and its gloo range: ``c10d::_allgather_base_`` and ``gloo:all_gather`` -> ``allgather``."""
    op = name.split(":")[-1]
    return re.sub(r"_|base|tensor|coalesced", "", op)


class GlooRun(NamedTuple):
    """One collective gloo ran on the host: its range on gloo's worker thread, and its launch (the
    caller's ``c10d::`` op), None where the trace holds none."""

    start: float
    end: float
    op: str | None
    """The range's collective (``all_reduce``)."""
    launch_thread: tuple | None
    launch_seconds: float | None


def gloo_runs(cpu: list[dict], to_seconds) -> tuple[list[GlooRun], list[float]]:
    """gloo's collectives in a trace's CPU ranges, by start, each with its launch, and the launch
    times that no range took (their work is not in the trace). Gloo runs a collective on a worker
    thread of its own, where no forward, backward or optimizer range is, so its phase is the one
    its launch lies in. Gloo's workers take the work in the order it was enqueued, so each range
    is the earliest launch of the same collective not yet taken that started before it. (NCCL
    launches kernels from the caller's thread: its phases need none of this.)"""
    pending: dict[str, list] = defaultdict(list)  # by collective, in launch order, reversed to pop the earliest
    for e in sorted((e for e in cpu if e.get("cat") == "cpu_op" and is_collective_range(e.get("name", ""), "c10d::")),
                    key=lambda e: e["ts"], reverse=True):
        pending[_op_key(e["name"])].append(((e.get("pid"), e.get("tid")), to_seconds(e["ts"])))
    runs = []
    for start, end, name, thread in _cpu_spans(cpu, to_seconds, "gloo:"):
        waiting = pending.get(_op_key(name))
        launch = waiting.pop() if waiting and waiting[-1][1] <= start else (None, None)
        runs.append(GlooRun(start, end, _op_of_range(name), *launch))
    return runs, sorted(seconds for waiting in pending.values() for _, seconds in waiting)


class StepReading(NamedTuple):
    """One step of a trace as ``read_steps`` reads it."""

    facts: dict
    """The partition and each collective's row (module docstring), times from the window's start,
    with the inferences (``bound_by``, the tail) and their rules."""
    events: list[GpuEvent]
    """The GPU events the step owns (launched in its window), on the reading's clock."""
    comms: list[Comm]
    """Its communication intervals on the reading's clock, in the order of ``facts["collectives"]``."""
    unpaired: bool
    """gloo only: a collective launched in the step ran outside the trace, or ran without a launch in it."""


def read_steps(events: list[dict], windows: list[StepWindow], to_seconds,
               gpu_events: list[GpuEvent] | None = None) -> list[StepReading]:
    """Each step window of one trace read (module docstring): the one reader of a trace, for
    ``ddp trace``, ``ddp profile`` and the suite's traced steps. ``to_seconds`` maps the trace's
    µs onto the windows' clock (seconds); ``gpu_events``: the trace's, on that clock, where the
    caller has read them already (``read_gpu_events``)."""
    if gpu_events is None:
        gpu_events = read_gpu_events(events, -to_seconds(0.0) * 1e6)
    gpu = [e for e in gpu_events if e.kind != "sync"]
    cpu = [e for e in events if e.get("ph") == "X" and "ts" in e and e.get("cat") in CPU_RANGE_CATEGORIES]
    places = _Places(cpu, to_seconds)
    nccl_ranges = _cpu_spans(cpu, to_seconds, "nccl:")
    starts = [w.start for w in windows]

    def owner(t: float) -> int | None:
        i = bisect_right(starts, t) - 1
        return i if i >= 0 and t <= windows[i].end else None

    owned: list[list[GpuEvent]] = [[] for _ in windows]
    for e in gpu:
        if (i := owner(e.launch_seconds)) is not None:
            owned[i].append(e)
    compute_all = union((e.start_seconds, e.end_seconds) for e in gpu if e.kind == "compute")
    copies = [(e.start_seconds, e.end_seconds) for e in gpu if e.kind == "memory"]
    comm_all = [(e.start_seconds, e.end_seconds) for e in gpu if e.kind == "communication"]
    # gloo over CUDA tensors (or on the CPU) launches no NCCL kernel: its CPU ranges are the communication.
    runs, unlaunched = ([], []) if comm_all else gloo_runs(cpu, to_seconds)
    comm_all += [(run.start, run.end) for run in runs]
    gloo_owned: list[list[GlooRun]] = [[] for _ in windows]
    for run in runs:  # a step owns what it launched; a run without a launch in the trace, where it starts
        if (i := owner(run.start if run.launch_seconds is None else run.launch_seconds)) is not None:
            gloo_owned[i].append(run)
    host_waits = idle_gaps([(e.start_seconds, e.end_seconds, e.launch_seconds) for e in gpu])
    steps = []
    for window, mine, gloo in zip(windows, owned, gloo_owned):
        span = (window.start, window.end)
        phase_of = places.step(span, window.thread).phase_of

        comms = []
        kernels = sorted((e for e in mine if e.kind == "communication"), key=lambda e: e.start_seconds)
        for place, k in enumerate(kernels):
            op = _op_of_range(k.nccl_range)
            cpu_op = op if _names_another(k.collective, op) else None
            comms.append(Comm(k.start_seconds, k.end_seconds, collective_label(cpu_op or k.collective, place), k.collective,
                              cpu_op, *phase_of(k.thread, k.launch_seconds), k.size_bytes, k.launch_seconds))
        comm_source = COMM_FROM_NCCL_KERNELS if comms else COMM_NONE
        for place, run in enumerate(gloo):
            comm_source = COMM_FROM_GLOO_RANGES
            at = (run.launch_thread, run.launch_seconds) if run.launch_seconds is not None else (None, run.start)
            comms.append(Comm(run.start, run.end, collective_label(run.op, place), collective_of_op(run.op or ""), run.op,
                              *phase_of(*at), None, run.launch_seconds))
        own = [(e.start_seconds, e.end_seconds) for e in mine] + [(c.start, c.end) for c in comms]
        w = (min(s for s, _ in own), max(e for _, e in own)) if own else (window.start, window.start)
        own_compute = [(e.start_seconds, e.end_seconds) for e in mine if e.kind == "compute"]
        figures = partition(w, own_compute, compute_all, comms, comm_all, copies, host_waits)
        figures["bound_by"] = bound_by(figures)
        optimizer_start = min((e.start_seconds for e in mine if e.kind == "compute"
                               and any(_is_optimizer(name) for name in places.names_at(e.thread, e.launch_seconds))),
                              default=w[1])
        rows, phases = collective_rows(comms, compute_all, window.start)
        launched = [(k.thread, k.launch_seconds) for k in kernels]
        without = [{"name": _op_of_range(name), "phase": phase_of(thread, start)[0],
                    "start_seconds": start - window.start, "end_seconds": end - window.start}
                   for start, end, name, thread in nccl_ranges
                   if span[0] <= start <= span[1] and not any(t == thread and start <= at <= end for t, at in launched)]
        facts = {
            "name": window.name, "step_seconds": window.end - window.start, "window_start_seconds": w[0] - window.start,
            **figures, "bound_by_rule": BOUND_BY_RULE, "comm_source": comm_source,
            "collectives": rows, "phases": phases, "collectives_without_kernel": without,
            "tail": tail(comms, rows, optimizer_start), "tail_rule": TAIL_RULE,
        }
        unpaired = any(run.launch_seconds is None for run in gloo) or any(span[0] <= t <= span[1] for t in unlaunched)
        steps.append(StepReading(facts, mine, comms, unpaired))
    return steps


# ---------------------------------------------------------------------------------------------
# A user's own trace (ddp trace)

# The one step of a trace without ProfilerStep#N annotations.
WHOLE_TRACE = "whole trace"


class TraceReading(NamedTuple):
    """What ``read_trace`` reads of one rank's trace."""

    header: dict
    """world_size, rank, backend, nccl_version (``distributedInfo``), gpu (its ``deviceProperties``
    name, of the device its kernels ran on), each None where the trace does not say."""
    steps: list[dict]
    """Each ``ProfilerStep#N``'s facts (``StepReading.facts``), in order."""
    from_profiler_steps: bool
    """False where the trace has no ``ProfilerStep#N`` annotation: one step spans it (``WHOLE_TRACE``)."""
    gpu_events: int
    nccl_kernels: int
    """NCCL kernels in the whole trace, launched inside a step or not."""


def read_trace(trace: dict) -> TraceReading:
    """The steps of one rank's PyTorch profiler trace of real training, each read (``read_steps``):
    a step is a ``ProfilerStep#N`` range (``torch.profiler.schedule`` writes one per
    ``profiler.step()``); a trace without any is one step spanning it (``WHOLE_TRACE``). Times in
    seconds from the trace's first event (a trace's µs since the epoch, 1.7e15, kept in seconds
    would keep only about 0.2 µs of a float's precision); the CPU's and the GPU's events share one
    clock in Kineto's traces."""
    events = trace["traceEvents"]
    timed = [e for e in events if e.get("ph") == "X" and "ts" in e]
    origin_us = min((e["ts"] for e in timed), default=0)

    def to_seconds(us: float) -> float:
        return (us - origin_us) / 1e6

    windows = sorted(StepWindow(to_seconds(e["ts"]), to_seconds(e["ts"] + e.get("dur", 0)), e["name"],
                                (e.get("pid"), e.get("tid")))
                     for e in timed if e.get("cat") in CPU_RANGE_CATEGORIES
                     and re.fullmatch(r"ProfilerStep#\d+", e.get("name", "")))
    from_profiler_steps = bool(windows)
    if not windows and timed:
        windows = [StepWindow(0.0, max(to_seconds(e["ts"] + e.get("dur", 0)) for e in timed), WHOLE_TRACE, None)]
    gpu = read_gpu_events(events, origin_us)
    header = trace_header(trace)
    steps = [s.facts for s in read_steps(events, windows, to_seconds, gpu)]
    for step in steps:  # the bus bandwidth of each collective whose size and world size the trace gives
        for row in step["collectives"]:
            known = row["size_bytes"] and row["collective"] and header["world_size"]
            row["bus_bandwidth_bytes_per_second"] = bus_bandwidth(
                row["collective"], row["size_bytes"], row["end_seconds"] - row["start_seconds"], header["world_size"]) if known else None
    return TraceReading(header=header, steps=steps,
                        from_profiler_steps=from_profiler_steps, gpu_events=len(gpu),
                        nccl_kernels=sum(e.kind == "communication" for e in gpu))


# ---------------------------------------------------------------------------------------------
# The suite's traced steps


def _buckets_at(positions: list[int], bucket_sizes_bytes: list[int] | None) -> dict[int, tuple[str, int]]:
    """The strategy's buckets, ``(label, bytes)`` by place among a step's collectives, where the
    collectives at ``positions`` are as many as its plan has buckets; else none."""
    if bucket_sizes_bytes is None or len(bucket_sizes_bytes) != len(positions):
        return {}
    return {i: (f"bucket{b}", bucket_sizes_bytes[b]) for b, i in enumerate(positions)}


def _gpu_phases(record: RecordedStep, events: list[GpuEvent]) -> dict:
    """A recorded step's phases as GPU time (``RecordedStep`` fields): each from the first to the
    last compute kernel launched inside it (memcpy and memset never count; a phase that launched
    none keeps its CPU span), and ``backward_compute_end`` the end of the last compute kernel
    launched before the engine's end-of-compute callback (not those a reducer launches while it
    waits in backward)."""
    def launched_in(window) -> list[GpuEvent]:
        return [e for e in events if e.kind == "compute" and window[0] <= e.launch_seconds <= window[1]]

    phases = {}
    for phase, span in record.phases.items():
        compute = launched_in(span)
        phases[phase] = [min(k.start_seconds for k in compute), max(k.end_seconds for k in compute)] if compute else span
    backward = launched_in((record.phases["backward"][0], record.backward_compute_end))
    return {"phases": phases,
            "backward_compute_end": max(k.end_seconds for k in backward) if backward else phases["backward"][1]}


def _read_collectives(record: RecordedStep, reading: StepReading, buckets: list[int] | None, *, nccl: bool,
                      own_records: bool) -> tuple[dict, list[str | None]]:
    """A recorded step's collectives from the best source (``ddp.bench.collectives.recording``), as
    ``RecordedStep`` fields, and the label of each of ``reading.comms`` (None where none is its):
    NCCL's kernels in launch order, named by the step's records where there is one per kernel,
    else the plan's buckets (the all-reduces launched before the optimizer, where the plan has as
    many) and the others named by the reading; without NCCL and without records of its own,
    gloo's runs paired with c10d's launches (``profiler``); else the records as recorded."""
    comms, records = reading.comms, record.collectives
    order = sorted(range(len(comms)), key=lambda i: (comms[i].start if comms[i].launch is None else comms[i].launch,
                                                     comms[i].start))
    source = reading.facts["comm_source"]
    if source == COMM_FROM_NCCL_KERNELS or (source == COMM_FROM_GLOO_RANGES and not own_records and not nccl):
        if source == COMM_FROM_GLOO_RANGES and reading.unpaired:
            return {"collectives": [], "comm_source": COMM_FROM_PROFILER, "unpaired": True}, [None] * len(comms)
        if source == COMM_FROM_NCCL_KERNELS and len(records) == len(comms):
            named = [(r["label"], r["size_bytes"]) for r in records]
        else:
            gradients = [p for p, i in enumerate(order) if comms[i].collective == "AllReduce"
                         and comms[i].launch < record.phases["optimizer"][0]]
            planned = _buckets_at(gradients, buckets)
            named = [planned.get(p, (comms[i].name, comms[i].size_bytes or 0)) for p, i in enumerate(order)]
        labels: list[str | None] = [None] * len(comms)
        collectives = []
        gloo = source == COMM_FROM_GLOO_RANGES
        for (label, size_bytes), i in zip(named, order):
            c = comms[i]
            labels[i] = label
            collectives.append({"label": label, "size_bytes": size_bytes, "ready_seconds": c.launch if gloo else None,
                                "launch_seconds": c.launch if gloo else c.start, "done_seconds": c.end})
        if gloo:
            return {"collectives": collectives, "comm_source": COMM_FROM_PROFILER}, labels
        return {"collectives": collectives, "comm_source": source, "collective_records": records}, labels
    # The records as recorded: NCCL without kernels (world size 1), or gloo over CUDA with a strategy's
    # own records, whose i-th to launch is gloo's i-th run of the step where the two count alike.
    by_launch = sorted(records, key=lambda c: c["launch_seconds"])
    labels = [None] * len(comms)
    if len(by_launch) == len(comms):
        for record_collective, i in zip(by_launch, order):
            labels[i] = record_collective["label"]
    read = {"comm_source": COMM_FROM_COLLECTIVE_RECORDS}
    return ({**read, "collective_records": records} if nccl else read), labels


def read_recorded(events: list[dict], records: list[RecordedStep], bucket_sizes_bytes: list[int] | None = None, *,
                  cuda: bool, nccl: bool, own_records: bool) -> list[RecordedStep]:
    """The suite's recorded steps (``ddp.bench.collectives.recording``) read from the profiler's
    trace recorded around them, in one reading (``read_steps`` over their windows: each step's
    span on the ``perf_counter`` clock, mapped onto the trace's by the first "forward" range,
    ``trace_offset_us``). Each comes back with its collectives from the best source
    (``_read_collectives``) and its ``timeline``; on NCCL (``nccl``) its phases are GPU time
    (``_gpu_phases``). The timeline is the partition of its GPU window on CUDA (``cuda``: the same
    reading as ``ddp trace``'s, its rows labelled as the step's collectives), else
    ``cpu_partition`` of the step read. ``own_records``: the strategy stamps its own collectives."""
    offset_us = trace_offset_us(events, records)
    main = next(((e.get("pid"), e.get("tid")) for e in events if e.get("name") == "forward"
                 and e.get("cat") == "user_annotation"), None)
    windows = [StepWindow(*record.span, f"step {i}", main) for i, record in enumerate(records)]
    out = []
    for record, reading in zip(records, read_steps(events, windows, lambda us: (us - offset_us) / 1e6)):
        read, labels = _read_collectives(record, reading, bucket_sizes_bytes, nccl=nccl, own_records=own_records)
        step = replace(record, **(_gpu_phases(record, reading.events) if nccl else {}), **read)
        if not cuda:
            out.append(replace(step, timeline=cpu_partition(step)))
            continue
        facts = reading.facts
        names = {row["name"]: label or row["name"] for row, label in zip(facts["collectives"], labels)}
        timeline = {**facts, "collectives": [{**row, "label": names[row["name"]]} for row in facts["collectives"]],
                    "tail": names.get(facts["tail"], facts["tail"])}
        out.append(replace(step, timeline=timeline))
    return out


def _compute_spans(step: RecordedStep) -> list[Interval]:
    """What the training thread computes in a recorded step: every phase but the wait for
    gradients (``gradient_sync``), backward until its last gradient."""
    spans = [tuple(span) for phase, span in step.phases.items() if phase not in ("backward", "gradient_sync")]
    return [*spans, (step.phases["backward"][0], step.backward_compute_end)]


def cpu_partition(step: RecordedStep) -> dict:
    """The partition of one recorded step on CPU (gloo), without a profiler: the training thread's
    phases are the compute (``_compute_spans``), each collective's launch to completion the
    communication, nothing else; times from the step's start. A collective's phase is the phase
    its launch lies in (``backward`` where it lies in the accumulating micro-batches' backward too)."""
    span = step.span
    compute = _compute_spans(step)
    comms = []
    for place, c in enumerate(sorted(step.collectives, key=lambda c: c["launch_seconds"])):
        phase = next((name for name, (start, end) in step.phases.items() if start <= c["launch_seconds"] <= end), "other")
        # Within the step: a completion stamped by gloo's thread after the step ended is the step's end.
        comms.append(Comm(max(c["launch_seconds"], span[0]), min(c["done_seconds"], span[1]), c.get("label", f"collective{place}"),
                          None, None, phase, None if phase != "other" else "between phases", c.get("size_bytes")))
    figures = partition(span, compute, [], comms, [], [], [])
    figures["bound_by"] = bound_by(figures)
    rows, by_phase = collective_rows(comms, union(compute), span[0])
    return {"step_seconds": span[1] - span[0], "window_start_seconds": 0.0, **figures, "bound_by_rule": BOUND_BY_RULE,
            "comm_source": COMM_FROM_COLLECTIVE_RECORDS if comms else COMM_NONE, "collectives": rows, "phases": by_phase,
            "collectives_without_kernel": [], "tail": tail(comms, rows, step.phases["optimizer"][0]), "tail_rule": TAIL_RULE}


def with_timelines(steps: list[RecordedStep]) -> list[RecordedStep]:
    """Recorded steps without a trace (on CPU, a strategy that stamps its own collectives), each
    with its ``timeline``: its ``cpu_partition``. With a trace: ``read_recorded``."""
    return [replace(step, timeline=cpu_partition(step)) for step in steps]


def usual_tail(timelines: list[dict]) -> str | None:
    """The tail over several steps: the one the steps most often had, the latest-ending among
    equals; None where no step had one."""
    ends = {row["label"]: row["end_seconds"] for t in timelines for row in t["collectives"]}
    tails = Counter(t["tail"] for t in timelines if t["tail"] is not None)
    return max(tails, key=lambda label: (tails[label], ends.get(label, 0.0)), default=None)


def medians(partitions: list[dict]) -> dict:
    """Each ``FIGURES`` figure's median over steps, and ``bound_by`` by the rule applied to them."""
    figures = {key: statistics.median(p[key] for p in partitions) for key in FIGURES}
    return {**figures, "bound_by": bound_by(figures)}


def over_steps(partitions: list[dict]) -> dict:
    """A summary over steps: each ``FIGURES`` figure's median and its spread (lowest, highest),
    ``bound_by`` by its rule applied to the medians (``medians``), how many steps each verdict had,
    and the tail the steps most often had (``usual_tail``)."""
    return {
        "steps": len(partitions),
        "median": medians(partitions),
        "lowest": {key: min(p[key] for p in partitions) for key in FIGURES},
        "highest": {key: max(p[key] for p in partitions) for key in FIGURES},
        "bound_by_steps": dict(Counter(p["bound_by"] for p in partitions).most_common()),
        "tail": usual_tail(partitions),
    }
