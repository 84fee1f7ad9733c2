"""The benchmark harness itself (not timed): running out of memory is a skip the rank group
survives, summaries take the slowest rank, and test ids stay stable for ``--benchmark-compare``."""

from __future__ import annotations

import pytest
import torch

import ddp
from ddp.allreduce import busbw_gbps
from ddp.benchmark import (
    OutOfMemory,
    StepConfig,
    StepTiming,
    first_out_of_memory,
    oom_reason,
    prepare_step,
    release_step,
    summarize,
)


class OutOfMemoryDDP(ddp.LocalTraining):
    """A strategy whose forward runs out of memory, as xl at batch 4 x 512 tokens does on a GPU."""

    def forward(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")


def test_out_of_memory_is_reported_and_the_group_survives(rank_group) -> None:
    config = StepConfig(f"{__name__}:OutOfMemoryDDP", "tiny", batch_size=2, seq_len=16)
    starts = rank_group.starts if rank_group.started else rank_group.starts + 1
    results = rank_group.run(prepare_step, config)
    marker = first_out_of_memory(results)
    assert marker is not None and all(isinstance(r, OutOfMemory) for r in results)
    reason = oom_reason(config, rank_group.world_size, marker)
    assert "batch 2 per rank, seq len 16" in reason and "Tried to allocate 20.00 GiB" in reason
    # The ranks freed their state and answer the next call without being replaced.
    working = StepConfig("local", "tiny", batch_size=2, seq_len=16)
    setups = rank_group.run(prepare_step, working)
    assert first_out_of_memory(setups) is None
    assert setups[0].num_parameters == sum(p.numel() for p in ddp.model.build_model("tiny").parameters())
    assert rank_group.starts == starts
    rank_group.run(release_step)


def test_bucket_size_only_for_bucketed_strategies() -> None:
    with pytest.raises(ValueError, match="takes no bucket size"):
        StepConfig("naive", "tiny", 2, 16, bucket_size_mb=25.0)
    with pytest.raises(ValueError, match="needs bucket_size_mb"):
        StepConfig("bucketed", "tiny", 2, 16)


def test_ids_are_stable() -> None:
    assert StepConfig("bucketed", "xl", 2, 128, bucket_size_mb=25.0).test_id == "bucketed-b2-s128-bucket25mb"
    assert StepConfig("torch", "xl", 4, 512, bucket_size_mb=0.1).test_id == "torch-b4-s512-bucket0.1mb"
    assert StepConfig("naive", "xl", 2, 128).test_id == "naive-b2-s128"


def test_summary_takes_the_slowest_rank_of_each_round() -> None:
    config = StepConfig("naive", "tiny", batch_size=2, seq_len=8)
    rounds = [
        [StepTiming(0, 1.0, 0.25, None), StepTiming(1, 2.0, 0.5, None)],
        [StepTiming(0, 3.0, 1.0, None), StepTiming(1, 1.0, 0.0, None)],
        [StepTiming(0, 2.0, 0.5, None), StepTiming(1, 4.0, 1.0, None)],
    ]
    summary = summarize(config, 2, rounds)
    assert summary.step_seconds == 3.0  # slowest per round: 2, 3, 4
    assert summary.rank_step_seconds == [2.0, 2.0]
    assert summary.comm_wait_seconds == 1.0 and summary.comm_fraction == pytest.approx(1 / 3)
    assert summary.tokens_per_second == pytest.approx(2 * 2 * 8 / 3.0)


def test_busbw_is_algbw_times_2_n_minus_1_over_n() -> None:
    assert busbw_gbps(10**9, 1.0, 2) == pytest.approx(1.0)
    assert busbw_gbps(10**9, 1.0, 4) == pytest.approx(1.5)
