"""Reading NCCL's kernels, and ``ddp trace``: each NCCL kernel named by the collective it runs (both
naming schemes of NCCL, ``ncclDevKernel_Generic`` through its arguments or its ``nccl:<op>``
range); DDP's buffer broadcast named apart from the plan's buckets; a user's own trace partitioned
step by step (``ddp.bench.collectives.timeline``) on hand-built traces worked by hand, one per way
a reading by phase windows misreads a real timeline. The real traces: ``test_trace_reference.py``."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from ddp.bench.collectives.reading import nccl_collective
from ddp.bench.collectives.timeline import BOUND_BY_RULE, FIGURES, PARTS, TAIL_RULE, WHOLE_TRACE, medians, over_steps, read_trace
from ddp.cli import main as ddp_main
from tests.cuda_traces import (
    ADAM,
    AMPERE_GEMM,
    BACKWARD,
    ELEMENTWISE,
    FORWARD,
    NCCL_2_18_ALL_REDUCE,
    NCCL_2_19_ALL_REDUCE,
    OPTIMIZER,
    SYNC,
    TRACE_OFFSET_US,
    cuda_trace,
    hand_step,
    read_on_nccl,
)

# Real kernel names from PyTorch CUDA traces, NCCL before 2.19 (the A100 trace's: NCCL 2.17) and since.
NCCL_2_18_BROADCAST = "ncclKernel_Broadcast_RING_LL_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)"
NCCL_2_18_SEND_RECV = "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)"
NCCL_GENERIC = "void ncclDevKernel_Generic(ncclDevKernelArgsStorage<4096ul>)"


@pytest.mark.parametrize(
    ("name", "collective"),
    [
        (NCCL_2_18_ALL_REDUCE, "AllReduce"),
        (NCCL_2_18_BROADCAST, "Broadcast"),
        (NCCL_2_18_SEND_RECV, "SendRecv"),
        ("ncclKernel_Reduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)", "Reduce"),
        ("ncclKernel_ReduceScatter_RING_LL_Sum_bfloat16(ncclDevComm*, unsigned long, ncclWork*)", "ReduceScatter"),
        ("ncclKernel_AllGather_RING_LL_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)", "AllGather"),
        (NCCL_2_19_ALL_REDUCE, "AllReduce"),
        ("ncclDevKernel_Broadcast_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "Broadcast"),
        ("ncclDevKernel_Reduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "Reduce"),
        ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "ReduceScatter"),
        ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "AllGather"),
        ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "SendRecv"),
        (NCCL_GENERIC, None),  # its name says no collective
    ],
)
def test_each_nccl_kernel_is_classified_by_the_collective_its_name_gives(name, collective):
    assert nccl_collective(name) == collective


def test_a_generic_kernel_is_classified_by_its_arguments_else_by_its_nccl_range():
    assert nccl_collective(NCCL_GENERIC, {"Collective name": "allreduce"}) == "AllReduce"
    assert nccl_collective(NCCL_GENERIC, {"Collective name": "_allgather_base"}) == "AllGather"
    assert nccl_collective(NCCL_GENERIC, {"Collective name": "reduce_scatter"}) == "ReduceScatter"
    assert nccl_collective(NCCL_GENERIC, {}, "nccl:_reduce_scatter_base") == "ReduceScatter"
    assert nccl_collective(NCCL_GENERIC, {}, "nccl:reduce") == "Reduce"
    assert nccl_collective(NCCL_GENERIC, {}, "nccl:broadcast") == "Broadcast"
    assert nccl_collective(NCCL_GENERIC, {}, "nccl:all_to_all") == "SendRecv"  # NCCL's all-to-all is grouped send/recv
    assert nccl_collective(NCCL_GENERIC, {}, "nccl:send 0->1") == "SendRecv"
    assert nccl_collective(NCCL_GENERIC, {"Collective name": "broadcast"}, "nccl:all_reduce") == "Broadcast"  # args first
    assert nccl_collective(NCCL_GENERIC, {}, "nccl:coalesced") is None
    # What the GPU ran comes first: the 128-rank trace runs SendRecv kernels inside nccl:all_reduce ranges.
    assert nccl_collective(NCCL_2_18_SEND_RECV, {"Collective name": "allreduce"}, "nccl:all_reduce") == "SendRecv"


def _with_args(events: list[dict], correlation: int, **fields) -> list[dict]:
    """``events`` with ``fields`` added to the arguments of the GPU event of ``correlation``."""
    for e in events:
        if e["cat"] == "kernel" and e["args"]["correlation"] == correlation:
            e["args"].update(fields)
    return events


def test_ddp_buffer_broadcast_leaves_the_plan_buckets_named():
    # PyTorch's DDP on two NCCL GPUs: its forward broadcasts the module's buffers (broadcast_buffers,
    # one Broadcast kernel), its backward all-reduces the plan's 2 buckets; an all-reduce launched by
    # the optimizer (a gradient norm) is no bucket either. 4 kernels for a plan of 2 buckets.
    plan = [4096, 2048]
    cpu = hand_step(FORWARD, BACKWARD, 3.0, SYNC, OPTIMIZER, [])  # DDP records no collective itself
    events = cuda_trace([
        (1, 1.1, 1.15, 1.2, NCCL_2_18_BROADCAST, "kernel"),
        (2, 1.5, 1.6, 2.4, AMPERE_GEMM, "kernel"),
        (3, 2.3, 2.4, 2.8, NCCL_2_18_ALL_REDUCE, "kernel"),
        (4, 2.6, 2.8, 3.3, NCCL_2_18_ALL_REDUCE, "kernel"),
        (5, 3.6, 3.7, 3.9, ADAM, "kernel"),
        (6, 3.8, 3.9, 3.95, NCCL_2_19_ALL_REDUCE, "kernel"),
    ])
    _with_args(events, 1, **{"Collective name": "broadcast", "In msg nelems": 53120, "dtype": "Float"})
    _with_args(events, 6, **{"Collective name": "allreduce", "In msg nelems": 1, "dtype": "Double"})
    (step,) = read_on_nccl(events, [cpu], plan)
    assert [(c["label"], c["size_bytes"]) for c in step.collectives] == [
        ("broadcast0", 53120 * 4), ("bucket0", 4096), ("bucket1", 2048), ("allreduce3", 8)]
    assert [c["launch_seconds"] for c in step.collectives] == pytest.approx([1.15, 2.4, 2.8, 3.9])
    assert [c["done_seconds"] for c in step.collectives] == pytest.approx([1.2, 2.8, 3.3, 3.95])


def test_a_generic_kernel_is_named_by_the_nccl_range_on_its_own_thread():
    # Two ncclDevKernel_Generic: one launched inside the training thread's nccl:broadcast range, one
    # at the same time from another thread (not that collective's launch: no range says what it is).
    cpu = hand_step(FORWARD, BACKWARD, 3.0, SYNC, OPTIMIZER, [])
    events = cuda_trace([
        (1, 1.1, 1.15, 1.2, NCCL_GENERIC, "kernel"),
        (2, 1.1, 1.25, 1.3, NCCL_GENERIC, "kernel"),
        (3, 3.6, 3.7, 3.9, ADAM, "kernel"),
    ])
    for e in events:
        e.update(pid=7, tid=2 if e["cat"] == "cuda_runtime" and e["args"]["correlation"] == 2 else 1)
    events.append({"cat": "user_annotation", "name": "nccl:broadcast", "ph": "X", "pid": 7, "tid": 1,
                   "ts": 1.05 * 1e6 + TRACE_OFFSET_US, "dur": 0.1 * 1e6})
    (step,) = read_on_nccl(events, [cpu])
    assert [c["label"] for c in step.collectives] == ["broadcast0", "collective1"]


# A user's own trace, built by hand: (correlation, launch µs, GPU start µs, GPU end µs, kernel name,
# launching thread[, stream]); launched through cudaLaunchKernel, NCCL's through the driver (cuLaunchKernelEx).
STEP = (1000, 2000)  # ProfilerStep#1, on thread 1
KERNELS = [
    (1, 1010, 1030, 1040, NCCL_GENERIC, 1),  # DDP's buffer broadcast, inside nccl:broadcast below
    (2, 1100, 1110, 1300, AMPERE_GEMM, 1),  # forward
    (3, 1310, 1320, 1400, AMPERE_GEMM, 2),  # backward, on the autograd engine's thread
    (4, 1420, 1430, 1650, NCCL_2_19_ALL_REDUCE, 2),  # a bucket
    (5, 1450, 1460, 1600, AMPERE_GEMM, 2),  # backward's last compute kernel: ends at 1600
    (6, 1490, 1650, 1700, NCCL_2_19_ALL_REDUCE, 2),  # the last bucket, the tail
    (7, 1620, 1720, 1800, ADAM, 1),  # the optimizer's first kernel: starts at 1720
    (8, 2500, 2510, 2520, NCCL_2_19_ALL_REDUCE, 1),  # launched after the step: in none
]
RANGES = [  # (name, start µs, end µs, thread)
    ("ProfilerStep#1", *STEP, 1),
    ("nccl:broadcast", 1005, 1020, 1),
    ("autograd::engine::evaluate_function: MmBackward0", 1300, 1460, 2),
    ("autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", 1460, 1500, 2),
    ("Optimizer.step#AdamW.step", 1600, 1900, 1),
]


def _user_trace(kernels=KERNELS, ranges=RANGES, copy=True, **header) -> dict:
    events = [{"ph": "X", "cat": "user_annotation" if not name.startswith("autograd") else "cpu_op", "name": name,
               "pid": 7, "tid": tid, "ts": start, "dur": end - start} for name, start, end, tid in ranges]
    for correlation, launch, start, end, name, tid, *stream in kernels:
        nccl = name.startswith(("nccl", "void nccl"))
        events.append({"ph": "X", "cat": "cuda_driver" if nccl else "cuda_runtime",
                       "name": "cuLaunchKernelEx" if nccl else "cudaLaunchKernel", "pid": 7, "tid": tid, "ts": launch,
                       "dur": 5, "args": {"correlation": correlation}})
        events.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream[0] if stream else (20 if nccl else 7),
                       "ts": start, "dur": end - start, "args": {"correlation": correlation, "device": 0}})
    if copy:
        events.append({"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "pid": 0, "tid": 7,
                       "ts": 1700, "dur": 10, "args": {"correlation": 99}})  # DDP's copy back: no compute
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "pid": 7, "tid": 2, "ts": 1550, "dur": 5,
                       "args": {"correlation": 99}})
    return {"traceEvents": events, **header}


US = 1e-6  # times in seconds from the step's start (1000 µs)


def test_a_user_trace_step_is_partitioned_and_worked_by_hand():
    reading = read_trace(_user_trace())
    (step,) = reading.steps
    assert reading.from_profiler_steps and reading.nccl_kernels == 4
    assert step["name"] == "ProfilerStep#1" and step["step_seconds"] == pytest.approx(1000 * US)
    # Its own GPU events run from 1030 to 1800: compute [1110, 1300], [1320, 1400], [1460, 1600],
    # [1720, 1800]; NCCL [1030, 1040] and [1430, 1700], [1460, 1600] of it beside compute; the copy
    # [1700, 1710] alone; idle 1040-1110, 1300-1320, 1400-1430 (each next kernel launched after the
    # gap began: the host) and 1710-1720 (the optimizer's kernel was launched at 1620: not the host).
    assert step["window_start_seconds"] == pytest.approx(30 * US)
    assert step["window_seconds"] == pytest.approx(770 * US)
    assert step["gpu_compute_seconds"] == pytest.approx(490 * US)
    assert step["exposed_comm_seconds"] == pytest.approx(140 * US)
    assert step["overlapped_comm_seconds"] == pytest.approx(140 * US)
    assert step["comm_seconds"] == pytest.approx(280 * US)
    assert step["copy_only_seconds"] == pytest.approx(10 * US)
    assert step["idle_seconds"] == pytest.approx(130 * US)
    assert step["host_wait_seconds"] == pytest.approx(120 * US)
    assert step["other_steps_seconds"] == 0.0
    assert sum(step[part] for part in PARTS) == pytest.approx(step["window_seconds"])
    assert [(c["name"], c["phase"]) for c in step["collectives"]] == [
        ("broadcast0", "forward"), ("allreduce1", "backward"), ("allreduce2", "backward")]
    assert [c["exposed_seconds"] for c in step["collectives"]] == pytest.approx([10 * US, 80 * US, 50 * US])
    assert [c["overlapped_seconds"] for c in step["collectives"]] == pytest.approx([0.0, 140 * US, 0.0])
    assert step["phases"]["backward"]["exposed_seconds"] == pytest.approx(130 * US)
    assert step["tail"] == "allreduce2" and step["tail_rule"] == TAIL_RULE
    assert step["bound_by"] == "compute" and step["bound_by_rule"] == BOUND_BY_RULE  # host wait 16% of the window


def _read(kernels, ranges, **kwargs) -> list[dict]:
    return read_trace(_user_trace(kernels=kernels, ranges=ranges, **kwargs)).steps


def test_accumulate_grad_after_the_collectives_does_not_hide_them():
    # AccumulateGrad's kernel, launched inside the engine's range, runs after the last bucket's
    # kernel: a reading that ends backward's computation at the last kernel launched in backward
    # pushes backward's end past the collectives and calls them hidden.
    accumulate = (10, 1495, 1705, 1715, ELEMENTWISE, 2)
    (step,) = _read([*KERNELS, accumulate], RANGES)
    assert step["exposed_comm_seconds"] == pytest.approx(140 * US)
    assert step["overlapped_comm_seconds"] == pytest.approx(140 * US)


def test_a_then_callback_on_a_side_stream_does_not_hide_the_collective_it_follows():
    # A comm hook's Future.then (the profile hook's div_, the compress hook's decompress) runs on a
    # side stream once the all-reduce is done; launched from the engine's thread inside backward.
    callback = (11, 1480, 1700, 1704, ELEMENTWISE, 2, 21)
    (step,) = _read([*KERNELS, callback], RANGES)
    assert step["exposed_comm_seconds"] == pytest.approx(140 * US)
    assert step["gpu_compute_seconds"] == pytest.approx(494 * US)  # the callback is the step's own compute
    assert step["copy_only_seconds"] == pytest.approx(6 * US)  # the copy beside it for 4 µs


def test_forward_all_to_all_and_all_gather_and_optimizer_all_gather_are_exposed_in_their_phases():
    all_to_all = "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)"
    all_gather = "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
    kernels = [
        (1, 1010, 1020, 1120, all_to_all, 1),  # the input's distribution, before any compute: alone
        (2, 1100, 1120, 1300, AMPERE_GEMM, 1),  # forward
        (6, 1200, 1300, 1310, all_gather, 1),  # FSDP's next unit gathered in forward, after the compute
        (3, 1310, 1320, 1400, AMPERE_GEMM, 2),  # backward
        (4, 1620, 1720, 1800, ADAM, 1),
        (5, 1700, 1800, 1850, all_gather, 1),  # a sharded optimizer's all-gather, after its compute
    ]
    ranges = [("ProfilerStep#1", *STEP, 1), ("nccl:all_to_all", 1005, 1015, 1), ("nccl:_all_gather_base", 1695, 1705, 1),
              ("autograd::engine::evaluate_function: MmBackward0", 1300, 1460, 2), ("Optimizer.step#AdamW.step", 1600, 1900, 1)]
    (step,) = _read(kernels, ranges, copy=False)
    assert [(c["name"], c["cpu_collective"], c["phase"]) for c in step["collectives"]] == [
        ("alltoall0", "all_to_all", "forward"), ("allgather1", None, "forward"), ("allgather2", None, "optimizer")]
    assert step["exposed_comm_seconds"] == pytest.approx(160 * US)
    assert step["phases"]["forward"]["exposed_seconds"] == pytest.approx(110 * US)
    assert step["phases"]["optimizer"]["exposed_seconds"] == pytest.approx(50 * US)
    assert step["tail"] == "allgather1"  # the optimizer's all-gather ends after the optimizer's first compute kernel


def test_overlapping_step_windows_own_their_events_by_launch():
    # The GPU runs behind the host: step 1's last kernel runs into step 2's window, beside step 2's
    # all-reduce, which is then overlapped (a compute kernel runs) but by another step's work.
    kernels = [
        (1, 1100, 1200, 1900, AMPERE_GEMM, 1),
        (2, 1900, 2050, 2500, AMPERE_GEMM, 1),  # launched in step 1, runs in step 2's window
        (3, 2100, 2200, 2300, NCCL_2_19_ALL_REDUCE, 1),
        (4, 2150, 2500, 2600, AMPERE_GEMM, 1),
    ]
    ranges = [("ProfilerStep#1", 1000, 2000, 1), ("ProfilerStep#2", 2000, 3000, 1)]
    first, second = _read(kernels, ranges, copy=False)
    assert first["window_seconds"] == pytest.approx(1300 * US)  # [1200, 2500]
    assert second["window_seconds"] == pytest.approx(400 * US)  # [2200, 2600]
    assert second["gpu_compute_seconds"] == pytest.approx(100 * US)
    assert second["other_steps_seconds"] == pytest.approx(300 * US)  # step 1's kernel [2200, 2500]
    assert second["exposed_comm_seconds"] == 0.0 and second["overlapped_comm_seconds"] == pytest.approx(100 * US)
    assert sum(second[part] for part in PARTS) == pytest.approx(second["window_seconds"])


def test_collectives_that_launch_no_kernel_are_listed_apart():
    # NCCL at world size 1: c10d's ranges, no NCCL kernel.
    kernels = [(1, 1100, 1110, 1300, AMPERE_GEMM, 1)]
    ranges = [("ProfilerStep#1", *STEP, 1)] + [("nccl:all_reduce", start, start + 5, 1) for start in (1400, 1500, 1600)]
    reading = read_trace(_user_trace(kernels=kernels, ranges=ranges, copy=False))
    (step,) = reading.steps
    assert reading.nccl_kernels == 0 and step["collectives"] == []
    assert [(c["name"], c["start_seconds"]) for c in step["collectives_without_kernel"]] == [
        ("all_reduce", pytest.approx(400 * US)), ("all_reduce", pytest.approx(500 * US)), ("all_reduce", pytest.approx(600 * US))]
    assert step["comm_seconds"] == step["exposed_comm_seconds"] == 0.0 and step["tail"] is None


def test_a_step_whose_gpu_waits_for_each_launch_is_bound_by_the_host():
    # Each kernel is launched after the previous one ended: the GPU idles waiting for the host.
    waits = [(i + 1, 1000 + 100 * i, 1005 + 100 * i, 1015 + 100 * i, AMPERE_GEMM, 1) for i in range(5)]
    (step,) = _read(waits, [("ProfilerStep#1", *STEP, 1)], copy=False)
    assert step["window_seconds"] == pytest.approx(410 * US)
    assert step["host_wait_seconds"] == pytest.approx(360 * US) == step["idle_seconds"]
    assert step["bound_by"] == "host"
    # The same kernels launched at once, each running after a gap (a stream waiting on an event):
    # the same idle time, none of it the host's.
    queued = [(i + 1, 1000 + i, 1005 + 100 * i, 1015 + 100 * i, AMPERE_GEMM, 1) for i in range(5)]
    (step,) = _read(queued, [("ProfilerStep#1", *STEP, 1)], copy=False)
    assert step["idle_seconds"] == pytest.approx(360 * US) and step["host_wait_seconds"] == 0.0
    assert step["bound_by"] == "compute"


def test_collectives_running_at_once_split_their_instants_equally():
    kernels = [(1, 1010, 1100, 1200, NCCL_2_19_ALL_REDUCE, 1, 20), (2, 1020, 1150, 1250, NCCL_2_19_ALL_REDUCE, 1, 21)]
    (step,) = _read(kernels, [("ProfilerStep#1", *STEP, 1)], copy=False)
    assert step["exposed_comm_seconds"] == pytest.approx(150 * US)
    assert [c["exposed_seconds"] for c in step["collectives"]] == pytest.approx([75 * US, 75 * US])
    assert step["bound_by"] == "communication"


def test_gloo_over_cuda_communicates_in_its_ranges_on_the_host():
    # gloo over CUDA tensors launches no NCCL kernel: its work on its own thread is the communication.
    kernels = [(1, 1100, 1110, 1300, AMPERE_GEMM, 1), (2, 1320, 1330, 1500, AMPERE_GEMM, 2)]
    ranges = [("ProfilerStep#1", *STEP, 1), ("autograd::engine::evaluate_function: MmBackward0", 1300, 1600, 2),
              ("gloo:all_reduce", 1400, 1600, 3)]
    (step,) = _read(kernels, ranges, copy=False)
    assert step["comm_source"] == "gloo_ranges"
    assert [(c["name"], c["phase"]) for c in step["collectives"]] == [("allreduce0", "other")]
    assert step["overlapped_comm_seconds"] == pytest.approx(100 * US)  # beside [1330, 1500]
    assert step["exposed_comm_seconds"] == pytest.approx(100 * US)
    assert step["window_seconds"] == pytest.approx(490 * US)  # [1110, 1600], the range's end included


# ---------------------------------------------------------------------------------------------
# ddp trace, on the command line

def _write(path: Path, trace: dict, gzipped: bool = False) -> Path:
    text = json.dumps(trace).encode()
    path.write_bytes(gzip.compress(text) if gzipped else text)
    return path


def test_ddp_trace_reads_a_gzipped_hand_built_trace_and_writes_json(tmp_path, capsys):
    trace = _user_trace(distributedInfo={"backend": "nccl", "rank": 1, "world_size": 4},
                        deviceProperties=[{"id": 0, "name": "NVIDIA H100 80GB HBM3"}])
    path = _write(tmp_path / "rank1.pt.trace.json.gz", trace, gzipped=True)
    out = tmp_path / "figures.json"
    assert ddp_main(["trace", str(path), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.splitlines()[0] == "rank1.pt.trace.json.gz: rank 1 of 4, backend nccl, GPU NVIDIA H100 80GB HBM3; 1 step"
    assert "bound by compute: compute 63.6% of the window" in printed
    assert "communication alone 18.2%: backward AllReduce 16.9%, forward Broadcast 1.3%" in printed
    (step,) = json.loads(out.read_text())["steps"]
    assert [c["name"] for c in step["collectives"]] == ["broadcast0", "allreduce1", "allreduce2"]
    assert step["exposed_comm_seconds"] == pytest.approx(140e-6) and step["tail"] == "allreduce2"
    # --json never overwrites
    with pytest.raises(SystemExit) as exit_:
        ddp_main(["trace", str(path), "--json", str(out)])
    assert exit_.value.code == 2 and "exists" in capsys.readouterr().err


def test_a_trace_without_profiler_steps_is_one_step_spanning_it(tmp_path, capsys):
    path = _write(tmp_path / "t.json", _user_trace(ranges=[r for r in RANGES if not r[0].startswith("ProfilerStep")]))
    out = tmp_path / "figures.json"
    assert ddp_main(["trace", str(path), "--json", str(out)]) == 0
    assert "read as one step spanning the whole trace" in capsys.readouterr().out
    (step,) = json.loads(out.read_text())["steps"]
    assert step["name"] == WHOLE_TRACE
    assert len(step["collectives"]) == 4  # the kernel launched after ProfilerStep#1's end counts too


def test_a_trace_without_nccl_kernels_says_so_and_names_the_collectives_without_one(tmp_path, capsys):
    compute_only = [k for k in KERNELS if "nccl" not in k[4]]
    path = _write(tmp_path / "t.json", _user_trace(kernels=compute_only, ranges=[r for r in RANGES if not r[0].startswith("nccl")]))
    assert ddp_main(["trace", str(path)]) == 0
    out = capsys.readouterr().out
    assert "no NCCL kernel in this trace: its rank ran no NCCL collective while it was recorded" in out
    path = _write(tmp_path / "ws1.json", _user_trace(kernels=compute_only))  # nccl:broadcast, no kernel
    assert ddp_main(["trace", str(path)]) == 0
    out = capsys.readouterr().out
    assert "ran no NCCL collective" not in out and "1 NCCL collectives launched no GPU kernel (broadcast" in out


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "missing.json: no such file"),
        (b"not json at all", "is not JSON"),
        (gzip.compress(b"{\"traceEvents\": [ truncated"), "is not JSON"),
        (b'{"schemaVersion": 1}', "has no traceEvents"),
        (b"[]", "has no traceEvents"),
    ],
    ids=["missing", "not-json", "gzipped-not-json", "no-trace-events", "a-list"],
)
def test_a_file_that_is_not_a_trace_is_one_line_and_exit_2(tmp_path, capsys, content, message):
    path = tmp_path / "missing.json"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(SystemExit) as exit_:
        ddp_main(["trace", str(path)])
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddp-bench trace: error: ") and message in lines[0]


RECORDED = Path(__file__).parent / "data" / "h200_ddp_ws1_nccl_rank0.json.gz"


def test_a_recorded_nccl_trace_at_world_size_one_names_the_collectives_that_launched_no_kernel(capsys):
    """PyTorch's DDP at one NCCL rank on an H200 (torch 2.11, NCCL 2.28.9; 3 steps of 8 linear layers,
    recorded by this project): its reducer's all-reduces enter ``nccl:all_reduce`` and launch no kernel."""
    with gzip.open(RECORDED) as f:
        raw = json.load(f)
    ranges = [e for e in raw["traceEvents"] if e.get("name") == "nccl:all_reduce"]
    assert not [e for e in raw["traceEvents"] if e.get("cat") == "kernel" and "nccl" in e["name"].lower()]
    reading = read_trace(raw)
    (step,) = reading.steps  # recorded without a schedule: no ProfilerStep#N, one step spanning the trace
    assert reading.nccl_kernels == 0 and step["collectives"] == [] and step["comm_seconds"] == 0.0
    assert [(c["name"], c["phase"]) for c in step["collectives_without_kernel"]] == [("all_reduce", "backward")] * len(ranges)
    assert sum(step[part] for part in PARTS) == pytest.approx(step["window_seconds"])
    assert step["bound_by"] == "host"  # 8 small layers: the GPU waits for each launch
    assert ddp_main(["trace", str(RECORDED)]) == 0
    out = capsys.readouterr().out
    assert f"{len(ranges)} NCCL collectives launched no GPU kernel (all_reduce" in out and "ran no NCCL collective" not in out


