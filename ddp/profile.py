"""``python -m ddp profile``: a few training steps under ``torch.profiler`` on every rank, and how
much of the gradient communication the backward pass hides.

This file owns the profiled step (phases "forward", "backward", "gradient_sync", "optimizer" as
profiler ranges, and NVTX ranges of the same names on CUDA, so Nsight Systems shows the same
phases), the per-rank Chrome/Perfetto traces, the interval arithmetic behind ``summary.json``, and
the command line. The timeline figures are drawn by ``ddp.timeline`` from the saved JSON.

What is measured, per rank and per profiled step, all on the ``time.perf_counter`` clock (one
clock for every rank, since ``RankGroup`` runs them on one host):

- every collective from launch to completion: ``ddp.tracing`` spans (gloo completes the work's
  future on its own thread, which stamps the completion). For ``torch`` a DDP comm hook launches
  the all-reduce through ``ddp.tracing`` too, so PyTorch's reducer is measured the same way;
- backward compute: from the call of ``loss.backward()`` to the moment the last gradient was
  computed (a tensor hook on every parameter, which runs before the strategies' hooks). For our strategies that is where ``loss.backward()``
  returns, within microseconds; PyTorch's reducer waits for its all-reduces inside
  ``loss.backward()``, and a window that ended on return would count that wait as compute.

On CUDA the work's future completes when NCCL's kernel is enqueued, not when it ends, so there
the intervals come from the trace instead: NCCL kernels for communication, the other kernels
launched inside the "backward" range for backward compute.

Then, per step: ``comm_seconds`` is the length of the union of the collectives' intervals,
``overlap_fraction`` the share of it inside the backward-compute window, and
``exposed_comm_seconds`` the rest.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from tabulate import tabulate

import ddp
from ddp import tracing
from ddp.base import trainable_parameters
from ddp.launcher import RankGroup, rank_info
from ddp.model import MODEL_SIZES, build_model, language_model_loss, random_batch

PHASES = ("forward", "backward", "gradient_sync", "optimizer")
# How long to wait, after a step, for completion stamps that gloo's thread has yet to write: wait()
# may return before the future's callbacks have run.
COMPLETION_STAMP_TIMEOUT_SECONDS = 10.0
# Thread id of the track that add_collective_track adds to each trace; no real thread has it.
COLLECTIVE_TRACK_TID = 1_000_000_000

Interval = tuple[float, float]


@dataclass(frozen=True)
class ProfileConfig:
    strategy: str
    """A name from ddp.STRATEGIES."""
    model_size: str = "small"
    """A name from ddp.model.MODEL_SIZES."""
    batch_size: int = 2
    """Sequences per rank per step."""
    seq_len: int = 64
    """Tokens per sequence."""
    bucket_size_mb: float = 25.0
    """Bucket cap in MiB, for the strategies that take one (bucketed, torch)."""
    warmup_steps: int = 1
    """Steps run before profiling, untraced (allocations, first-step copies, DDP's bucket rebuild)."""
    steps: int = 2
    """Steps profiled and summarised."""
    out_dir: str = "profile"
    """Folder for the traces; on the ranks' host."""


# ---------------------------------------------------------------------------------------------
# Interval arithmetic (seconds)


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
    """comm, overlapped and exposed seconds of one step record (see ``profile_rank``)."""
    comm = [(c["launch_seconds"], c["done_seconds"]) for c in step["collectives"]]
    comm_seconds = covered_seconds(comm)
    overlapped = covered_seconds_within(comm, (step["backward"][0], step["backward_compute_end"]))
    return {
        "comm_seconds": comm_seconds,
        "overlapped_comm_seconds": overlapped,
        "exposed_comm_seconds": comm_seconds - overlapped,
    }


def rank_figures(steps: list[dict]) -> dict:
    """Per-step means over the profiled steps of one rank; overlap_fraction is a ratio of totals.

    overlap_fraction is None when nothing was communicated (``local``).
    """
    n = len(steps)
    per_step = [step_comm_figures(step) for step in steps]
    totals = {key: sum(f[key] for f in per_step) for key in per_step[0]}
    figures = {
        "step_seconds": sum(s["optimizer"][1] - s["forward"][0] for s in steps) / n,
        **{f"{phase}_seconds": sum(s[phase][1] - s[phase][0] for s in steps) / n for phase in PHASES},
        "backward_compute_seconds": sum(s["backward_compute_end"] - s["backward"][0] for s in steps) / n,
        **{key: value / n for key, value in totals.items()},
        "overlap_fraction": (
            totals["overlapped_comm_seconds"] / totals["comm_seconds"] if totals["comm_seconds"] > 0 else None
        ),
        "collectives_per_step": sum(len(s["collectives"]) for s in steps) / n,
        "comm_bytes_per_step": sum(c["size_bytes"] for s in steps for c in s["collectives"]) / n,
    }
    return figures


def strategy_summary(rank_records: list[dict]) -> dict:
    """Figures of every rank, and at the top level those of the slowest rank (largest step time),
    whose exposed communication is the one the group actually waits for."""
    ranks = [{"rank": r["rank"], **rank_figures(r["steps"]), "trace_file": r["trace_file"]} for r in rank_records]
    slowest = max(ranks, key=lambda f: f["step_seconds"])
    keys = ("step_seconds", "comm_seconds", "overlap_fraction", "exposed_comm_seconds", "overlapped_comm_seconds")
    return {**{key: slowest[key] for key in keys}, "slowest_rank": slowest["rank"], "ranks": ranks}


# ---------------------------------------------------------------------------------------------
# On every rank


def _recorded_allreduce_hook(process_group, bucket):
    """PyTorch's default DDP hook (sum, then divide by world size), launched through
    ``ddp.tracing`` so that each bucket's launch and completion are recorded.

    Unannotated on purpose: DDP accepts only the real classes as annotations, and this module's
    ``from __future__ import annotations`` would turn them into strings.
    """
    world_size = dist.get_world_size(process_group)
    work = tracing.launch_all_reduce(bucket.buffer(), dist.ReduceOp.SUM, process_group, f"bucket{bucket.index()}")
    return work.get_future().then(lambda future: future.value()[0].div_(world_size))


@contextlib.contextmanager
def _phase(name: str, step: dict, on_cuda: bool) -> Iterator[None]:
    """A profiler range (and an NVTX range on CUDA) named ``name``, timed into ``step[name]``."""
    if on_cuda:
        torch.cuda.nvtx.range_push(name)
    start = time.perf_counter()
    try:
        with torch.profiler.record_function(name):
            yield
    finally:
        step[name] = [start, time.perf_counter()]
        if on_cuda:
            torch.cuda.nvtx.range_pop()


def _wait_for_completion_stamps(recorder: tracing.CollectiveRecorder) -> None:
    deadline = time.monotonic() + COMPLETION_STAMP_TIMEOUT_SECONDS
    while any(span.done_seconds is None for span in recorder.spans):
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{sum(s.done_seconds is None for s in recorder.spans)} collectives never reported completion "
                f"within {COMPLETION_STAMP_TIMEOUT_SECONDS:.0f} s after the step"
            )
        time.sleep(0.001)


