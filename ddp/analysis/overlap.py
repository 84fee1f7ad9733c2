"""The figures of ``ddp profile``'s ``summary.json`` from profiled steps, each with its
``timeline`` (``ddp.bench.collectives.timeline``: the partition of its window, the same reading as
``ddp trace`` and the suite's traced steps), and the timelines it draws. Pure functions of step
records: no tensors, no ranks.

A profiled step (``ddp.bench.rounds.profiling``) is a record of ``[start, end]`` of every phase,
``backward_compute_end`` (the last gradient computed) and its ``collectives`` (launch and
completion of each), all on the ``time.perf_counter`` clock, one clock for every rank since
``RankGroup`` runs them on one host; ``ddp.analysis.profiles`` adds its ``timeline``.
"""

from __future__ import annotations

from ddp.bench.collectives.reading import comm_source, trace_offset_us
from ddp.bench.collectives.timeline import FIGURES, bound_by, usual_tail
from ddp.bench.config.shape import phases_of, step_span  # the step's phases, named once

# Thread id of the track that add_collective_track adds to each trace; no real thread has it.
COLLECTIVE_TRACK_TID = 1_000_000_000


def rank_figures(steps: list[dict]) -> dict:
    """Per-step means over the profiled steps of one rank: each phase's length, each figure of the
    partition (``FIGURES``), ``bound_by`` by its rule applied to them, ``overlap_fraction`` (a
    ratio of totals: communication beside compute over all of it; None when nothing was
    communicated), each collective's exposed share and the tail (``exposure_figures``).
    ``collectives_per_step`` and ``comm_bytes_per_step`` count what the strategy launched (the
    records), whatever gave the times."""
    n = len(steps)
    timelines = [step["timeline"] for step in steps]
    # CUDA steps keep the records beside the kernel intervals; on the CPU path they are one list.
    records = [step.get("collective_records", step["collectives"]) for step in steps]
    means = {key: sum(t[key] for t in timelines) / n for key in FIGURES}
    return {
        "step_seconds": sum(step_span(s)[1] - step_span(s)[0] for s in steps) / n,
        **{f"{phase}_seconds": sum(s[phase][1] - s[phase][0] for s in steps) / n for phase in phases_of(steps[0])},
        "backward_compute_seconds": sum(s["backward_compute_end"] - s["backward"][0] for s in steps) / n,
        **means,
        "bound_by": bound_by(means),
        "overlap_fraction": means["overlapped_comm_seconds"] / means["comm_seconds"] if means["comm_seconds"] > 0 else None,
        **exposure_figures(timelines),
        "collectives_per_step": sum(len(r) for r in records) / n,
        "comm_bytes_per_step": sum(c["size_bytes"] for r in records for c in r) / n,
        "comm_source": comm_source(steps),
    }


def exposure_figures(timelines: list[dict]) -> dict:
    """Per collective label (in the order of the first step's), its share of the step's exposed
    communication, averaged over steps; the ``tail`` the steps most often had (None if none);
    and the exposed seconds no collective's share accounts for (none where every collective was read)."""
    per_label: dict[str, float] = {}
    attributed = 0.0
    for timeline in timelines:
        for row in timeline["collectives"]:
            per_label[row["label"]] = per_label.get(row["label"], 0.0) + row["exposed_seconds"]
            attributed += row["exposed_seconds"]
    total = sum(t["exposed_comm_seconds"] for t in timelines)
    return {
        "collective_exposed_seconds": {label: seconds / len(timelines) for label, seconds in per_label.items()},
        "tail": usual_tail(timelines),
        "unattributed_exposed_seconds": max(0.0, total - attributed) / len(timelines),
    }


def strategy_summary(rank_records: list[dict]) -> dict:
    """Figures of every rank, and at the top level those of the slowest rank (largest step time),
    whose exposed communication is the one the group actually waits for."""
    ranks = [{"rank": r["rank"], **rank_figures(r["steps"]), "trace_file": r["trace_file"]} for r in rank_records]
    slowest = max(ranks, key=lambda f: f["step_seconds"])
    keys = ("step_seconds", "comm_seconds", "overlap_fraction", "exposed_comm_seconds", "overlapped_comm_seconds",
            "comm_source", "bound_by")
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
