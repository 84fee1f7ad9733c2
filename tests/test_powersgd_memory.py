"""``torch_powersgd``'s memory prediction against what it holds: MemTracker cannot see it (its
error feedback is allocated in a callback on gloo's worker thread), so its state is counted
directly: DDP's buckets, the error feedback of every bucket, its Ps and Qs."""

from __future__ import annotations

import torch

from ddp.bench.config.step_config import StepConfig
from ddp.bench.memory.predict import model_shape, step_buffers
from ddp.launcher import Rank, on_rank
from ddp.model import build_model
from ddp.strategies.registry import make_ddp


@on_rank
def powersgd_state_bytes(rank: Rank, bucket_size_mb: float) -> dict[str, int]:
    """Runs on every rank: four steps of ``torch_powersgd`` on ``mini`` (compressing from the third),
    then the bytes of its buckets and PowerSGD's state."""
    torch.manual_seed(0)
    model = make_ddp("torch_powersgd", build_model("mini"), bucket_size_mb=bucket_size_mb)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    tokens = torch.randint(0, 256, (2, 32))
    for _ in range(4):
        model(tokens).float().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    state = model.state
    return {"buckets": sum(model.bucket_sizes_bytes),
            "error_feedback": sum(t.numel() * t.element_size() for t in state.error_dict.values()),
            "ps_and_qs": sum(t.numel() * t.element_size() for d in (state.p_memory_dict, state.q_memory_dict) for t in d.values())}


def test_powersgd_holds_what_its_prediction_keeps(rank_group):
    held = rank_group.run(powersgd_state_bytes, 1.0)[0]
    config = StepConfig("torch_powersgd", "mini", 2, 32, 1.0)
    predicted = step_buffers(config, model_shape(config), rank_group.world_size).kept_bytes
    total = held["buckets"] + held["error_feedback"] + held["ps_and_qs"]
    assert held["error_feedback"] == held["buckets"]  # every bucket compressed: an error tensor its size
    assert abs(predicted - total) <= 0.01 * total, f"predicted {predicted:,} B kept, holds {held}"
