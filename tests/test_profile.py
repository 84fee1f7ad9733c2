"""``ddp profile``: the interval arithmetic behind summary.json, checked against hand-computed
values; the classification of GPU events and the reading of synthetic CUDA traces (NCCL, gloo over
CUDA, world size 1), no GPU needed; and a profiled run of the tiny model that must find naive's
communication all exposed."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from ddp.analysis.overlap import rank_figures, strategy_summary
from ddp.analysis.profiles import write_profiles
from ddp.bench.collectives.reading import kernel_kind
from ddp.bench.collectives.timeline import FIGURES, cpu_partition, intersect, length, medians, subtract, union, with_timelines
from ddp.bench.config.step_config import StepConfig
from ddp.bench.results.records import load_profile_summary
from ddp.bench.rounds.profiling import ProfileConfig, profile_on
from tests.cuda_traces import (
    ADAM,
    AMPERE_GEMM,
    BACKWARD,
    COPY_KERNEL,
    CUDNN,
    ELEMENTWISE,
    FLASH,
    FORWARD,
    HOPPER_GEMM,
    MEM_EFFICIENT,
    NCCL_2_18_ALL_REDUCE,
    NCCL_2_19_ALL_REDUCE,
    OPTIMIZER,
    SYNC,
    TRACE_OFFSET_US,
    collective,
    cuda_trace,
    hand_step,
    read_on_nccl,
)


def test_union_merges_overlapping_and_touching_intervals_and_drops_empty_ones():
    intervals = [(2.0, 3.0), (0.0, 1.0), (1.0, 2.5), (5.0, 7.0), (6.0, 6.5), (4.0, 4.0)]
    assert union(intervals) == [(0.0, 3.0), (5.0, 7.0)]
    assert length(union(intervals)) == pytest.approx(5.0)
    assert length(union([])) == 0.0


def test_intersect_and_subtract_count_each_instant_once():
    a, b = union([(0.0, 3.0), (5.0, 7.0)]), union([(2.0, 6.0)])
    assert intersect(a, b) == [(2.0, 3.0), (5.0, 6.0)]
    assert subtract(a, b) == [(0.0, 2.0), (6.0, 7.0)]
    assert subtract(a, []) == a and intersect(a, []) == []
    assert length(intersect(a, [(-1.0, 10.0)])) == pytest.approx(5.0)


def cuda_read(events: list[dict], steps: list[dict], plan=None) -> list[dict]:
    """Recorded steps read against their CUDA trace, each with its timeline, as ``ddp profile``'s parent reads them."""
    return read_on_nccl(events, steps, plan)


def test_the_cpu_partition_of_a_recorded_step_worked_by_hand():
    # forward [0, 1], backward [1, 2] with its last gradient at 1.8, gradient_sync [2, 2.5],
    # optimizer [2.5, 3]; collectives [1.2, 1.9] and [1.9, 2.4]. Compute: [0, 1.8] and [2.5, 3].
    step = hand_step([0, 1], [1, 2], 1.8, [2, 2.5], [2.5, 3],
                       [dict(collective(1.2, 1.9), label="bucket0"), dict(collective(1.9, 2.4), label="bucket1")])
    figures = cpu_partition(step)
    assert figures["window_seconds"] == pytest.approx(3.0)
    assert figures["gpu_compute_seconds"] == pytest.approx(2.3)
    assert figures["comm_seconds"] == pytest.approx(1.2)  # [1.2, 2.4]
    assert figures["overlapped_comm_seconds"] == pytest.approx(0.6)  # [1.2, 1.8]
    assert figures["exposed_comm_seconds"] == pytest.approx(0.6)  # [1.8, 2.4]
    assert figures["idle_seconds"] == pytest.approx(0.1)  # [2.4, 2.5]: waiting on nothing
    assert figures["copy_only_seconds"] == figures["other_steps_seconds"] == figures["host_wait_seconds"] == 0.0
    assert [(c["label"], c["phase"]) for c in figures["collectives"]] == [("bucket0", "backward"), ("bucket1", "backward")]
    assert [c["overlapped_seconds"] for c in figures["collectives"]] == pytest.approx([0.6, 0.0])
    assert [c["exposed_seconds"] for c in figures["collectives"]] == pytest.approx([0.1, 0.5])
    assert figures["tail"] == "bucket1" and figures["bound_by"] == "compute"
    # naive's all-reduce, launched once backward has returned, is all exposed: bound by communication
    # once it holds more of the window than the compute.
    naive = cpu_partition(hand_step([0, 1], [1, 2], 2.0, [2, 6], [6, 7], [collective(2.1, 6.0)]))
    assert naive["exposed_comm_seconds"] == pytest.approx(3.9) and naive["bound_by"] == "communication"
    assert naive["collectives"][0]["phase"] == "gradient_sync"


