"""Collective by collective: the figures a record keeps of each collective of a step
(``ddp.bench.rounds.summary.collective_trace``), the report's section and timeline, and the advice of the
cost model calibrated on the step (``ddp.analysis.costmodel.plan_advice``), checked against
traced steps written by hand, with every expected figure worked out in the comments. That real
steps give the right answer is tests/test_exposed_comm.py's, on a network whose delay is known."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from ddp.analysis import collectives
from ddp.analysis.costmodel import CANDIDATE_BUCKET_SIZES_MB, Compute, gradients_of, link_of_step, plan_advice, predict_step
from ddp.analysis.markdown import write_report
from ddp.bench.collectives.timeline import cpu_partition, read_recorded
from ddp.bench.config.shape import RecordedStep
from ddp.bench.results.records import CollectiveTiming, CollectiveTrace, load_run
from ddp.bench.rounds.summary import collective_trace
from tests import synthetic
from tests.synthetic import MIB, config, run_json, write


def traced_step(bucket2_done: float, optimizer_end: float = 14.0) -> RecordedStep:
    """One traced step, times in seconds, with the partition the suite gives it on CPU: the training
    thread computes over [0, 10] and from 13 (the optimizer); bucket0 [6, 9] runs beside backward's
    computation; bucket1 [9, 11] and bucket2 [10, ``bucket2_done``] run alone from 10 (sharing
    [10, 11] equally); the used mask [9.5, 9.9] is hidden."""
    step = RecordedStep(
        {"forward": [0.0, 4.0], "backward": [4.0, 10.0], "gradient_sync": [10.0, 12.9], "optimizer": [13.0, optimizer_end]},
        backward_compute_end=10.0,
        collectives=[
            {"label": "bucket0", "size_bytes": 4 * MIB, "ready_seconds": 6.0, "launch_seconds": 6.0, "done_seconds": 9.0},
            {"label": "bucket1", "size_bytes": 2 * MIB, "ready_seconds": 8.5, "launch_seconds": 9.0, "done_seconds": 11.0},
            {"label": "used_mask", "size_bytes": 84, "ready_seconds": 9.5, "launch_seconds": 9.5, "done_seconds": 9.9},
            {"label": "bucket2", "size_bytes": MIB, "ready_seconds": 9.8, "launch_seconds": 10.0, "done_seconds": bucket2_done},
        ],
    )
    return replace(step, timeline=cpu_partition(step))


# Rank 1's steps end at 15, rank 0's at 14: rank 1 is the slowest, its figures are the record's.
RANK_TRACES = [
    [traced_step(11.5) for _ in range(3)],
    [traced_step(done, optimizer_end=15.0) for done in (12.5, 12.6, 12.4)],
]


def test_each_collective_holds_its_share_of_the_exposed_communication_on_the_slowest_rank():
    trace = collective_trace(RANK_TRACES)
    assert trace.rank == 1 and trace.steps == 3 and trace.comm_source == "collective_records"
    assert [c.label for c in trace.collectives] == ["bucket0", "bucket1", "used_mask", "bucket2"]  # launch order
    shares = {c.label: c.exposed_seconds for c in trace.collectives}
    # bucket0 and the mask run beside compute: 0; bucket1 and bucket2 share [10, 11]: 0.5 each; bucket2
    # then runs alone to 12.5 (median of 12.4, 12.5, 12.6): 2.0.
    assert shares == pytest.approx({"bucket0": 0.0, "bucket1": 0.5, "used_mask": 0.0, "bucket2": 2.0})
    assert {c.label: c.phase for c in trace.collectives} == {"bucket0": "backward", "bucket1": "backward",
                                                             "used_mask": "backward", "bucket2": "backward"}
    bucket2 = trace.tail_timing
    assert trace.tail == "bucket2"  # holds exposed time and ends last before the optimizer
    assert bucket2.exposed_seconds_ci95 == pytest.approx([1.9, 2.1])  # 3 steps: their extremes
    # From backward's end: ready 9.8 - 10, launched 10 - 10, done 12.5 - 10.
    assert (bucket2.ready_seconds, bucket2.launch_seconds, bucket2.done_seconds) == pytest.approx((-0.2, 0.0, 2.5))
    assert trace.backward_start_seconds == pytest.approx(-6.0)
    # Communication alone [10, 12.5]; the shares add up to it; the window is the step's 15 s.
    assert trace.exposed_comm_seconds == pytest.approx(2.5)
    assert trace.attributed_seconds == pytest.approx(2.5) and trace.attributed_seconds_ci95 == pytest.approx([2.4, 2.6])
    assert trace.window_seconds == pytest.approx(15.0) and trace.gpu_compute_seconds == pytest.approx(12.0)
    assert trace.idle_seconds == pytest.approx(0.5) and trace.bound_by == "compute"


def test_a_step_that_communicates_nothing_still_says_what_bounds_it():
    assert collective_trace([[], []]) is None  # nothing traced
    quiet = replace(traced_step(12.5), collectives=[])
    quiet = replace(quiet, timeline=cpu_partition(quiet))
    trace = collective_trace([[quiet], [quiet]])
    assert trace.collectives == [] and trace.exposed_comm_seconds == 0.0 and trace.bound_by == "compute"


def test_a_link_is_recovered_from_collectives_queued_on_one_channel():
    # alpha 0.1 ms a step, busbw 1 GB/s; 2 ranks: a ring all-reduce of b bytes takes 2 alpha + b / busbw.
    # All three are launched together, so each waits for the one before: only completion minus
    # the previous completion is the link's time.
    alpha, busbw = 1e-4, 1e9
    sizes = [MIB, 2 * MIB, 4 * MIB]
    done, timings = -1.0, []
    for index, size in enumerate(sizes):
        done += 2 * alpha + size / busbw
        timings.append(CollectiveTiming(f"bucket{index}", size, -1.0, -1.0, done, 0.0, [0.0, 0.0]))
    timings.append(CollectiveTiming("used_mask", 0, -0.5, -0.5, done + 0.1, 0.0, [0.0, 0.0]))  # no size: ignored
    trace = CollectiveTrace(0, 3, "collective_records", -2.0, window_seconds=1.0, gpu_compute_seconds=1.0,
                            other_steps_seconds=0.0, exposed_comm_seconds=0.0, exposed_comm_seconds_ci95=[0.0, 0.0],
                            copy_only_seconds=0.0, idle_seconds=0.0, host_wait_seconds=0.0, comm_seconds=0.0,
                            overlapped_comm_seconds=0.0, bound_by="compute", bound_by_rule="", attributed_seconds=0.0,
                            attributed_seconds_ci95=[0.0, 0.0], collectives=timings, tail="bucket2")
    link = link_of_step(trace, world_size=2)
    assert link.latency_seconds == pytest.approx(alpha, rel=1e-6)
    assert link.busbw_bytes_per_second == pytest.approx(busbw, rel=1e-6)


def _bucketed_step(bucket2_dones: tuple[float, ...]):
    """bucketed 1 MiB on tiny, 2 ranks, 3 rounds of 15 s beside local's 11 s, traced as above."""
    traces = [[traced_step(done, optimizer_end=15.0) for done in bucket2_dones] for _ in range(2)]
    return synthetic.step(config("bucketed", bucket_size_mb=1.0), [15.0] * 3, exposed=3.0, local_rounds=[11.0] * 3,
                          traces=traces)


