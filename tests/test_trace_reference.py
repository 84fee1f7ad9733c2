"""``python -m ddp trace TRACE --json OUT`` held to a reference computed here, independently, from the raw
events of real PyTorch profiler (Kineto) traces of NCCL training: the recorded GPU traces beside the
project (skipped where absent). Nothing of ``ddp`` is imported: the command runs as a subprocess and
every reference figure comes from the small interval helpers below.

Definitions (Holistic Trace Analysis' kernel classes): a GPU event (cat kernel, gpu_memcpy or gpu_memset,
with ``args.correlation``) belongs to the ``ProfilerStep#N`` range that holds its CPU launch (cat
cuda_runtime or cuda_driver, same correlation); a kernel named ``nccl...`` is communication, a copy or set
is a copy, any other kernel is compute. A step's communication is the union of its NCCL kernels; its
exposed part is what no compute kernel of the whole trace covers, its overlapped part what one does."""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TRACES = Path(__file__).resolve().parents[2] / "shared" / "gpu-traces"
FILES = ["a100_ddp_ws2_rank0.json.gz", "sampled_ws128_rank0.json.gz", "v100_ws2_rank1_alltoall.json.gz"]

STEP = re.compile(r"ProfilerStep#\d+")
NCCL = re.compile(r"^nccl|ncclDevKernel|ncclKernel")
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
PARTS = ("gpu_compute_seconds", "other_steps_seconds", "exposed_comm_seconds", "copy_only_seconds", "idle_seconds")
PHASES = {"forward", "backward", "optimizer", "accumulate", "gradient_sync", "other"}
BOUNDS = {"host", "compute", "communication", "copies"}
US = 1e-6  # trace times are in microseconds


def close(got: float, ref: float) -> bool:
    """Within 1% of the reference plus 20 µs."""
    return abs(got - ref) <= 0.01 * abs(ref) + 20e-6


def union(spans):
    """Disjoint, sorted union of [start, end) spans."""
    out = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out


def length(spans) -> float:
    return sum(end - start for start, end in spans)


def intersect(a, b):
    """Intersection of two disjoint, sorted unions."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append([start, end])
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def minus(a, b) -> float:
    """Length of a with b taken away (both disjoint, sorted unions)."""
    return length(a) - length(intersect(a, b))


def kind(event: dict) -> str:
    if event["cat"] == "kernel" and NCCL.search(event["name"]):
        return "comm"
    if event["cat"] != "kernel" or event["name"].startswith(("Memcpy", "Memset")):
        return "copy"
    return "compute"


def inside(ts: float, event: dict) -> bool:
    return float(event["ts"]) <= ts <= float(event["ts"]) + float(event["dur"])


def reference(path: Path) -> list[dict]:
    """Per ProfilerStep range, in order of start: the figures the definitions above give, in seconds."""
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    origin = min(float(e["ts"]) for e in events if e.get("ph") == "X")

    def seconds(ts) -> float:
        """From the trace's first event, the origin taken away in microseconds (epoch seconds lose precision)."""
        return (float(ts) - origin) * US

    def span(event: dict) -> list:
        return [seconds(event["ts"]), seconds(float(event["ts"]) + float(event["dur"]))]

    cpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")]
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    gpu = [e for e in events if e.get("cat") in GPU_CATS and "correlation" in e.get("args", {})]
    all_compute = union(span(e) for e in gpu if kind(e) == "compute")
    backward_ranges = [e for e in cpu if e["name"].startswith("autograd::engine::evaluate_function")]
    steps = []
    for step in sorted((e for e in cpu if STEP.fullmatch(e["name"])), key=lambda e: float(e["ts"])):
        own = [e for e in gpu if e["args"]["correlation"] in launches and inside(float(launches[e["args"]["correlation"]]["ts"]), step)]
        nccl = sorted((e for e in own if kind(e) == "comm"), key=span)
        comm = union(span(e) for e in nccl)
        window = [[min(span(e)[0] for e in own), max(span(e)[1] for e in own)]] if own else []
        backward = []
        for kernel in nccl:
            launch = launches[kernel["args"]["correlation"]]
            backward.append(any(r["pid"] == launch["pid"] and r["tid"] == launch["tid"] and inside(float(launch["ts"]), r)
                                for r in backward_ranges))
        steps.append({
            "name": step["name"], "start": seconds(step["ts"]), "step": float(step["dur"]) * US,
            "exposed": minus(comm, all_compute), "overlapped": length(intersect(comm, all_compute)), "comm": length(comm),
            "window": length(window), "own_compute": length(intersect(union(span(e) for e in own if kind(e) == "compute"), window)),
            "nccl": [span(e) for e in nccl], "backward": backward,
        })
    return steps


