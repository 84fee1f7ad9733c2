"""The parent side of ``ddp profile``: from the ranks' step records and the traces they saved
(``ddp.bench.rounds.profiling.profile_on`` runs the ranks) to ``summary.json``, per-strategy timelines
(JSON and PNG) and the combined timeline. Reads files and records only: no rank runs here."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from ddp.analysis import timeline
from ddp.analysis.overlap import add_collective_track, strategy_summary, timeline_record
from ddp.bench.collectives.timeline import read_recorded, with_timelines
from ddp.bench.results.records import ProfileRecord, ProfileSummary, file_stem, write_profile_summary


def read_traces(rank_records: list[dict]) -> list[dict]:
    """Each rank's record with its steps read against its trace, each with its ``timeline``: GPU
    intervals and the GPU's timeline on CUDA; on the CPU, the recorded phases and collectives,
    which are added to the trace as a track of their own."""
    records = []
    for record in rank_records:
        path = Path(record["trace_file"])
        trace = json.loads(path.read_text())
        if record["device"].startswith("cuda"):
            # On CUDA ddp profile runs NCCL (it refuses gloo there): NCCL's kernels, else the records.
            record = {**record, "steps": read_recorded(trace["traceEvents"], record["steps"], cuda=True, nccl=True,
                                                       own_records=True)}
        else:
            add_collective_track(trace, record["steps"])
            path.write_text(json.dumps(trace))
            record = {**record, "steps": with_timelines(record["steps"])}
        records.append(record)
    return records


def write_profile(config, rank_records: list[dict], out_dir: Path) -> tuple[ProfileRecord, dict]:
    """Figures and timeline of one strategy; returns (its ``ProfileRecord``, its timeline record)."""
    records = read_traces(rank_records)
    entry = strategy_summary(records)
    strategy = config.step.strategy
    record = timeline_record(strategy, entry, records)
    stem = file_stem(strategy)
    timeline_json = out_dir / f"timeline_{stem}.json"
    timeline_json.write_text(json.dumps(record, indent=1))
    timeline_png = timeline.plot_timeline(record, out_dir / f"timeline_{stem}.png")
    profile = ProfileRecord(strategy=strategy, **entry, config=asdict(config), timeline_json=str(timeline_json),
                            timeline_png=str(timeline_png))
    return profile, record


def write_profiles(world_size: int, backend: str, device: str, configs: list, rank_records: list[list[dict]],
                   out_dir: Path) -> ProfileSummary:
    """From each configuration's (a ``ddp.bench.rounds.profiling.ProfileConfig``) per-rank records
    (``profile_on``), write summary.json and the timelines into ``out_dir``; return the summary."""
    profiles, timelines = {}, []
    for config, records in zip(configs, rank_records, strict=True):
        profile, record = write_profile(config, records, out_dir)
        profiles[profile.strategy] = profile
        timelines.append(record)
    combined = None
    if len(timelines) > 1:
        combined = timeline.plot_timelines(timelines, out_dir / "timeline_combined.png")
    summary = ProfileSummary(world_size, backend, device, profiles, None if combined is None else str(combined))
    write_profile_summary(out_dir / "summary.json", summary)
    return summary