def test_rank_figures_take_medians_over_steps_as_the_suite_does():
    hidden = hand_step([0, 1], [1, 4], 4, [4, 4], [4, 5], [collective(1.0, 4.0, 8)])  # 3 s, all hidden; a 5 s step
    exposed = hand_step([5, 6], [6, 7], 7, [7, 8], [8, 9], [collective(7.0, 8.0, 8)])  # 1 s, all exposed; 4 s
    again = hand_step([9, 10], [10, 11], 11, [11, 12], [12, 13], [collective(11.0, 12.0, 8)])  # the same
    steps = with_timelines([hidden, exposed, again])
    figures = rank_figures(steps)
    assert figures["comm_seconds"] == pytest.approx(1.0)  # the median; the mean would be 5/3
    assert figures["exposed_comm_seconds"] == pytest.approx(1.0)  # the mean would be 2/3
    assert figures["overlap_fraction"] == pytest.approx(0.0)  # of the medians: nothing beside compute
    assert figures["step_seconds"] == pytest.approx(4.0)
    assert figures["collectives_per_step"] == 1 and figures["comm_bytes_per_step"] == 8
    suite = medians([step.timeline for step in steps])  # the suite's aggregation: the same figures, the same verdict
    assert {key: figures[key] for key in FIGURES} == pytest.approx({key: suite[key] for key in FIGURES})
    assert figures["bound_by"] == suite["bound_by"]


def test_no_communication_has_no_overlap_fraction():
    figures = rank_figures(with_timelines([hand_step([0, 1], [1, 2], 2, [2, 2], [2, 3], [])]))
    assert figures["comm_seconds"] == 0.0 and figures["overlap_fraction"] is None and figures["bound_by"] == "compute"


def test_summary_reports_the_slowest_rank():
    fast = {"rank": 0, "trace_file": "t0", "steps": with_timelines([hand_step([0, 1], [1, 2], 2, [2, 3], [3, 4], [collective(2, 3)])])}
    slow = {"rank": 1, "trace_file": "t1", "steps": with_timelines([hand_step([0, 1], [1, 3], 3, [3, 4], [4, 6], [collective(2, 4)])])}
    summary = strategy_summary([fast, slow])
    assert summary["slowest_rank"] == 1
    assert summary["step_seconds"] == pytest.approx(6.0)
    assert summary["overlap_fraction"] == pytest.approx(0.5)
    assert [r["rank"] for r in summary["ranks"]] == [0, 1]


@pytest.mark.parametrize(
    ("name", "category", "kind"),
    [
        (NCCL_2_19_ALL_REDUCE, "kernel", "communication"),
        (NCCL_2_18_ALL_REDUCE, "kernel", "communication"),
        ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "kernel", "communication"),
        ("void ncclDevKernel_Generic(ncclDevKernelArgsStorage<4096ul>)", "kernel", "communication"),  # not at the start
        ("Memcpy DtoH (Device -> Pageable)", "gpu_memcpy", "memory"),
        ("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", "memory"),
        ("Memcpy DtoD (Device -> Device)", "kernel", "memory"),  # by name, whatever the category
        ("Memset (Device)", "gpu_memset", "memory"),
        ("Device Synchronize", "cuda_sync", "sync"),
        ("Stream Sync", "cuda_sync", "sync"),
        (ELEMENTWISE, "kernel", "compute"),
        (COPY_KERNEL, "kernel", "compute"),  # a copy done by a kernel, not by the copy engine
        (HOPPER_GEMM, "kernel", "compute"),
        (AMPERE_GEMM, "kernel", "compute"),
        (CUDNN, "kernel", "compute"),
        (FLASH, "kernel", "compute"),
        (MEM_EFFICIENT, "kernel", "compute"),
        (ADAM, "kernel", "compute"),
        ("void at::native::unrolled_elementwise_kernel<...NCCL...>(...)", "kernel", "compute"),  # NCCL's names only
    ],
)
def test_kernel_kind_classifies_gpu_events_as_hta_does(name, category, kind):
    assert kernel_kind(name, category) == kind