@pytest.fixture(scope="module", params=FILES)
def traced(request, tmp_path_factory):
    """(file name, reference steps, the steps ``ddp trace --json`` wrote) for one recorded trace, the command run once."""
    path = TRACES / request.param
    if not path.is_file():
        pytest.skip("needs the recorded GPU traces in ../shared/gpu-traces (a checkout beside the project's shared folder)")
    out = tmp_path_factory.mktemp("trace") / "figures.json"
    done = subprocess.run([sys.executable, "-m", "ddp", "trace", str(path), "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return request.param, reference(path), json.loads(out.read_text())["steps"]


def test_one_step_per_profiler_step_range_in_order(traced):
    """The JSON holds one step per ProfilerStep#N range, in order of start, each with the range's duration."""
    _, ref, steps = traced
    assert [s["name"] for s in steps] == [r["name"] for r in ref]
    for r, s in zip(ref, steps):
        assert close(s["step_seconds"], r["step"]), (r["name"], s["step_seconds"], r["step"])


def test_communication_exposed_and_overlapped_match_the_raw_kernels(traced):
    """Each step's communication, exposed and overlapped, match the union of its own NCCL kernels against all compute."""
    _, ref, steps = traced
    for r, s in zip(ref, steps, strict=True):
        assert close(s["comm_seconds"], r["comm"]), (r["name"], s["comm_seconds"], r["comm"])
        assert close(s["exposed_comm_seconds"], r["exposed"]), (r["name"], s["exposed_comm_seconds"], r["exposed"])
        assert close(s["overlapped_comm_seconds"], r["overlapped"]), (r["name"], s["overlapped_comm_seconds"], r["overlapped"])


def test_the_window_is_partitioned_into_its_five_parts(traced):
    """The window spans the step's own GPU events; its five parts are >= 0 and add up to it; compute is its own kernels."""
    _, ref, steps = traced
    for r, s in zip(ref, steps, strict=True):
        window = s["window_seconds"]
        assert close(window, r["window"]), (r["name"], window, r["window"])
        assert all(s[part] >= 0 for part in PARTS), (r["name"], {part: s[part] for part in PARTS})
        assert abs(sum(s[part] for part in PARTS) - window) <= 1e-6 * window + 1e-9, (r["name"], {part: s[part] for part in PARTS})
        assert 0 <= s["host_wait_seconds"] <= s["idle_seconds"] + 1e-9, (r["name"], s["host_wait_seconds"], s["idle_seconds"])
        assert close(s["gpu_compute_seconds"], r["own_compute"]), (r["name"], s["gpu_compute_seconds"], r["own_compute"])


def test_one_collective_per_nccl_kernel_sharing_the_step_figures(traced):
    """One collective per NCCL kernel the step owns, at its GPU times; their exposed and overlapped parts add up to the step's."""
    _, ref, steps = traced
    for r, s in zip(ref, steps, strict=True):
        collectives = sorted(s["collectives"], key=lambda c: (c["start_seconds"], c["end_seconds"]))
        assert len(collectives) == len(r["nccl"]), (r["name"], len(collectives), len(r["nccl"]))
        for c, (start, end) in zip(collectives, r["nccl"]):
            assert abs(c["start_seconds"] - (start - r["start"])) <= 2e-6, (r["name"], c["name"], c["start_seconds"], start - r["start"])
            assert abs(c["end_seconds"] - (end - r["start"])) <= 2e-6, (r["name"], c["name"], c["end_seconds"], end - r["start"])
        assert close(sum(c["exposed_seconds"] for c in collectives), s["exposed_comm_seconds"]), r["name"]
        assert close(sum(c["overlapped_seconds"] for c in collectives), s["overlapped_comm_seconds"]), r["name"]


def test_nccl_kernels_launched_in_autograd_are_backward(traced):
    """An NCCL kernel launched inside autograd's evaluate_function (same thread) is in the backward phase."""
    _, ref, steps = traced
    for r, s in zip(ref, steps, strict=True):
        collectives = sorted(s["collectives"], key=lambda c: (c["start_seconds"], c["end_seconds"]))
        assert {c["phase"] for c in collectives} <= PHASES, (r["name"], [c["phase"] for c in collectives])
        assert len(collectives) == len(r["backward"]), r["name"]
        for c, backward in zip(collectives, r["backward"]):
            if backward:
                assert c["phase"] == "backward", (r["name"], c["name"], c["start_seconds"], c["phase"])


def test_what_each_step_is_bound_by(traced):
    """The A100 DDP trace's steps wait on the host; none of the V100 all-to-all trace's do."""
    name, _, steps = traced
    assert {s["bound_by"] for s in steps} <= BOUNDS
    if name.startswith("a100_"):
        assert [s["bound_by"] for s in steps] == ["host"] * len(steps)
    if name.startswith("v100_"):
        assert "host" not in [s["bound_by"] for s in steps]


def test_the_v100_trace_exposes_milliseconds_of_nccl(traced):
    """The V100 trace's NCCL kernels alone leave over 5 ms a step exposed (10-12.7 ms): a reader returning 0s fails here."""
    name, ref, steps = traced
    if not name.startswith("v100_"):
        pytest.skip("the V100 trace's figure")
    assert max(r["exposed"] for r in ref) > 0.005
    assert max(s["exposed_comm_seconds"] for s in steps) > 0.005


def test_a_file_that_is_not_a_trace_is_a_usage_error(tmp_path):
    """A text file given as the trace: exit status 2 and one line on stderr."""
    path = tmp_path / "notes.json"
    path.write_text("these are my notes, not a profiler trace\n")
    done = subprocess.run([sys.executable, "-m", "ddp", "trace", str(path), "--json", str(tmp_path / "out.json")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