def profile_rank(config: ProfileConfig) -> dict:
    """Runs on every rank: warm up, profile ``config.steps`` steps, write this rank's trace.

    Returns ``{"rank", "device", "trace_file", "steps"}``; each step holds ``[start, end]`` of every
    phase, ``backward_compute_end`` and its ``collectives``, in ``time.perf_counter`` seconds.
    """
    info = rank_info()
    on_cuda = info.device.type == "cuda"
    torch.manual_seed(0)
    module = build_model(config.model_size, device=info.device)
    options = {"bucket_size_mb": config.bucket_size_mb} if config.strategy in ddp.BUCKETED_STRATEGIES else {}
    model = ddp.make_ddp(config.strategy, module, **options)
    if config.strategy == "torch":
        # Must precede the first forward; replaces the reducer's built-in all-reduce with an
        # identical one whose launch and completion ddp.tracing can see.
        model.ddp.register_comm_hook(model.process_group, _recorded_allreduce_hook)
    gradient_times: list[float] = []
    # A tensor hook runs when the gradient has been computed, before it is accumulated and so
    # before any strategy's post-accumulate hook (or DDP's reducer) launches communication.
    for param in trainable_parameters(module):
        param.register_hook(lambda grad: gradient_times.append(time.perf_counter()))
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    generator = torch.Generator(info.device).manual_seed(info.rank)
    inputs, targets = random_batch(
        module.config, config.batch_size, config.seq_len, generator=generator, device=info.device
    )

    def train_step(step: dict) -> None:
        with _phase("forward", step, on_cuda):
            loss = language_model_loss(model(inputs), targets)
        gradient_times.clear()
        with _phase("backward", step, on_cuda):
            loss.backward()
        step["backward_compute_end"] = gradient_times[-1] if gradient_times else step["backward"][1]
        with _phase("gradient_sync", step, on_cuda):
            model.finish_gradient_synchronization()
        with _phase("optimizer", step, on_cuda):
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)  # keep gradients where bucketed strategies put them
            if on_cuda:
                torch.cuda.synchronize()  # steps must not run into each other on the GPU timeline

    for _ in range(config.warmup_steps):
        train_step({})
    dist.barrier()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if on_cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    steps: list[dict] = []
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(config.steps):
            step: dict = {}
            with tracing.recording() as recorder:
                train_step(step)
                _wait_for_completion_stamps(recorder)
            step["collectives"] = [asdict(span) for span in recorder.spans]
            steps.append(step)
            profiler.step()
    trace_file = Path(config.out_dir) / f"trace_{config.strategy}_rank{info.rank}.json"
    profiler.export_chrome_trace(str(trace_file))
    trace = json.loads(trace_file.read_text())
    if on_cuda:
        steps = cuda_steps_from_trace(trace["traceEvents"], steps)
    else:
        add_collective_track(trace, steps)
        trace_file.write_text(json.dumps(trace))
    return {"rank": info.rank, "device": str(info.device), "trace_file": str(trace_file), "steps": steps}