def test_kernel_kind_refuses_an_event_that_is_not_a_gpu_event():
    with pytest.raises(ValueError, match="'cpu_op' is not a GPU event category"):
        kernel_kind("aten::add", "cpu_op")


def test_cuda_intervals_come_from_kernels_by_launch_range():
    cpu = hand_step(FORWARD, BACKWARD, 3.0, SYNC, OPTIMIZER, [])
    events = cuda_trace([
        (1, 1.5, 1.6, 2.4, "gemm", "kernel"),  # forward
        (2, 2.1, 2.5, 3.2, "gemm_backward", "kernel"),
        (3, 2.5, 2.6, 3.6, "ncclDevKernel_AllReduce_Sum_f32", "kernel"),  # launched by a hook in backward
        (4, 2.9, 3.2, 3.4, "gemm_backward", "kernel"),
        (5, 3.6, 3.7, 3.9, "adam", "kernel"),
        (6, 4.5, 4.6, 4.7, "gemm", "kernel"),  # launched after the step, inside no phase: ignored
    ])
    (step,) = read_on_nccl(events, [cpu])
    assert step.phases["forward"] == pytest.approx([1.6, 2.4])
    assert step.phases["backward"] == pytest.approx([2.5, 3.4])
    assert step.backward_compute_end == pytest.approx(3.4)
    assert step.phases["gradient_sync"] == [3.0, 3.5]  # launched no kernel: keeps its CPU span
    assert step.phases["optimizer"] == pytest.approx([3.7, 3.9])
    assert [c["launch_seconds"] for c in step.collectives] == pytest.approx([2.6])
    assert [c["done_seconds"] for c in step.collectives] == pytest.approx([3.6])
    (read,) = cuda_read(events, [cpu])
    assert read.timeline["overlapped_comm_seconds"] == pytest.approx(0.8)  # [2.6, 3.4]


def test_cuda_nccl_kernels_give_communication_and_copies_are_not_compute():
    # The record of an NCCL all-reduce completes when its kernel is enqueued: [2.5, 2.55].
    record = {"label": "bucket0", "size_bytes": 1024, "launch_seconds": 2.5, "done_seconds": 2.55}
    cpu = hand_step(FORWARD, BACKWARD, 3.0, SYNC, OPTIMIZER, [record])
    events = cuda_trace([
        (1, 1.5, 1.6, 2.4, AMPERE_GEMM, "kernel"),
        (2, 2.1, 2.5, 3.0, ELEMENTWISE, "kernel"),
        (3, 2.5, 2.6, 3.6, NCCL_2_19_ALL_REDUCE, "kernel"),
        (4, 2.8, 3.1, 3.8, "Memcpy DtoD (Device -> Device)", "gpu_memcpy"),  # in backward, ends after compute
        (5, 2.9, 3.2, 3.4, HOPPER_GEMM, "kernel"),
        (6, 2.95, 3.5, 3.7, "Memset (Device)", "gpu_memset"),
        (7, 3.6, 3.7, 3.9, ADAM, "kernel"),
        (8, 3.95, 3.9, 3.95, "Device Synchronize", "cuda_sync"),  # torch.cuda.synchronize() in optimizer
    ])
    (step,) = read_on_nccl(events, [cpu])
    assert step.comm_source == "nccl_kernels"
    assert step.collectives == [
        # one kernel per recorded collective: the record names it (its CPU ready stamp is no GPU time)
        {"label": record["label"], "size_bytes": record["size_bytes"], "ready_seconds": None,
         "launch_seconds": pytest.approx(2.6), "done_seconds": pytest.approx(3.6)}
    ]
    assert step.collective_records == [record]
    # Compute kernels only: the memcpy (to 3.8), memset (to 3.7) and sync (to 3.95) do not count.
    assert step.phases["backward"] == pytest.approx([2.5, 3.4])
    assert step.backward_compute_end == pytest.approx(3.4)
    assert step.phases["optimizer"] == pytest.approx([3.7, 3.9])
    figures = rank_figures(cuda_read(events, [cpu]))
    # The kernel runs [2.6, 3.6]; compute kernels [2.5, 3.0] and [3.2, 3.4] beside it.
    assert figures["overlapped_comm_seconds"] == pytest.approx(0.6)
    assert figures["exposed_comm_seconds"] == pytest.approx(0.4)  # [3.0, 3.2] and [3.4, 3.6]
    assert figures["comm_seconds"] == pytest.approx(1.0)
    assert figures["overlap_fraction"] == pytest.approx(0.6)
    # The window [1.6, 3.9]: compute 1.7, the memcpy alone [3.6, 3.7], idle [2.4, 2.5] (not a host
    # wait: the next kernel was launched at 2.1); the sync event is no GPU work.
    assert figures["window_seconds"] == pytest.approx(2.3)
    assert figures["gpu_compute_seconds"] == pytest.approx(1.7)
    assert figures["copy_only_seconds"] == pytest.approx(0.1)
    assert figures["idle_seconds"] == pytest.approx(0.1) and figures["host_wait_seconds"] == 0.0
    # What the strategy launched, from the record, though the times came from the kernel.
    assert figures["collectives_per_step"] == 1 and figures["comm_bytes_per_step"] == 1024
    assert figures["comm_source"] == "nccl_kernels"


