"""The phase of a gloo collective is where it was launched: gloo runs each collective on a worker
thread of its own, where no forward, backward or optimizer range is, so a reading that took the
phase on that thread called every gloo collective ``other`` (PyTorch's DDP on ``tiny`` under the
profiler: ``('all_reduce 3', 'other', None)`` for every bucket)."""

from __future__ import annotations

import json

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, schedule

from ddp.bench.collectives.timeline import read_trace
from ddp.launcher import Rank, on_rank
from ddp.model import build_model
from ddp.strategies.registry import make_ddp


@on_rank
def traced_gloo_steps(rank: Rank, trace_path: str) -> list[dict]:
    """Runs on every rank: three profiled steps of PyTorch's DDP on ``tiny`` in small buckets,
    read by ``read_trace`` from rank 0's exported trace."""
    torch.manual_seed(0)
    model = make_ddp("torch", build_model("tiny"), bucket_size_mb=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    tokens = torch.randint(0, 256, (2, 16))

    def export(profiler) -> None:
        if rank.info.rank == 0:
            profiler.export_chrome_trace(trace_path)

    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=2),
                 on_trace_ready=export) as profiler:
        for _ in range(3):
            model(tokens).float().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            profiler.step()
    if rank.info.rank != 0:
        return []
    with open(trace_path) as trace:
        return read_trace(json.load(trace)).steps


def test_a_gloo_collective_takes_the_phase_it_was_launched_in(rank_group, tmp_path):
    if rank_group.backend != "gloo":
        pytest.skip("gloo's collectives only: NCCL launches its kernels from the caller's thread (tests/test_trace.py)")
    steps = rank_group.run(traced_gloo_steps, str(tmp_path / "trace.json"))[0]
    rows = [row for step in steps for row in step["collectives"]]
    phases = {(row["collective"], row["phase"]) for row in rows}
    assert sum(row["collective"] == "AllReduce" for row in rows) >= 8, "a few buckets' all-reduces a step"
    # the buckets' all-reduces from backward's hooks; DDP's buffer broadcast at the start of forward
    assert phases == {("AllReduce", "backward"), ("Broadcast", "forward")}, [(r["name"], r["phase"], r["range"]) for r in rows]
