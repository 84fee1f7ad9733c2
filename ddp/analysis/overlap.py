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

from statistics import median

from ddp.bench.collectives.reading import comm_source, trace_offset_us
from ddp.bench.collectives.timeline import medians, usual_tail
from ddp.bench.config.shape import RecordedStep

# Thread id of the track that add_collective_track adds to each trace; no real thread has it.
COLLECTIVE_TRACK_TID = 1_000_000_000


def rank_figures(steps: list[RecordedStep]) -> dict:
    """Medians over the profiled steps of one rank, the suite's aggregation (``timeline.medians``):
    each phase's length, each figure of the partition (``FIGURES``), ``bound_by`` by its rule
    applied to them, ``overlap_fraction`` (communication beside compute over all of it, of the
    medians; None when nothing was communicated), each collective's exposed share and the tail
    (``exposure_figures``). ``collectives_per_step`` and ``comm_bytes_per_step`` count what the
    strategy launched (the records), whatever gave the times."""
    timelines = [step.timeline for step in steps]
    records = [step.launched for step in steps]
    figures = medians(timelines)
    return {
        "step_seconds": median(s.seconds for s in steps),
        **{f"{phase}_seconds": median(s.phases[phase][1] - s.phases[phase][0] for s in steps) for phase in steps[0].phases},
        "backward_compute_seconds": median(s.backward_compute_end - s.phases["backward"][0] for s in steps),
        **figures,
        "overlap_fraction": (figures["overlapped_comm_seconds"] / figures["comm_seconds"]
                             if figures["comm_seconds"] > 0 else None),
        **exposure_figures(timelines),
        "collectives_per_step": median(len(r) for r in records),
        "comm_bytes_per_step": median(sum(c["size_bytes"] for c in r) for r in records),
        "comm_source": comm_source(steps),
    }


def exposure_figures(timelines: list[dict]) -> dict:
    """Per collective label (in the order of the first step's), the median over steps of its share
    of the step's exposed communication (0 in a step without it); the ``tail`` the steps most
    often had (None if none); and the median exposed seconds no collective's share accounts for
    (none where every collective was read)."""
    labels = list(dict.fromkeys(row["label"] for t in timelines for row in t["collectives"]))
    shares = [{row["label"]: row["exposed_seconds"] for row in t["collectives"]} for t in timelines]
    unattributed = [t["exposed_comm_seconds"] - sum(row["exposed_seconds"] for row in t["collectives"]) for t in timelines]
    return {
        "collective_exposed_seconds": {label: median(share.get(label, 0.0) for share in shares) for label in labels},
        "tail": usual_tail(timelines),
        "unattributed_exposed_seconds": max(0.0, median(unattributed)),
    }


def strategy_summary(rank_records: list[dict]) -> dict:
    """Figures of every rank, and at the top level those of the slowest rank (largest step time),
    whose exposed communication is the one the group actually waits for."""
    ranks = [{"rank": r["rank"], **rank_figures(r["steps"]), "trace_file": r["trace_file"]} for r in rank_records]
    slowest = max(ranks, key=lambda f: f["step_seconds"])
    keys = ("step_seconds", "comm_seconds", "overlap_fraction", "exposed_comm_seconds", "overlapped_comm_seconds",
            "comm_source", "bound_by")
    return {**{key: slowest[key] for key in keys}, "slowest_rank": slowest["rank"], "ranks": ranks}


def add_collective_track(trace: dict, steps: list[RecordedStep]) -> None:
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
        for c in step.collectives:
            common = {"cat": "ddp_bench_collective", "name": c["label"], "id": index, "pid": pid, "tid": tid}
            args = {"size_bytes": c["size_bytes"], "step": step_index}
            events.append({**common, "ph": "b", "ts": c["launch_seconds"] * 1e6 + offset, "args": args})
            events.append({**common, "ph": "e", "ts": c["done_seconds"] * 1e6 + offset})
            index += 1


# ---------------------------------------------------------------------------------------------
# Timelines


def timeline_record(strategy: str, summary: dict, rank_records: list[dict]) -> dict:
    """What ``ddp.analysis.timeline`` draws (JSON): every rank's steps, each its phases by name,
    ``backward_compute_end`` and ``collectives``, in seconds since the earliest rank's first step."""
    origin = min(r["steps"][0].span[0] for r in rank_records)

    def shift(step: RecordedStep) -> dict:
        shifted = {phase: [t - origin for t in span] for phase, span in step.phases.items()}
        shifted["backward_compute_end"] = step.backward_compute_end - origin
        shifted["collectives"] = [
            {**c, "launch_seconds": c["launch_seconds"] - origin, "done_seconds": c["done_seconds"] - origin}
            for c in step.collectives
        ]
        return shifted

    keys = ("comm_seconds", "overlap_fraction", "exposed_comm_seconds", "slowest_rank", "comm_source")
    figures = {k: summary[k] for k in keys}
    return {
        "strategy": strategy,
        **figures,
        "ranks": [{"rank": r["rank"], "steps": [shift(s) for s in r["steps"]]} for r in rank_records],
    }