def test_cuda_gloo_without_nccl_kernels_takes_communication_from_the_collective_records():
    # gloo over CUDA: each all-reduce copies its bucket to the host (launched from backward, in the
    # caller's thread), reduces on the CPU and copies back (launched from gloo's thread, here during
    # gradient_sync); the records run from the call to the future's completion.
    records = [
        {"label": "bucket0", "size_bytes": 4096, "launch_seconds": 2.5, "done_seconds": 3.2},
        {"label": "bucket1", "size_bytes": 2048, "launch_seconds": 2.8, "done_seconds": 3.4},
    ]
    cpu = hand_step(FORWARD, BACKWARD, 3.0, SYNC, OPTIMIZER, records)
    events = cuda_trace([
        (1, 1.5, 1.6, 2.4, AMPERE_GEMM, "kernel"),
        (2, 2.1, 2.5, 2.9, ELEMENTWISE, "kernel"),
        (3, 2.2, 2.9, 3.1, AMPERE_GEMM, "kernel"),
        (4, 2.5, 2.6, 2.7, "Memcpy DtoH (Device -> Pinned)", "gpu_memcpy"),
        (5, 2.85, 3.1, 3.15, "Memcpy DtoH (Device -> Pinned)", "gpu_memcpy"),
        (6, 3.2, 3.3, 3.45, "Memcpy HtoD (Pinned -> Device)", "gpu_memcpy"),
        (7, 3.4, 3.45, 3.5, "Memcpy HtoD (Pinned -> Device)", "gpu_memcpy"),
        (8, 3.6, 3.7, 3.9, ADAM, "kernel"),
    ])
    (step,) = read_on_nccl(events, [cpu])
    assert step.comm_source == "collective_records"
    assert step.collectives == records  # perf_counter times, labels and sizes as recorded
    assert step.phases["backward"] == pytest.approx([2.5, 3.1])
    assert step.backward_compute_end == pytest.approx(3.1)
    assert step.phases["gradient_sync"] == [3.0, 3.5]  # the copies back are not compute: keeps its CPU span
    # gloo's work on its thread, as the profiler records it: the communication on the host.
    events += [{"cat": "cpu_op", "name": "gloo:all_reduce", "ph": "X", "pid": 1, "tid": 9, "ts": at * 1e6 + TRACE_OFFSET_US,
                "dur": 0.6e6} for at in (2.55, 2.8)]
    (read,) = cuda_read(events, [cpu])
    assert read.timeline["comm_source"] == "gloo_ranges"
    assert [c["label"] for c in read.timeline["collectives"]] == ["bucket0", "bucket1"]
    figures = rank_figures([read])
    assert figures["comm_seconds"] == pytest.approx(0.85)  # [2.55, 3.4]
    assert figures["overlapped_comm_seconds"] == pytest.approx(0.55)  # beside the kernels of [2.5, 3.1]
    assert figures["exposed_comm_seconds"] == pytest.approx(0.3)
    assert figures["overlap_fraction"] == pytest.approx(0.55 / 0.85)
    assert figures["collectives_per_step"] == 2 and figures["comm_bytes_per_step"] == 6144
    assert figures["comm_source"] == "collective_records"


