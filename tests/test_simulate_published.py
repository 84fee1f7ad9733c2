"""``ddp simulate`` held to measured tables no one here wrote (tests/simulate_published.py: PyTorch's
DDP benchmark of resnet50 on DGX-1s), an 8B FSDP job described by hand, and the documented table."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from ddp.cli import main as ddp_main
from tests import llama, resnet, simulate_published

DOC = Path(__file__).resolve().parents[1] / "docs" / "torchrun-and-simulate.md"


@pytest.fixture(scope="module")
def resnet_predictions():
    return simulate_published.resnet_predictions()


def test_resnet50_has_torchvisions_parameters() -> None:
    with torch.device("meta"):
        model, _, _ = resnet.build(32, 1)
    params = list(model.parameters())
    assert (len(params), sum(p.numel() for p in params)) == (161, 25_557_032)


def test_resnet50_ddp_overhead_within_30_percent_at_2_to_16_gpus(resnet_predictions) -> None:
    for n in (2, 4, 8, 16):
        measured = simulate_published.DDP_25MB_P50_SECONDS[n] - simulate_published.NO_DDP_SECONDS
        predicted = resnet_predictions[(25.0, n)].step_seconds - simulate_published.NO_DDP_SECONDS
        assert abs(predicted / measured - 1) <= 0.30, (n, predicted, measured)


def test_one_mb_buckets_are_slower_than_25_mb_at_8_and_16_gpus(resnet_predictions) -> None:
    for n in (8, 16):
        assert resnet_predictions[(1.0, n)].step_seconds > resnet_predictions[(25.0, n)].step_seconds, n


def test_the_documented_table_is_what_the_command_renders(resnet_predictions) -> None:
    text = DOC.read_text()
    begin, end = text.index(simulate_published.BEGIN), text.index(simulate_published.END)
    documented = text[begin + len(simulate_published.BEGIN):end].strip()
    assert documented == simulate_published.table(resnet_predictions), "run: python -m tests.simulate_published --doc " + str(DOC)


def test_an_8b_fsdp_job_by_hand_gives_every_term_within_a_minute(tmp_path) -> None:
    with torch.device("meta"):
        model, _, _ = llama.build(2, 16)
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248
    out = tmp_path / "out.json"
    started = time.perf_counter()
    assert ddp_main([
        "simulate", "--model", "tests.llama:build", "--strategies", "torch_fsdp", "--precision", "bf16",
        "--activation-checkpointing", "blocks", "--batch-size", "2", "--seq-len", "8192", "--measured-step-ms", "8:3000",
        "--world-sizes", "128", "--gpus-per-node", "8", "--link", "nvlink-h100", "--inter-link", "ib-400g", "--json", str(out),
    ]) == 0
    assert time.perf_counter() - started < 60
    rows = {row["world_size"]: row for row in json.loads(out.read_text())}
    terms = ("compute_seconds", "fixed_step_seconds", "fixed_collective_seconds", "rank_wait_seconds",
             "exposed_comm_seconds", "overlap_slowdown_seconds")
    for row in rows.values():
        assert row["strategy"] == "torch_fsdp" and row["collectives_per_step"] == 3 * (32 + 1)
        assert row["step_seconds"] == pytest.approx(sum(row[t] for t in terms))
    assert rows[8]["step_seconds"] == pytest.approx(3.0)  # calibrated on the measured 8-GPU step
    assert rows[8]["step_seconds"] < rows[128]["step_seconds"] < 1.05 * rows[8]["step_seconds"]
