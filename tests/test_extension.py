"""A new strategy is one file: ``ChunkedDDP`` below is defined here and registered nowhere else,
and it runs through the correctness suite, a race, the perf grid (``pytest perf_tests``), the
report with its plots, and the simulator, with no edit outside this file. Everything those tools
know of a strategy is what its class says about itself (``ddp.strategies.base.Strategy``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from correctness_tests.models import MODEL_CASES
from correctness_tests.training import train_against_reference
from ddp.bench.config.options import RoundOptions
from ddp.bench.results.records import load_run
from ddp.bench.rounds.race import race
from ddp.cli import main as ddp_main
from ddp.strategies.base import DataParallel
from ddp.strategies.declarations import Transfer

ROOT = Path(__file__).parents[1]
NAME = f"{__name__}:ChunkedDDP"


class ChunkedDDP(DataParallel):
    """After backward, every gradient flattened into one buffer and all-reduced in chunks of at most
    ``bucket_size_mb``, one after the other."""

    steps_to_settle = 1  # nothing is planned from a first step
    line_style = "-."

    def __init__(self, module, *, bucket_size_mb: float = 25.0, process_group=None) -> None:
        super().__init__(module, process_group=process_group)
        self.bucket_size_mb = bucket_size_mb

    @classmethod
    def communication_schedule(cls, gradients, ready_seconds, backward_seconds, bucket_size_mb):
        total, cap = sum(g.size_bytes for g in gradients), max(4, int(bucket_size_mb * 2**20))
        return [Transfer(backward_seconds, min(cap, total - start)) for start in range(0, total, cap)]

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        if not self._sync_this_backward:
            return
        params = self.parameters_to_sync
        self._all_reduce_used_mask([p.grad is not None for p in params]).wait()
        synced = [p for p, used in zip(params, self.used_somewhere()) if used]
        if not synced:
            return
        for param in synced:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        flat = torch.cat([p.grad.reshape(-1) for p in synced])
        chunk = max(1, int(self.bucket_size_mb * 2**20) // flat.element_size())
        for piece in flat.split(chunk):
            dist.all_reduce(piece, op=dist.ReduceOp.AVG)
        offset = 0
        for param in synced:
            param.grad.copy_(flat[offset : offset + param.numel()].view_as(param))
            offset += param.numel()


@pytest.mark.parametrize("model_name", list(MODEL_CASES))
def test_it_trains_like_one_process(rank_group, model_name):
    per_rank = rank_group.run(train_against_reference, NAME, "few_per_bucket", model_name, "adamw", 2)
    for params in per_rank[1:]:
        for mine, rank0 in zip(params, per_rank[0]):
            torch.testing.assert_close(mine, rank0, rtol=0, atol=0)


def test_it_races_against_bucketed_and_ends_with_the_same_weights(rank_group):
    result = race(rank_group, {"model": "tiny", "batch_size": 2, "seq_len": 16, "bucket_size_mb": 0.05}, RoundOptions.fixed(2, 0), contenders=(NAME, "bucketed"))
    record = result.record
    assert result.weights_differ is None
    assert record.contenders == ["local", NAME, "bucketed"] and record.reference == "bucketed"
    assert set(record.ratio_over_reference) == {NAME} and len(record.round_seconds[NAME]) == 2
    assert set(record.overhead_over_local_seconds) == {NAME, "bucketed"}


@pytest.mark.slow
def test_it_runs_through_the_perf_grid_the_report_the_plots_and_the_simulator(tmp_path):
    run = tmp_path / "run.json"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "perf_tests/test_step.py", "--model", "tiny",
         "--strategies", f"local,bucketed,{NAME}", "--batch-sizes", "2", "--seq-lens", "16", "--bucket-sizes", "0.05,1",
         "--rounds", "2", "--max-rounds", "2", "--warmup-rounds", "0", "--benchmark-json", str(run)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    mine = {s.config.bucket_size_mb: s for s in load_run(run).steps if s.strategy == NAME}
    assert set(mine) == {0.05, 1.0}
    assert all(s.bytes_per_step > 0 and s.collectives_per_step >= 2 for s in mine.values())  # counted: mask + chunks

    assert ddp_main(["report", str(run), "--out", str(tmp_path / "report")]) == 0
    report = (tmp_path / "report" / "report.md").read_text()
    assert f"| {NAME} 0.05 MiB" in report and f"| {NAME} 1 MiB" in report
    assert (tmp_path / "report" / "report_step_vs_bucket_seq16.png").read_bytes()[:4] == b"\x89PNG"

    predictions = tmp_path / "predictions.json"
    assert ddp_main(["simulate", "--from", str(run), "--link", "ib-400g", "--world-sizes", "2,64", "--json", str(predictions),
                     "--plot", str(tmp_path / "scaling.png")]) == 0
    predicted = [p for p in json.loads(predictions.read_text()) if p["strategy"] == NAME]
    assert {(p["bucket_size_mb"], p["world_size"]) for p in predicted} == {(0.05, 2), (0.05, 64), (1.0, 2), (1.0, 64)}
    # smaller chunks, more all-reduces after backward: more latency at 64 ranks
    at_64 = {p["bucket_size_mb"]: p for p in predicted if p["world_size"] == 64}
    assert at_64[0.05]["exposed_comm_seconds"] > at_64[1.0]["exposed_comm_seconds"] > 0
