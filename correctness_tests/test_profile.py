"""``ddp profile``: the interval arithmetic behind summary.json, checked against hand-computed
values, and a profiled run of the tiny model that must find naive's communication all exposed."""

from __future__ import annotations

import json

import pytest

from ddp.profile import (
    ProfileConfig,
    covered_seconds,
    covered_seconds_within,
    cuda_steps_from_trace,
    profile_strategies,
    rank_figures,
    step_comm_figures,
    strategy_summary,
    union_intervals,
)


def _collective(launch: float, done: float, size_bytes: int = 4) -> dict:
    return {"label": "c", "size_bytes": size_bytes, "launch_seconds": launch, "done_seconds": done}


def _step(forward, backward, compute_end, sync, optimizer, collectives) -> dict:
    return {"forward": forward, "backward": backward, "backward_compute_end": compute_end,
            "gradient_sync": sync, "optimizer": optimizer, "collectives": collectives}


def test_union_merges_overlapping_and_touching_intervals_and_drops_empty_ones():
    intervals = [(5.0, 6.0), (0.0, 2.0), (1.0, 3.0), (6.0, 7.0), (8.0, 8.0), (2.5, 2.75)]
    assert union_intervals(intervals) == [(0.0, 3.0), (5.0, 7.0)]
    assert covered_seconds(intervals) == pytest.approx(5.0)
    assert covered_seconds([]) == 0.0


def test_covered_seconds_within_a_window_counts_each_instant_once():
    intervals = [(0.0, 3.0), (1.0, 2.0), (5.0, 7.0)]
    assert covered_seconds_within(intervals, (2.0, 6.0)) == pytest.approx(2.0)  # [2, 3] and [5, 6]
    assert covered_seconds_within(intervals, (3.0, 5.0)) == 0.0
    assert covered_seconds_within(intervals, (-1.0, 10.0)) == pytest.approx(5.0)


def test_step_figures_split_communication_at_the_last_gradient():
    # backward called over [1, 4], last gradient at 3.5; collectives in flight over [2, 6] and [7, 8].
    step = _step([0, 1], [1, 4], 3.5, [4, 8], [8, 9],
                 [_collective(2.0, 5.0), _collective(3.0, 6.0), _collective(7.0, 8.0)])
    figures = step_comm_figures(step)
    assert figures["comm_seconds"] == pytest.approx(5.0)
    assert figures["overlapped_comm_seconds"] == pytest.approx(1.5)  # [2, 3.5]
    assert figures["exposed_comm_seconds"] == pytest.approx(3.5)


def test_rank_figures_average_steps_and_take_the_fraction_of_totals():
    hidden = _step([0, 1], [1, 4], 4, [4, 4], [4, 5], [_collective(1.0, 4.0, 8)])  # 3 s, all hidden
    exposed = _step([5, 6], [6, 7], 7, [7, 8], [8, 9], [_collective(7.0, 8.0, 8)])  # 1 s, all exposed
    figures = rank_figures([hidden, exposed])
    assert figures["comm_seconds"] == pytest.approx(2.0)
    assert figures["exposed_comm_seconds"] == pytest.approx(0.5)
    assert figures["overlap_fraction"] == pytest.approx(0.75)  # 3 of 4 s, not the mean of 1 and 0
    assert figures["step_seconds"] == pytest.approx(4.5)
    assert figures["collectives_per_step"] == 1 and figures["comm_bytes_per_step"] == 8


def test_no_communication_has_no_overlap_fraction():
    figures = rank_figures([_step([0, 1], [1, 2], 2, [2, 2], [2, 3], [])])
    assert figures["comm_seconds"] == 0.0 and figures["overlap_fraction"] is None


def test_summary_reports_the_slowest_rank():
    fast = {"rank": 0, "trace_file": "t0", "steps": [_step([0, 1], [1, 2], 2, [2, 3], [3, 4], [_collective(2, 3)])]}
    slow = {"rank": 1, "trace_file": "t1", "steps": [_step([0, 1], [1, 3], 3, [3, 4], [4, 6], [_collective(2, 4)])]}
    summary = strategy_summary([fast, slow])
    assert summary["slowest_rank"] == 1
    assert summary["step_seconds"] == pytest.approx(6.0)
    assert summary["overlap_fraction"] == pytest.approx(0.5)
    assert [r["rank"] for r in summary["ranks"]] == [0, 1]


def test_cuda_intervals_come_from_kernels_by_launch_range():
    # CPU ranges in perf_counter seconds; the trace clock is 1000 µs ahead of perf_counter.
    cpu = _step([1.0, 2.0], [2.0, 3.0], 3.0, [3.0, 3.5], [3.5, 4.0], [])
    offset_us = 1000.0

    def at(seconds):
        return seconds * 1e6 + offset_us

    events = [{"name": "forward", "cat": "user_annotation", "ph": "X", "ts": at(1.0), "dur": 1e6}]
    kernels = [  # (correlation, launch s, start s, end s, name)
        (1, 1.5, 1.6, 2.4, "gemm"),  # forward
        (2, 2.1, 2.5, 3.2, "gemm_backward"),
        (3, 2.5, 2.6, 3.6, "ncclDevKernel_AllReduce_Sum_f32"),  # launched by a hook in backward
        (4, 2.9, 3.2, 3.4, "gemm_backward"),
        (5, 3.6, 3.7, 3.9, "adam"),
    ]
    for correlation, launch, start, end, name in kernels:
        events.append({"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": at(launch), "dur": 5,
                       "args": {"correlation": correlation}})
        events.append({"cat": "kernel", "name": name, "ts": at(start), "dur": (end - start) * 1e6,
                       "args": {"correlation": correlation}})
    (step,) = cuda_steps_from_trace(events, [cpu])
    assert step["backward"] == pytest.approx([2.5, 3.4])
    assert step["backward_compute_end"] == pytest.approx(3.4)
    assert step["gradient_sync"] == [3.0, 3.5]  # launched no kernel: keeps its CPU span
    assert [c["launch_seconds"] for c in step["collectives"]] == pytest.approx([2.6])
    assert [c["done_seconds"] for c in step["collectives"]] == pytest.approx([3.6])
    assert step_comm_figures(step)["overlapped_comm_seconds"] == pytest.approx(0.8)  # [2.6, 3.4]


def test_profiling_naive_finds_its_communication_all_exposed(rank_group, tmp_path):
    configs = [
        ProfileConfig(strategy=name, model_size="tiny", batch_size=2, seq_len=16, warmup_steps=1, steps=2,
                      out_dir=str(tmp_path))
        for name in ("naive", "overlap")
    ]
    summary = profile_strategies(rank_group, configs, tmp_path)

    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    naive, overlap = summary["strategies"]["naive"], summary["strategies"]["overlap"]
    for rank in naive["ranks"]:
        # naive launches every collective after backward has returned
        assert rank["comm_seconds"] > 0
        assert rank["overlap_fraction"] == 0.0
        assert rank["exposed_comm_seconds"] == rank["comm_seconds"]
    for rank in overlap["ranks"]:
        # overlap launches from gradient hooks, before the last gradient is computed
        assert rank["overlap_fraction"] > 0

    for strategy in ("naive", "overlap"):
        assert (tmp_path / f"timeline_{strategy}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        for rank in range(rank_group.world_size):
            events = json.loads((tmp_path / f"trace_{strategy}_rank{rank}.json").read_text())["traceEvents"]
            names = {e.get("name") for e in events if e.get("cat") == "user_annotation"}
            assert {"forward", "backward", "gradient_sync", "optimizer"} <= names
    assert (tmp_path / "timeline_combined.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
