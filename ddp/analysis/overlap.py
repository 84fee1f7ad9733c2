"""Overlap of communication with backward, from profiled steps: interval arithmetic, reading
CUDA traces, and the figures of ``summary.json``. Pure functions of step records: no tensors, no ranks.

A profiled step (``ddp.bench.rounds.profiling``) is a record of ``[start, end]`` of every phase
("forward", "backward", "gradient_sync", "optimizer"), ``backward_compute_end`` (the last gradient
computed) and its ``collectives`` (launch and completion of each), all on the ``time.perf_counter``
clock, one clock for every rank since ``RankGroup`` runs them on one host.

Per step (``step_comm_figures``): ``exposed_comm_seconds`` is the time the step waited for
communication once backward's computation was done (the benchmarks' ``exposed_comm_seconds``),
``overlapped_comm_seconds`` the time collectives were in flight during backward's computation,
``comm_seconds`` their sum, and ``overlap_fraction`` the overlapped share of it.

On CUDA the collectives' futures complete when their kernels are enqueued, not when they end, so
there the intervals come from the trace (``ddp.bench.collectives.reading.cuda_steps_from_trace``): kernels are classified as
Holistic Trace Analysis does (``kernel_kind``), phases and the backward window come from compute
kernels only, and communication from NCCL kernels where a step has any, else (world size 1, or
gloo over CUDA tensors, where there are none) from the collectives' own launch and completion
records. ``comm_source`` says which.

A user's own trace (``ddp trace``) is read into step records of the same shape
(``ddp.bench.collectives.reading.read_trace``) and given the same figures per step (``trace_step_figures``).
"""

from __future__ import annotations

from collections.abc import Iterable

from ddp.bench.collectives.reading import collective_exposure, comm_source, tail_of, trace_offset_us
from ddp.bench.config.shape import phases_of, step_span  # the step's phases, named once

# Thread id of the track that add_collective_track adds to each trace; no real thread has it.
COLLECTIVE_TRACK_TID = 1_000_000_000

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
    the start of the optimizer, the figure ``ddp.bench.rounds.trainer`` defines as ``exposed_comm_seconds``
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
        "step_seconds": sum(step_span(s)[1] - step_span(s)[0] for s in steps) / n,
        **{f"{phase}_seconds": sum(s[phase][1] - s[phase][0] for s in steps) / n for phase in phases_of(steps[0])},
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
    per step (``collective_exposure``, averaged); the ``tail`` (``tail_of``: the gradient
    collective that completed last, as in a step record's ``collectives``), None if none was launched;
    and the exposed seconds no collective accounts for."""
    per_label: dict[str, list[float]] = {}
    done: dict[str, list[float]] = {}
    attributed = 0.0
    for step in steps:
        for share in collective_exposure(step):
            per_label.setdefault(share["label"], []).append(share["exposed_seconds"])
            done.setdefault(share["label"], []).append(share["done_seconds"] - step["backward_compute_end"])
            attributed += share["exposed_seconds"]
    exposed = {label: sum(values) / len(steps) for label, values in per_label.items()}
    tail = tail_of(done)
    total = sum(step_comm_figures(step)["exposed_comm_seconds"] for step in steps)
    return {
        "collective_exposed_seconds": exposed,
        "tail": tail,
        "unattributed_exposed_seconds": max(0.0, total - attributed) / len(steps),
    }


def trace_step_figures(step: dict) -> dict:
    """What ``ddp trace`` reports of one step of a user's trace (``ddp.bench.collectives.reading.read_trace``), by
    the definitions ``ddp profile`` uses: each collective (in launch order) from its GPU start to
    its end with its share of the exposed window (``collective_exposure``), the step's exposed
    communication and the communication overlapped with backward's computation
    (``step_comm_figures``), and the tail (``tail_of``: the collective that completed last).

    A user's trace does not say which collectives carry gradients, as the suite's records do. A
    collective that started on the GPU only once the optimizer had (a sharded optimizer's
    all-gather) is one the exposed window did not wait for: it holds none of the window and is
    never the tail, so the shares and the tail are those of the collectives that started before.
    """
    optimizer_start = step["optimizer"][0]
    waited_for = [c for c in step["collectives"] if c["launch_seconds"] < optimizer_start]
    shares = collective_exposure({**step, "collectives": waited_for})
    shares += [{**c, "exposed_seconds": 0.0} for c in step["collectives"] if c["launch_seconds"] >= optimizer_start]
    shares.sort(key=lambda share: share["launch_seconds"])
    tail = tail_of({c["label"]: [c["done_seconds"] - step["backward_compute_end"]] for c in waited_for})
    comm = step_comm_figures(step)
    return {
        "name": step["name"],
        "step_seconds": step["step_seconds"],
        "collectives": [
            {"name": share["name"], "collective": share["collective"], "size_bytes": share["size_bytes"],
             "start_seconds": share["launch_seconds"], "end_seconds": share["done_seconds"],
             "exposed_seconds": share["exposed_seconds"]}
            for share in shares
        ],
        "exposed_comm_seconds": comm["exposed_comm_seconds"],
        "overlapped_comm_seconds": comm["overlapped_comm_seconds"],
        "tail": next((share["name"] for share in shares if share["label"] == tail), None),
        "backward_compute_end_seconds": step["backward_compute_end"],
        "optimizer_start_seconds": optimizer_start,
        "found": step["found"],
    }


def strategy_summary(rank_records: list[dict]) -> dict:
    """Figures of every rank, and at the top level those of the slowest rank (largest step time),
    whose exposed communication is the one the group actually waits for."""
    ranks = [{"rank": r["rank"], **rank_figures(r["steps"]), "trace_file": r["trace_file"]} for r in rank_records]
    slowest = max(ranks, key=lambda f: f["step_seconds"])
    keys = ("step_seconds", "comm_seconds", "overlap_fraction", "exposed_comm_seconds", "overlapped_comm_seconds",
            "comm_source")
    return {**{key: slowest[key] for key in keys}, "slowest_rank": slowest["rank"], "ranks": ranks}


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


# ---------------------------------------------------------------------------------------------
# Timelines


def timeline_record(strategy: str, summary: dict, rank_records: list[dict]) -> dict:
    """What ``ddp.analysis.timeline`` draws: every rank's steps, in seconds since the earliest rank's first step."""
    origin = min(step_span(r["steps"][0])[0] for r in rank_records)

    def shift(step: dict) -> dict:
        shifted = {phase: [t - origin for t in step[phase]] for phase in phases_of(step)}
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
