"""Reading NCCL's kernels, and ``ddp trace``: each NCCL kernel named by the collective it runs (both
naming schemes of NCCL, ``ncclDevKernel_Generic`` through its arguments or its ``nccl:<op>``
range); DDP's buffer broadcast named apart from the plan's buckets; a user's own trace read step by
step on hand-built traces, worked by hand; and ``ddp trace`` on two real traces of NCCL training
(kept beside the repository, ``GPU_TRACES``; skipped where absent), checked against the kernels
counted in the raw JSON."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from ddp.analysis.overlap import step_comm_figures, trace_step_figures
from ddp.bench.collectives.reading import (
    BACKWARD_BEFORE_OPTIMIZER,
    BACKWARD_FROM_ENGINE,
    OPTIMIZER_AFTER_COMM,
    OPTIMIZER_FROM_STEP,
    WHOLE_TRACE,
    cuda_steps_from_trace,
    nccl_collective,
    read_trace,
)
from ddp.cli import main as ddp_main
from tests.cuda_traces import (
    ADAM,
    AMPERE_GEMM,
    BACKWARD,
    FORWARD,
    NCCL_2_18_ALL_REDUCE,
    NCCL_2_19_ALL_REDUCE,
    OPTIMIZER,
    SYNC,
    TRACE_OFFSET_US,
    cuda_trace,
    step_record,
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
    cpu = step_record(FORWARD, BACKWARD, 3.0, SYNC, OPTIMIZER, [])  # DDP records no collective itself
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
    (step,) = cuda_steps_from_trace(events, [cpu], plan)
    assert [(c["label"], c["size_bytes"]) for c in step["collectives"]] == [
        ("broadcast0", 53120 * 4), ("bucket0", 4096), ("bucket1", 2048), ("allreduce3", 8)]
    assert [c["launch_seconds"] for c in step["collectives"]] == pytest.approx([1.15, 2.4, 2.8, 3.9])
    assert [c["done_seconds"] for c in step["collectives"]] == pytest.approx([1.2, 2.8, 3.3, 3.95])


def test_a_generic_kernel_is_named_by_the_nccl_range_on_its_own_thread():
    # Two ncclDevKernel_Generic: one launched inside the training thread's nccl:broadcast range, one
    # at the same time from another thread (not that collective's launch: no range says what it is).
    cpu = step_record(FORWARD, BACKWARD, 3.0, SYNC, OPTIMIZER, [])
    events = cuda_trace([
        (1, 1.1, 1.15, 1.2, NCCL_GENERIC, "kernel"),
        (2, 1.1, 1.25, 1.3, NCCL_GENERIC, "kernel"),
        (3, 3.6, 3.7, 3.9, ADAM, "kernel"),
    ])
    for e in events:
        e.update(pid=7, tid=2 if e["cat"] == "cuda_runtime" and e["args"]["correlation"] == 2 else 1)
    events.append({"cat": "user_annotation", "name": "nccl:broadcast", "ph": "X", "pid": 7, "tid": 1,
                   "ts": 1.05 * 1e6 + TRACE_OFFSET_US, "dur": 0.1 * 1e6})
    (step,) = cuda_steps_from_trace(events, [cpu])
    assert [c["label"] for c in step["collectives"]] == ["broadcast0", "collective1"]


# A user's own trace, built by hand: (correlation, launch µs, GPU start µs, GPU end µs, kernel name,
# launching thread); launched through cudaLaunchKernel, NCCL's through the driver (cuLaunchKernelEx).
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


def _user_trace(kernels=KERNELS, ranges=RANGES, **header) -> dict:
    events = [{"ph": "X", "cat": "user_annotation" if not name.startswith("autograd") else "cpu_op", "name": name,
               "pid": 7, "tid": tid, "ts": start, "dur": end - start} for name, start, end, tid in ranges]
    for correlation, launch, start, end, name, tid in kernels:
        nccl = name.startswith(("nccl", "void nccl"))
        events.append({"ph": "X", "cat": "cuda_driver" if nccl else "cuda_runtime",
                       "name": "cuLaunchKernelEx" if nccl else "cudaLaunchKernel", "pid": 7, "tid": tid, "ts": launch,
                       "dur": 5, "args": {"correlation": correlation}})
        events.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 20 if nccl else 7, "ts": start,
                       "dur": end - start, "args": {"correlation": correlation, "device": 0}})
    events.append({"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "pid": 0, "tid": 7,
                   "ts": 1700, "dur": 10, "args": {"correlation": 99}})  # DDP's copy back: no compute
    events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "pid": 7, "tid": 2, "ts": 1550, "dur": 5,
                   "args": {"correlation": 99}})
    return {"traceEvents": events, **header}


def test_a_user_trace_step_is_read_by_its_ranges_and_worked_by_hand():
    reading = read_trace(_user_trace())
    (step,) = reading.steps
    assert reading.from_profiler_steps and reading.nccl_kernels == 4
    assert step["name"] == "ProfilerStep#1"
    assert step["found"] == {"backward": BACKWARD_FROM_ENGINE, "optimizer": OPTIMIZER_FROM_STEP}
    us = 1e-6  # times in seconds from the step's start (1000 µs)
    assert step["backward"] == pytest.approx([320 * us, 600 * us])
    assert step["optimizer"] == pytest.approx([720 * us, 800 * us])
    assert [(c["name"], c["launch_seconds"], c["done_seconds"]) for c in step["collectives"]] == [
        ("Broadcast 0", pytest.approx(30 * us), pytest.approx(40 * us)),
        ("AllReduce 1", pytest.approx(430 * us), pytest.approx(650 * us)),
        ("AllReduce 2", pytest.approx(650 * us), pytest.approx(700 * us)),
    ]
    figures = trace_step_figures(step)
    # Exposed: backward's last compute kernel ends at 600, the optimizer's first starts at 720. The
    # bucket completing at 650 holds 600 -> 650, the last one 650 -> 700, no collective the copy
    # back and the launch after it (700 -> 720).
    assert figures["exposed_comm_seconds"] == pytest.approx(120 * us)
    assert [c["exposed_seconds"] for c in figures["collectives"]] == pytest.approx([0.0, 50 * us, 50 * us])
    assert figures["overlapped_comm_seconds"] == pytest.approx(170 * us)  # the first bucket over 430 -> 600
    assert figures["tail"] == "AllReduce 2"


def test_a_user_trace_without_backward_or_optimizer_ranges_falls_back_and_says_so():
    only_steps = [r for r in RANGES if r[0].startswith(("ProfilerStep", "nccl:"))]
    (step,) = read_trace(_user_trace(ranges=only_steps)).steps
    assert step["found"] == {"backward": BACKWARD_BEFORE_OPTIMIZER, "optimizer": OPTIMIZER_AFTER_COMM}
    # The optimizer: the first compute kernel launched after the last NCCL kernel (launched at 1490);
    # backward: every compute kernel launched before it, forward's included.
    assert step["optimizer"][0] == pytest.approx(720e-6)
    assert step["backward"] == pytest.approx([110e-6, 600e-6])
    assert trace_step_figures(step)["exposed_comm_seconds"] == pytest.approx(120e-6)


def test_a_collective_that_starts_after_the_optimizer_holds_no_exposure_and_is_no_tail():
    # A sharded optimizer's all-gather, launched inside Optimizer.step# and started at 1750.
    gather = (9, 1700, 1750, 1850, "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 1)
    (step,) = read_trace(_user_trace(kernels=[*KERNELS, gather])).steps
    figures = trace_step_figures(step)
    assert [c["name"] for c in figures["collectives"]][-1] == "AllGather 3"
    assert figures["collectives"][-1]["exposed_seconds"] == 0.0
    assert figures["tail"] == "AllReduce 2"
    assert sum(c["exposed_seconds"] for c in figures["collectives"]) <= step_comm_figures(step)["exposed_comm_seconds"]


# ---------------------------------------------------------------------------------------------
# ddp trace, on the command line

GPU_TRACES = Path(__file__).resolve().parents[2] / "shared" / "gpu-traces"
needs_gpu_traces = pytest.mark.skipif(
    not GPU_TRACES.is_dir(),
    reason=f"needs the real NCCL traces in {GPU_TRACES} (a checkout beside shared/gpu-traces); a clean clone has none",
)
REAL_TRACES = ["a100_ddp_ws2_rank0.json.gz", "sampled_ws128_rank0.json.gz"]


def raw_nccl_kernels_by_step(trace: dict) -> dict[str, tuple[float, list[dict]]]:
    """Per ProfilerStep#N, its start (µs) and the NCCL kernels whose launch (the runtime or driver
    event of the same correlation id) lies in it, in GPU order: counted straight from the JSON."""
    events = trace["traceEvents"]
    launch_us = {e["args"]["correlation"]: e["ts"] for e in events
                 if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    steps = sorted((e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#")),
                   key=lambda e: e["ts"])
    kernels = [e for e in events if e.get("cat") == "kernel" and e["name"].lower().startswith("nccl")]
    return {
        step["name"]: (step["ts"], sorted((k for k in kernels if step["ts"] <= launch_us.get(k["args"]["correlation"], -1)
                                           <= step["ts"] + step["dur"]), key=lambda k: k["ts"]))
        for step in steps
    }


@pytest.fixture(scope="module", params=REAL_TRACES)
def real_trace(request, tmp_path_factory):
    """A real trace (tests using it are marked ``needs_gpu_traces``): its raw JSON, and what
    ``ddp trace --json`` wrote of it."""
    path = GPU_TRACES / request.param
    out = tmp_path_factory.mktemp("trace") / "figures.json"
    assert ddp_main(["trace", str(path), "--json", str(out)]) == 0
    with gzip.open(path) as f:
        raw = json.load(f)
    return raw, json.loads(out.read_text())


@needs_gpu_traces
def test_ddp_trace_reads_every_nccl_kernel_of_each_step_of_a_real_trace(real_trace):
    raw, written = real_trace
    expected = raw_nccl_kernels_by_step(raw)
    assert [step["name"] for step in written["steps"]] == list(expected)
    for step in written["steps"]:
        start_us, kernels = expected[step["name"]]
        assert kernels, "each step of these traces launches NCCL kernels"
        collectives = sorted(step["collectives"], key=lambda c: c["start_seconds"])
        assert len(collectives) == len(kernels)  # one collective per NCCL kernel launched in the step
        assert [c["start_seconds"] for c in collectives] == pytest.approx([(k["ts"] - start_us) / 1e6 for k in kernels], abs=1e-9)
        assert [c["end_seconds"] for c in collectives] == pytest.approx(
            [(k["ts"] + k["dur"] - start_us) / 1e6 for k in kernels], abs=1e-9)
        # the collective each kernel's name gives: ncclKernel_<Coll>_...
        assert [c["collective"] for c in collectives] == [k["name"].split("_")[1] for k in kernels]
        assert step["tail"] in {c["name"] for c in collectives}
        assert all(c["exposed_seconds"] >= 0 for c in collectives)
        assert sum(c["exposed_seconds"] for c in collectives) <= step["exposed_comm_seconds"] + 1e-12
    info = raw["distributedInfo"]
    assert (written["world_size"], written["rank"], written["backend"]) == (info["world_size"], info["rank"], info["backend"])


@needs_gpu_traces
def test_ddp_trace_json_has_the_documented_shape(real_trace):
    _, written = real_trace
    assert {"steps", "world_size", "rank", "backend", "gpu"} <= set(written)
    for step in written["steps"]:
        assert {"name", "collectives", "exposed_comm_seconds", "tail", "overlapped_comm_seconds", "found"} <= set(step)
        assert set(step["found"]) == {"backward", "optimizer"}
        for collective in step["collectives"]:
            assert {"name", "start_seconds", "end_seconds", "exposed_seconds", "size_bytes"} <= set(collective)


@needs_gpu_traces
def test_ddp_trace_prints_a_header_and_each_step(capsys):
    path = GPU_TRACES / "a100_ddp_ws2_rank0.json.gz"
    assert ddp_main(["trace", str(path)]) == 0
    out = capsys.readouterr().out
    with gzip.open(path) as f:
        raw = json.load(f)
    expected = raw_nccl_kernels_by_step(raw)
    info, gpu = raw["distributedInfo"], raw["deviceProperties"][0]["name"]  # the kernels ran on device 0
    assert out.splitlines()[0] == (f"{path.name}: rank {info['rank']} of {info['world_size']}, backend {info['backend']} "
                                   f"(NCCL {info['nccl_version']}), GPU {gpu}; {len(expected)} steps")
    assert all(f"\n{name} (" in out for name in expected)
    # The A100 trace's DDP broadcasts its buffers (two dtypes) in every forward: named apart.
    assert out.count("Broadcast 0 ") == out.count("Broadcast 1 ") == len(expected)


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
    (step,) = json.loads(out.read_text())["steps"]
    assert [c["name"] for c in step["collectives"]] == ["Broadcast 0", "AllReduce 1", "AllReduce 2"]
    assert step["exposed_comm_seconds"] == pytest.approx(120e-6) and step["tail"] == "AllReduce 2"
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


def test_a_trace_without_nccl_kernels_says_so_in_one_line(tmp_path, capsys):
    compute_only = [k for k in KERNELS if "nccl" not in k[4]]
    path = _write(tmp_path / "t.json", _user_trace(kernels=compute_only))
    assert ddp_main(["trace", str(path)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and "no NCCL kernel" in lines[0]


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