# ---------------------------------------------------------------------------------------------
# Traces


def trace_offset_us(events: list[dict], steps: list[dict]) -> float:
    """Trace time (µs) minus ``perf_counter`` time (µs), from the first profiled "forward" range,
    whose start was stamped on both clocks within microseconds."""
    forward = min((e for e in events if e.get("name") == "forward" and e.get("cat") == "user_annotation"), key=lambda e: e["ts"])
    return forward["ts"] - steps[0]["forward"][0] * 1e6


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


def cuda_steps_from_trace(events: list[dict], steps: list[dict]) -> list[dict]:
    """Step records whose phases and collectives are GPU time, read from a CUDA trace.

    A kernel belongs to the CPU range (phase) in which it was launched, through the launch's
    correlation id. Collectives are NCCL kernels; backward compute runs from the first to the last
    non-NCCL kernel launched inside "backward". Times stay on the ``perf_counter`` clock.
    """
    offset = trace_offset_us(events, steps)
    launch_us = {
        e["args"]["correlation"]: e["ts"]
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    kernels = []  # (launch, start, end) in perf_counter seconds, name
    for e in events:
        if e.get("cat") == "kernel" and e.get("args", {}).get("correlation") in launch_us:
            launch = (launch_us[e["args"]["correlation"]] - offset) / 1e6
            start = (e["ts"] - offset) / 1e6
            kernels.append((launch, start, start + e["dur"] / 1e6, e["name"]))
    gpu_steps = []
    for step in steps:

        def launched_in(window, nccl: bool):
            return [(s, e, name) for launch, s, e, name in kernels
                    if window[0] <= launch <= window[1] and ("nccl" in name.lower()) == nccl]

        gpu_step = {"collectives": [
            {"label": name, "size_bytes": 0, "launch_seconds": s, "done_seconds": e}
            for s, e, name in launched_in((step["forward"][0], step["optimizer"][1]), nccl=True)
        ]}
        for phase in PHASES:
            compute = launched_in(step[phase], nccl=False)
            # A phase that launched no kernel (gradient_sync of most strategies) keeps its CPU span.
            gpu_step[phase] = [min(s for s, _, _ in compute), max(e for _, e, _ in compute)] if compute else step[phase]
        gpu_step["backward_compute_end"] = gpu_step["backward"][1]
        gpu_steps.append(gpu_step)
    return gpu_steps


# ---------------------------------------------------------------------------------------------
# Command line


def timeline_record(strategy: str, summary: dict, rank_records: list[dict]) -> dict:
    """What ``ddp.timeline`` draws: every rank's steps, in seconds since the earliest rank's first step."""
    origin = min(r["steps"][0]["forward"][0] for r in rank_records)

    def shift(step: dict) -> dict:
        shifted = {phase: [t - origin for t in step[phase]] for phase in PHASES}
        shifted["backward_compute_end"] = step["backward_compute_end"] - origin
        shifted["collectives"] = [
            {**c, "launch_seconds": c["launch_seconds"] - origin, "done_seconds": c["done_seconds"] - origin}
            for c in step["collectives"]
        ]
        return shifted

    figures = {k: summary[k] for k in ("comm_seconds", "overlap_fraction", "exposed_comm_seconds", "slowest_rank")}
    return {
        "strategy": strategy,
        **figures,
        "ranks": [{"rank": r["rank"], "steps": [shift(s) for s in r["steps"]]} for r in rank_records],
    }


def profile_strategies(group: RankGroup, configs: list[ProfileConfig], out_dir: Path) -> dict:
    """Profile each configuration on ``group``; write summary.json, timelines (JSON and PNG)."""
    from ddp import timeline  # matplotlib is imported only when figures are drawn

    out_dir.mkdir(parents=True, exist_ok=True)
    summary: dict = {"world_size": group.world_size, "backend": group.backend, "device": group.device, "strategies": {}}
    timelines = []
    for config in configs:
        rank_records = group.run(profile_rank, config)
        entry = strategy_summary(rank_records)
        record = timeline_record(config.strategy, entry, rank_records)
        timeline_json = out_dir / f"timeline_{config.strategy}.json"
        timeline_json.write_text(json.dumps(record, indent=1))
        timeline_png = out_dir / f"timeline_{config.strategy}.png"
        timeline.plot_timeline(record, timeline_png)
        timelines.append(record)
        summary["strategies"][config.strategy] = {
            **entry,
            "config": asdict(config),
            "timeline_json": str(timeline_json),
            "timeline_png": str(timeline_png),
        }
    if len(timelines) > 1:
        combined = out_dir / "timeline_combined.png"
        timeline.plot_timelines(timelines, combined)
        summary["timeline_combined_png"] = str(combined)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def summary_table(summary: dict) -> str:
    """The figures a reader wants first, one row per strategy (slowest rank)."""
    rows = [
        [name, s["step_seconds"] * 1e3, s["comm_seconds"] * 1e3, s["overlap_fraction"],
         s["exposed_comm_seconds"] * 1e3, s["slowest_rank"]]
        for name, s in summary["strategies"].items()
    ]
    headers = ["strategy", "step_ms", "comm_ms/step", "overlap_fraction", "exposed_comm_ms/step", "slowest_rank"]
    return tabulate(rows, headers=headers, floatfmt=("", ".0f", ".0f", ".2f", ".0f", ""), missingval="-")


def _strategy_list(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    for name in names:
        if name not in ddp.STRATEGIES:
            raise argparse.ArgumentTypeError(f"unknown strategy {name!r}: choose from {', '.join(ddp.STRATEGIES)}")
    if len(set(names)) != len(names) or not names:
        raise argparse.ArgumentTypeError(f"give each strategy once, comma-separated (e.g. naive,flat), got {text!r}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = ProfileConfig(strategy="naive")
    parser.add_argument("--strategy", required=True, type=_strategy_list,
                        help=f"one strategy or a comma list, from: {', '.join(ddp.STRATEGIES)}")
    parser.add_argument("--model-size", default=defaults.model_size, choices=list(MODEL_SIZES),
                        help=f"default: {defaults.model_size}")
    parser.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"),
                        help="auto = nccl with one GPU per rank, else gloo (default: auto)")
    parser.add_argument("--world-size", type=int, default=2, help="number of ranks (default: 2)")
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size,
                        help=f"sequences per rank per step (default: {defaults.batch_size})")
    parser.add_argument("--seq-len", type=int, default=defaults.seq_len,
                        help=f"tokens per sequence (default: {defaults.seq_len})")
    parser.add_argument("--bucket-size-mb", type=float, default=defaults.bucket_size_mb,
                        help=f"bucket cap in MiB for bucketed and torch (default: {defaults.bucket_size_mb})")
    parser.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps,
                        help=f"untraced steps before profiling (default: {defaults.warmup_steps})")
    parser.add_argument("--steps", type=int, default=defaults.steps,
                        help=f"profiled steps (default: {defaults.steps})")
    parser.add_argument("--out", required=True, type=Path, help="folder for traces, summary.json and timelines")


def main(args: argparse.Namespace) -> int:
    if args.steps < 1 or args.warmup_steps < 0:
        raise SystemExit(f"--steps must be at least 1 and --warmup-steps at least 0, got {args.steps} and {args.warmup_steps}")
    configs = [
        ProfileConfig(
            strategy=name, model_size=args.model_size, batch_size=args.batch_size, seq_len=args.seq_len,
            bucket_size_mb=args.bucket_size_mb, warmup_steps=args.warmup_steps, steps=args.steps,
            out_dir=str(args.out.resolve()),
        )
        for name in args.strategy
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    with RankGroup(args.world_size, args.backend) as group:
        summary = profile_strategies(group, configs, args.out)
    print(summary_table(summary))
    print(f"\nwrote {args.out / 'summary.json'}, traces trace_<strategy>_rank<r>.json and timeline_<strategy>.png")
    return 0