def test_the_report_names_the_tail_and_advises_only_where_it_is_exposed_beyond_doubt(tmp_path):
    exposed = _bucketed_step((12.5, 12.6, 12.4))
    # In one of its steps bucket2 completes as it starts, at 10: a share of 0, so its interval starts at 0.
    unresolved = synthetic.step(config("bucketed", bucket_size_mb=1.0, batch_size=4), [15.0] * 3, exposed=3.0,
                                local_rounds=[11.0] * 3,
                                traces=[[traced_step(done, optimizer_end=15.0) for done in (10.0, 12.5, 12.6)]] * 2)
    path = write(tmp_path / "run.json", run_json([synthetic.step_benchmark(exposed), synthetic.step_benchmark(unresolved)]))
    report = write_report([path], tmp_path / "out").read_text()
    section = re.sub(" +", " ", report.split("## Collective by collective")[1].split("\n## ")[0])  # cells unpadded
    assert ("| batch 2, seq len 32 | bucketed 1 MiB | 4 | 2500.00 | compute | 2500.00 [2400.00, 2600.00] | "
            "bucket2 (1 MiB): 2000.00 [1900.00, 2100.00] |") in section
    # The detailed group is the heaviest (batch 4): its tail is listed with its times.
    assert "### Collectives of batch 4, seq len 32" in section
    assert "| bucket2 (tail) | 1 | -200.0 | 0.0 | 2500.0 |" in section
    advice = section.split("### What to change")[1]
    # Only the step whose tail's interval is above zero is advised on; one of the other's traced
    # steps saw its tail exposed for nothing ([0, ...]).
    assert "| batch 2, seq len 32 | bucketed 1 MiB | bucket2: 2000.00 [1900.00, 2100.00] |" in advice
    assert "batch 4" not in advice
    row = next(line for line in advice.splitlines() if line.startswith("| batch 2"))
    advised = plan_advice(exposed, 11.0)
    assert f"| {advised.error:+.0%} |" in row
    if advised.best_bucket_size_mb != 1.0:
        assert f"`python -m ddp buckets --strategies bucketed --model tiny --batch-size 2 --seq-len 32 --bucket-sizes 1,{advised.best_bucket_size_mb:g}" in advice
    else:
        assert "keep 1 MiB" in row
    assert (tmp_path / "out" / "report_collective_timeline.png").stat().st_size > 0


