"""The benchmark harness itself (not timed): running out of memory is a skip the rank group
survives, the timing loop adds rounds until the median is resolved, records take the slowest
rank, and test ids stay stable for comparisons."""

from __future__ import annotations

import time

import pytest
import torch

from ddp.bench.allreduce import busbw_gbps
from ddp.bench.measure import Measurement, MeasuredOutOfMemory, RoundPolicy, measure, timed_rounds
from ddp.bench.records import step_record
from ddp.bench.config import StepConfig
from ddp.bench.rank_state import oom_reason, release
from ddp.bench.trainer import StepSetup, StepTiming
from ddp.model import build_model
from ddp.launcher import rank_info
from ddp.strategies.local import LocalTraining
from ddp.strategies.overlap import OverlapDDP


class OutOfMemoryDDP(LocalTraining):
    """A strategy whose forward runs out of memory, as xl at batch 4 x 512 tokens does on a GPU."""

    def forward(self, *args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")


def test_out_of_memory_is_reported_and_the_group_survives(rank_group) -> None:
    config = StepConfig(f"{__name__}:OutOfMemoryDDP", "tiny", batch_size=2, seq_len=16)
    starts = rank_group.starts if rank_group.started else rank_group.starts + 1
    result = measure(rank_group, [config], RoundPolicy.fixed(2, 0))
    assert isinstance(result, MeasuredOutOfMemory)
    reason = oom_reason(config, rank_group.world_size, result.marker)
    assert "batch 2 per rank, seq len 16" in reason and "Tried to allocate 20.00 GiB" in reason
    # The ranks freed their state and answer the next call without being replaced.
    working = StepConfig("local", "tiny", batch_size=2, seq_len=16)
    measured = measure(rank_group, [working], RoundPolicy.fixed(2, 0))
    assert isinstance(measured, Measurement) and len(measured.rounds) == 2
    assert measured.setups[0][0].num_parameters == sum(p.numel() for p in build_model("tiny").parameters())
    assert rank_group.starts == starts
    rank_group.run(release)


class OutOfMemoryOnRankOneInBackward(OverlapDDP):
    """Runs out of memory on rank 1 only, halfway through backward, after launching some of its
    all-reduces: rank 0 then waits in finish_gradient_synchronization() for collectives rank 1
    will never join. The first steps (the warm-up) succeed."""

    steps_before_failing = 2  # the warm-up step and the first timed round succeed

    def __init__(self, module, **options) -> None:
        super().__init__(module, **options)
        self._gradients_seen = 0
        self._steps = 0
        for param in list(self.parameters_to_sync)[::2]:
            param.register_post_accumulate_grad_hook(self._maybe_run_out)

    def forward(self, *args, **kwargs):
        self._steps += 1
        return super().forward(*args, **kwargs)

    def _maybe_run_out(self, param) -> None:
        self._gradients_seen += 1
        if rank_info().rank == 1 and self._steps > self.steps_before_failing and self._gradients_seen % 3 == 0:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory on one rank only. Tried to allocate 1.00 GiB")


def test_out_of_memory_on_one_rank_mid_backward_is_reported_quickly_and_the_next_benchmark_runs(rank_group) -> None:
    if rank_group.world_size < 2:
        pytest.skip("needs 2 ranks or more: one runs out of memory while another waits for it")
    config = StepConfig(f"{__name__}:OutOfMemoryOnRankOneInBackward", "tiny", batch_size=2, seq_len=16)
    began = time.monotonic()
    result = measure(rank_group, [config], RoundPolicy.fixed(3, 0))
    assert time.monotonic() - began < 60, "the ranks must not wait out the launcher's timeout"
    assert isinstance(result, MeasuredOutOfMemory) and result.marker.rank == 1
    assert "one rank only" in oom_reason(config, rank_group.world_size, result.marker)
    starts = rank_group.starts
    measured = measure(rank_group, [StepConfig("local", "tiny", batch_size=2, seq_len=16)], RoundPolicy.fixed(2, 0))
    assert isinstance(measured, Measurement) and len(measured.rounds) == 2
    assert rank_group.starts == starts + 1, "rank 0 was stuck in a collective: the group must have been replaced"
    rank_group.run(release)


def test_bucket_size_only_for_bucketed_strategies() -> None:
    with pytest.raises(ValueError, match="takes no bucket size"):
        StepConfig("naive", "tiny", 2, 16, bucket_size_mb=25.0)
    with pytest.raises(ValueError, match="needs bucket_size_mb"):
        StepConfig("bucketed", "tiny", 2, 16)


def test_ids_are_stable() -> None:
    assert StepConfig("bucketed", "xl", 2, 128, bucket_size_mb=25.0).test_id == "bucketed-b2-s128-bucket25mb"
    assert StepConfig("torch", "xl", 4, 512, bucket_size_mb=0.1).test_id == "torch-b4-s512-bucket0.1mb"
    assert StepConfig("naive", "xl", 2, 128).test_id == "naive-b2-s128"


class _Timing:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds


def test_rounds_are_added_until_the_median_is_resolved() -> None:
    steady = iter([1.0, 1.001, 0.999, 1.0, 1.0005, 0.9995, 1.0, 1.0] * 10)
    policy = RoundPolicy(min_rounds=5, max_rounds=50, warmup_rounds=0, target_precision=0.01, budget_seconds=1e9)
    rounds, precision = timed_rounds(lambda i: [[_Timing(next(steady))]], policy)
    assert len(rounds) == 5 and precision <= 0.01  # resolved as soon as min_rounds have run
    noisy = iter([1.0, 2.0, 0.5, 3.0] * 20)
    rounds, precision = timed_rounds(lambda i: [[_Timing(next(noisy))]], policy)
    assert len(rounds) == 50 and precision > 0.01  # never resolved: stops at max_rounds
    budgeted = RoundPolicy(min_rounds=3, max_rounds=50, warmup_rounds=0, target_precision=0.01, budget_seconds=10.0)
    noisy = iter([1.0, 2.0, 0.5, 3.0] * 20)
    rounds, _ = timed_rounds(lambda i: [[_Timing(next(noisy))]], budgeted)
    assert len(rounds) == 7  # 1 + 2 + 0.5 + 3 + 1 + 2 + 0.5 = 10 seconds


def test_record_takes_the_slowest_rank_of_each_round_and_pairs_local() -> None:
    config = StepConfig("naive", "tiny", batch_size=2, seq_len=8)
    setup = StepSetup(0, 10, 2, None, 3, 40)
    # per round: [naive on ranks 0 and 1], [local on ranks 0 and 1]
    rounds = [
        [[StepTiming(0, 1.0, 0.25, None), StepTiming(1, 2.0, 0.5, None)], [StepTiming(0, 0.5, 0, None), StepTiming(1, 1.0, 0, None)]],
        [[StepTiming(0, 3.0, 1.0, None), StepTiming(1, 1.0, 0.0, None)], [StepTiming(0, 2.0, 0, None), StepTiming(1, 1.5, 0, None)]],
        [[StepTiming(0, 2.0, 0.5, None), StepTiming(1, 4.0, 1.0, None)], [StepTiming(0, 1.0, 0, None), StepTiming(1, 3.5, 0, None)]],
    ]
    measurement = Measurement([config, config.local_twin()], [[setup, setup], [setup, setup]], rounds, 0.5, 0.02)
    record = step_record(measurement, "gloo", "cpu", 0, 1)
    assert record.round_seconds == [2.0, 3.0, 4.0] and record.step_seconds == 3.0
    assert record.local_round_seconds == [1.0, 2.0, 3.5]
    assert record.overhead_seconds == pytest.approx(1.0)  # median of 1.0, 1.0, 0.5
    assert record.rank_step_seconds == [2.0, 2.0]
    assert record.comm_wait_seconds == 1.0  # the slowest rank's wait: 0.5, 1.0, 1.0
    assert record.tokens_per_second == pytest.approx(2 * 2 * 8 / 3.0)


def test_busbw_is_algbw_times_2_n_minus_1_over_n() -> None:
    assert busbw_gbps(10**9, 1.0, 2) == pytest.approx(1.0)
    assert busbw_gbps(10**9, 1.0, 4) == pytest.approx(1.5)