def test_cuda_world_size_one_without_comm_kernels_takes_the_collective_record():
    # NCCL at world size 1 runs no NCCL kernel: an out-of-place all-reduce is one device copy.
    record = {"label": "bucket0", "size_bytes": 512, "launch_seconds": 2.95, "done_seconds": 3.05}
    cpu = hand_step(FORWARD, BACKWARD, 3.0, SYNC, OPTIMIZER, [record])
    events = cuda_trace([
        (1, 1.5, 1.6, 2.4, AMPERE_GEMM, "kernel"),
        (2, 2.1, 2.5, 3.0, ELEMENTWISE, "kernel"),
        (3, 2.95, 3.0, 3.05, "Memcpy DtoD (Device -> Device)", "gpu_memcpy"),
        (4, 3.6, 3.7, 3.9, ADAM, "kernel"),
    ])
    (step,) = read_on_nccl(events, [cpu])
    assert step.comm_source == "collective_records"
    assert step.collectives == [record]
    assert step.phases["backward"] == pytest.approx([2.5, 3.0])  # not to 3.05, the copy's end
    figures = rank_figures(cuda_read(events, [cpu]))
    # Nothing communicated on the GPU: no communication, exposed or not (the wait for the host
    # before the optimizer is idle, not communication).
    assert figures["comm_seconds"] == figures["exposed_comm_seconds"] == 0.0 and figures["overlap_fraction"] is None
    assert figures["copy_only_seconds"] == pytest.approx(0.05)  # [3.0, 3.05]
    assert figures["collectives_per_step"] == 1 and figures["comm_bytes_per_step"] == 512


def test_summary_says_where_communication_times_came_from():
    def rank(rank_id, sources, step_end):
        steps = with_timelines([replace(hand_step([0, 1], [1, 2], 2, [2, 3], [3, step_end], [collective(1.5, 2.5)]),
                                        comm_source=source) for source in sources])
        return {"rank": rank_id, "trace_file": f"t{rank_id}", "steps": steps}

    summary = strategy_summary([rank(0, ["nccl_kernels"] * 2, 4), rank(1, ["collective_records"] * 2, 5)])
    assert summary["comm_source"] == "collective_records"  # the slowest rank's
    assert [r["comm_source"] for r in summary["ranks"]] == ["nccl_kernels", "collective_records"]
    summary = strategy_summary([rank(0, ["nccl_kernels", "collective_records"], 4)])
    assert summary["comm_source"] == "mixed"
    # Steps of the CPU path carry no comm_source: their collectives are the records.
    cpu_steps = with_timelines([hand_step([0, 1], [1, 2], 2, [2, 3], [3, 4], [collective(1.5, 2.5)])])
    assert rank_figures(cpu_steps)["comm_source"] == "collective_records"


def profiled_from(backend: str, world_size: int) -> str:
    """Where ``ddp profile`` reads the collectives' times: NCCL's kernels on NCCL at two ranks or
    more, the strategies' records elsewhere (gloo; NCCL alone launches no NCCL kernel)."""
    return "nccl_kernels" if backend == "nccl" and world_size > 1 else "collective_records"


def check_naive_exposed_and_overlap_hidden(summary, source: str) -> None:
    """naive launches every collective after backward has returned: all of it exposed; overlap
    launches from gradient hooks, before the last gradient is computed: some of it hidden."""
    assert all(summary.strategies[name].comm_source == source for name in ("naive", "overlap"))
    naive, overlap = summary.strategies["naive"], summary.strategies["overlap"]
    for rank in naive.ranks:
        assert rank["comm_seconds"] > 0
        assert rank["overlap_fraction"] == 0.0
        assert rank["exposed_comm_seconds"] == pytest.approx(rank["comm_seconds"])
    for rank in overlap.ranks:
        assert rank["overlap_fraction"] > 0