def test_the_advice_is_the_cost_models_best_cap_on_the_steps_own_link():
    step = _bucketed_step((12.5, 12.6, 12.4))
    advice = plan_advice(step, 11.0)
    link = link_of_step(step.collectives, 2)
    gradients = gradients_of("tiny", 32)

    def modelled(cap: float) -> float:
        return predict_step("bucketed", cap, Compute(11.0), gradients, link, 2, overlap_slowdown=1.0)[0]

    candidates = {cap: modelled(cap) for cap in (*CANDIDATE_BUCKET_SIZES_MB, 1.0)}
    assert advice.modelled_seconds == pytest.approx(candidates[1.0])
    assert advice.best_seconds == pytest.approx(min(candidates.values()))
    assert advice.error == pytest.approx(candidates[1.0] / 15.0 - 1)  # measured: 15 s
    assert advice.bf16_seconds < advice.best_seconds  # half the bytes on the same link


def test_the_collectives_survive_the_saved_file(tmp_path):
    record = _bucketed_step((12.5, 12.6, 12.4))
    path = write(tmp_path / "run.json", run_json([synthetic.step_benchmark(record)]))
    json.loads(path.read_text())  # plain JSON
    (loaded,) = load_run(path).steps
    assert loaded.collectives == record.collectives
    assert collectives.tail_resolved(loaded)


def _x(name: str, start_seconds: float, end_seconds: float, tid: int) -> dict:
    """A complete event of a chrome trace, its clock 4 s ahead of ``perf_counter``'s."""
    return {"ph": "X", "name": name, "ts": (start_seconds + 4.0) * 1e6, "dur": (end_seconds - start_seconds) * 1e6,
            "tid": tid, "cat": "cpu_op"}


PROFILED_STEP = RecordedStep({"forward": [1.0, 1.1], "backward": [1.1, 1.5], "gradient_sync": [1.5, 1.6],
                              "optimizer": [1.6, 1.7]}, backward_compute_end=1.5)