def test_the_tail_ignores_exposed_time_below_the_resolution():
    """Float noise of the interval arithmetic (1e-16 s "exposed") makes no collective the tail:
    the one that held real exposed time does, though it ended first."""
    from ddp.bench.collectives.timeline import EXPOSED_RESOLUTION_SECONDS, Comm, collective_rows, tail

    compute = [(0.0, 1.0)]
    held = Comm(0.5, 1.00015, "allreduce7", "AllReduce", None, "backward", None)  # 0.15 ms after the compute
    noise = Comm(0.9, 1.0 + 1.1e-16, "allreduce9", "AllReduce", None, "backward", None)
    rows, _ = collective_rows([held, noise], compute, 0.0)
    exposed = {row["name"]: row["exposed_seconds"] for row in rows}
    assert exposed["allreduce9"] < EXPOSED_RESOLUTION_SECONDS < exposed["allreduce7"]
    assert tail([held, noise], rows, optimizer_start=1.001) == "allreduce7"


def test_gpu_events_launched_before_the_trace_are_other_work_not_idle():
    """A kernel whose launch the trace does not hold (the profiler started while it was queued)
    still runs: the instants it covers in a step's window are another's work, not idle, and the
    GPU did not wait on the host for it."""
    kernels = [(1, 1100, 1110, 1200, AMPERE_GEMM, 1), (2, 1300, 1400, 1500, AMPERE_GEMM, 1)]
    trace = _user_trace(kernels=kernels, ranges=[("ProfilerStep#1", *STEP, 1)], copy=False)
    trace["traceEvents"].append({"ph": "X", "cat": "kernel", "name": ELEMENTWISE, "pid": 0, "tid": 8, "ts": 1250, "dur": 100,
                                 "args": {"correlation": 77, "device": 0}})  # no cudaLaunchKernel 77 in the trace
    reading = read_trace(trace)
    (step,) = reading.steps
    assert reading.gpu_events == 3
    assert step["window_seconds"] == pytest.approx(390 * US)  # its own events: [1110, 1500]
    assert step["gpu_compute_seconds"] == pytest.approx(190 * US)
    assert step["other_steps_seconds"] == pytest.approx(100 * US)  # [1250, 1350] was idle before
    assert step["idle_seconds"] == pytest.approx(100 * US)  # [1200, 1250] and [1350, 1400]
    # Neither gap waited on the host: the first ends at the unlaunched kernel, the second at kernel 2,
    # launched at 1300 before it began (dropping the unlaunched kernel made [1200, 1400] a host wait).
    assert step["host_wait_seconds"] == 0.0