def test_profiling_naive_finds_its_communication_all_exposed(rank_group, tmp_path):
    configs = [
        ProfileConfig(StepConfig(name, "tiny", batch_size=2, seq_len=16), warmup_steps=1, steps=2, out_dir=str(tmp_path))
        for name in ("naive", "overlap")
    ]
    group = rank_group
    summary = write_profiles(group.world_size, group.backend, group.device, configs, profile_on(group, configs), tmp_path)

    assert load_profile_summary(tmp_path / "summary.json") == summary
    check_naive_exposed_and_overlap_hidden(summary, profiled_from(group.backend, group.world_size))
    for strategy in ("naive", "overlap"):
        assert (tmp_path / f"timeline_{strategy}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        for rank in range(rank_group.world_size):
            events = json.loads((tmp_path / f"trace_{strategy}_rank{rank}.json").read_text())["traceEvents"]
            names = {e.get("name") for e in events if e.get("cat") == "user_annotation"}
            assert {"forward", "backward", "gradient_sync", "optimizer"} <= names
    assert (tmp_path / "timeline_combined.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_nccl_branch_of_the_profile_check_on_recorded_cuda_traces(tmp_path):
    """The same check, as two NCCL GPUs would answer it, on recorded CUDA traces of two ranks:
    naive's all-reduce kernels launched once backward has returned (in gradient_sync), overlap's
    from backward while its kernels still run."""
    launches = {"naive": (3.1, 3.2), "overlap": (2.3, 2.6)}
    configs, rank_records = [], []
    for name, at in launches.items():
        configs.append(ProfileConfig(StepConfig(name, "tiny", batch_size=2, seq_len=16), out_dir=str(tmp_path)))
        records = []
        for rank in range(2):
            kernels = [(1, 1.5, 1.6, 2.4, AMPERE_GEMM, "kernel"), (2, 2.1, 2.5, 3.0, HOPPER_GEMM, "kernel"),
                       (5, 3.6, 3.7, 3.9, ADAM, "kernel")]
            kernels += [(10 + i, launch, launch + 0.05, launch + 0.15, NCCL_2_19_ALL_REDUCE, "kernel") for i, launch in enumerate(at)]
            path = tmp_path / f"trace_{name}_rank{rank}.json"
            path.write_text(json.dumps({"traceEvents": cuda_trace(kernels)}))
            step = hand_step(FORWARD, BACKWARD, 3.0, SYNC, OPTIMIZER, [collective(launch, launch + 0.01) for launch in at])
            records.append({"rank": rank, "device": f"cuda:{rank}", "trace_file": str(path), "steps": [step]})
        rank_records.append(records)
    summary = write_profiles(2, "nccl", "cuda", configs, rank_records, tmp_path)
    check_naive_exposed_and_overlap_hidden(summary, profiled_from("nccl", 2))


def test_each_collective_holds_its_share_of_the_exposed_communication_and_the_tail_is_named():
    # Compute [0, 3] and [8, 9]; collectives a [1, 2.5], b [2, 5], c [4, 7.5]. Where two run at once
    # each holds half: b alone [3, 4], b and c [4, 5], c alone [5, 7.5].
    collectives = [dict(collective(1.0, 2.5), label="a"), dict(collective(2.0, 5.0), label="b"),
                   dict(collective(4.0, 7.5, 16), label="c")]
    step = hand_step([0, 1], [1, 3], 3.0, [3, 8], [8, 9], collectives)
    timeline = cpu_partition(step)
    shares = {c["label"]: c["exposed_seconds"] for c in timeline["collectives"]}
    assert shares == pytest.approx({"a": 0.0, "b": 1.5, "c": 3.0})
    assert {c["label"]: c["overlapped_seconds"] for c in timeline["collectives"]} == pytest.approx({"a": 1.25, "b": 0.75, "c": 0.0})
    figures = rank_figures(with_timelines([step, step]))
    assert figures["collective_exposed_seconds"] == pytest.approx(shares)
    assert figures["tail"] == "c"  # the last to end among those holding exposed time
    assert figures["unattributed_exposed_seconds"] == pytest.approx(0.0)
    assert sum(shares.values()) == pytest.approx(timeline["exposed_comm_seconds"])
    hidden = hand_step([0, 1], [1, 4], 4, [4, 4], [4, 5], [collective(1.0, 3.0)])
    figures = rank_figures(with_timelines([hidden]))
    assert figures["tail"] is None and figures["collective_exposed_seconds"] == {"c": 0.0}  # nothing waited for
    assert rank_figures(with_timelines([hand_step([0, 1], [1, 2], 2, [2, 2], [2, 3], [])]))["tail"] is None