# DDP's forward broadcasts the module's buffers; its reducer launches two buckets in backward; a
# barrier is no gradient's. c10d's calls on the training thread (1), gloo's work on its thread (2).
PROFILED_EVENTS = [
    {"ph": "X", "name": "forward", "cat": "user_annotation", "ts": 5.0e6, "dur": 0.1e6, "tid": 1},
    _x("c10d::barrier", 0.9, 0.91, 1), _x("gloo:barrier", 0.9, 0.95, 2),
    _x("c10d::broadcast_", 1.05, 1.051, 1), _x("gloo:broadcast", 1.052, 1.06, 2),
    _x("c10d::allreduce_", 1.2, 1.201, 1), _x("gloo:all_reduce", 1.21, 1.3, 2),
    _x("c10d::allreduce_", 1.45, 1.451, 1), _x("gloo:all_reduce", 1.46, 1.55, 2),
]


def cpu_steps_from_trace(events: list[dict], steps: list[RecordedStep], bucket_sizes_bytes: list[int] | None) -> list[RecordedStep]:
    """Recorded steps of a strategy that stamps none of its collectives (PyTorch's DDP) on gloo,
    read from the CPU profiler's trace around them, as the suite's traced steps read them."""
    return read_recorded(events, steps, bucket_sizes_bytes, cuda=False, nccl=False, own_records=False)


def test_the_profilers_collectives_pair_c10ds_calls_with_gloos_work_in_order():
    (step,) = cpu_steps_from_trace(PROFILED_EVENTS, [PROFILED_STEP], bucket_sizes_bytes=[100, 200])
    assert step.comm_source == "profiler" and not step.unpaired
    got = [(c["label"], c["size_bytes"], c["launch_seconds"], c["done_seconds"]) for c in step.collectives]
    # launched at the c10d call, done when gloo's work ended; the all-reduces are the plan's buckets
    assert got == [("broadcast0", 0, pytest.approx(1.05), pytest.approx(1.06)),
                   ("bucket0", 100, pytest.approx(1.2), pytest.approx(1.3)),
                   ("bucket1", 200, pytest.approx(1.45), pytest.approx(1.55))]
    # bucket1 runs 0.05 s past backward's last gradient (1.5), alone: its share
    shares = {c["label"]: c["exposed_seconds"] for c in cpu_partition(step)["collectives"]}
    assert shares == pytest.approx({"broadcast0": 0.0, "bucket0": 0.0, "bucket1": 0.05})
    (unplanned,) = cpu_steps_from_trace(PROFILED_EVENTS, [PROFILED_STEP], bucket_sizes_bytes=[100])  # another plan
    assert [c["label"] for c in unplanned.collectives] == ["broadcast0", "allreduce1", "allreduce2"]


def test_gloo_over_cuda_pairs_each_call_with_its_work_once_though_kineto_mirrors_it_on_the_gpu():
    """With CUDA activity Kineto repeats every annotation, gloo's work included, on the GPU's
    timeline ("gpu_user_annotation"): as an H200 wrote it for PyTorch's DDP on gloo over CUDA
    tensors (18 c10d all-reduces, 36 gloo:all_reduce, half of them on the GPU), which left every
    step unpaired and without collectives. Only the CPU's ranges pair."""
    mirrored = [{**e, "cat": "gpu_user_annotation", "tid": 7} for e in PROFILED_EVENTS if e["name"].startswith("gloo:")]
    (step,) = cpu_steps_from_trace(PROFILED_EVENTS + mirrored, [PROFILED_STEP], bucket_sizes_bytes=[100, 200])
    assert not step.unpaired
    assert [c["label"] for c in step.collectives] == ["broadcast0", "bucket0", "bucket1"]


def test_collectives_the_profiler_cannot_pair_are_none_rather_than_wrong():
    (step,) = cpu_steps_from_trace(PROFILED_EVENTS[:-1], [PROFILED_STEP], bucket_sizes_bytes=[100, 200])
    assert step.unpaired and step.collectives == []