def test_ddp_trace_prints_its_rules_once_a_summary_over_steps_and_bus_bandwidth(tmp_path, capsys):
    """Three steps: each with two buckets of 64 MiB all-reduced on 4 ranks; the rules print once,
    the summary gives medians, spread and the verdicts' count, each all-reduce its busbw."""
    kernels, ranges = [], []
    for i, lasts in enumerate((100, 300, 100)):  # the second step's last bucket is exposed longer
        t = 10_000 * i
        ranges += [(f"ProfilerStep#{i + 1}", t + 1000, t + 2000, 1),
                   ("autograd::engine::evaluate_function: MmBackward0", t + 1100, t + 1500, 2)]
        kernels += [(10 * i + 1, t + 1100, t + 1110, t + 1500, AMPERE_GEMM, 2),
                    (10 * i + 2, t + 1200, t + 1210, t + 1410, NCCL_2_19_ALL_REDUCE, 2),
                    (10 * i + 3, t + 1400, t + 1500, t + 1500 + lasts, NCCL_2_19_ALL_REDUCE, 2)]
    trace = _user_trace(kernels=kernels, ranges=ranges, copy=False, distributedInfo={"backend": "nccl", "rank": 0, "world_size": 4})
    for e in trace["traceEvents"]:
        if e["cat"] == "kernel" and "nccl" in e["name"]:
            e["args"].update({"In msg nelems": 16 * 2**20, "dtype": "Float"})  # 64 MiB
    path = _write(tmp_path / "t.json", trace)
    out = tmp_path / "figures.json"
    assert ddp_main(["trace", str(path), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.count(BOUND_BY_RULE) == 1 and printed.count(TAIL_RULE) == 1
    assert "over 3 steps" in printed and "bound by, step by step: compute in 3" in printed
    written = json.loads(out.read_text())
    summary = written["summary"]
    assert summary["steps"] == 3 and summary["bound_by_steps"] == {"compute": 3}
    assert summary["median"]["exposed_comm_seconds"] == pytest.approx(100 * US)
    assert summary["lowest"]["exposed_comm_seconds"] == pytest.approx(100 * US)
    assert summary["highest"]["exposed_comm_seconds"] == pytest.approx(300 * US)
    # nccl-tests' busbw: 64 MiB over 200 us x 2(n-1)/n, n = 4: 503.3 GB/s.
    first = written["steps"][0]["collectives"][0]
    assert first["bus_bandwidth_bytes_per_second"] == pytest.approx(64 * 2**20 / 200e-6 * 1.5)
    assert "503.3" in printed


def test_ddp_trace_and_the_suite_read_the_same_steps_alike():
    """One reader: two recorded steps of the suite, and the same trace given to ``ddp trace`` with a
    ``ProfilerStep#N`` range over each step's phases, give the same partition, collectives, tail
    and verdict, step by step and over the steps (the second step's all-reduce runs 0.3 s longer)."""
    steps, kernels = [], []
    for i, shift in enumerate((0.0, 5.0)):
        steps.append(hand_step([1 + shift, 2 + shift], [2 + shift, 3 + shift], 3 + shift, [3 + shift, 3.5 + shift],
                               [3.5 + shift, 4 + shift], []))
        kernels += [(10 * i + 1, 1.1 + shift, 1.2 + shift, 1.9 + shift, AMPERE_GEMM, "kernel"),
                    (10 * i + 2, 2.1 + shift, 2.2 + shift, 2.9 + shift, AMPERE_GEMM, "kernel"),
                    (10 * i + 3, 2.5 + shift, 2.6 + shift, 3.2 + shift + 0.3 * i, NCCL_2_19_ALL_REDUCE, "kernel"),
                    (10 * i + 4, 3.6 + shift, 3.7 + shift, 3.9 + shift, ADAM, "kernel")]
    events = cuda_trace(kernels)
    events += [{"name": f"ProfilerStep#{i}", "cat": "user_annotation", "ph": "X", "ts": s.span[0] * 1e6 + TRACE_OFFSET_US,
                "dur": s.seconds * 1e6} for i, s in enumerate(steps)]
    suite = [step.timeline for step in read_on_nccl(events, steps)]
    user = read_trace({"traceEvents": events}).steps
    assert len(suite) == len(user) == 2
    for ours, theirs in zip(suite, user):
        assert {key: ours[key] for key in FIGURES} == pytest.approx({key: theirs[key] for key in FIGURES}, abs=1e-9)
        assert (ours["bound_by"], ours["tail"]) == (theirs["bound_by"], theirs["tail"])
        assert [(r["name"], r["phase"]) for r in ours["collectives"]] == [(r["name"], r["phase"]) for r in theirs["collectives"]]
    assert suite[1]["exposed_comm_seconds"] == pytest.approx(0.6)  # [2.9, 3.5] of its step: alone, past backward
    ours, theirs = medians(suite), over_steps(user)["median"]
    assert {key: ours[key] for key in FIGURES} == pytest.approx({key: theirs[key] for key in FIGURES}, abs=1e-9)
    assert ours["bound_by"] == theirs["bound_by"]
