"""The harness's pure units, without ranks: the timing loop's stopping rule, records that take the
slowest rank and pair ``local``, stable test ids, bucket sizes only where a strategy takes them,
and the all-reduce benchmark's bandwidths and its check of every sum."""

from __future__ import annotations

import pytest
import torch

from ddp.bench.config.options import RoundOptions
from ddp.bench.config.step_config import StepConfig
from ddp.bench.rounds.allreduce import AllReduceTiming, algbw_gbps, busbw_gbps, measure_all_reduces, wrong_elements
from ddp.bench.rounds.loop import Measurement, timed_rounds
from ddp.bench.rounds.summary import step_record
from ddp.bench.rounds.trainer import StepSetup, StepTiming


def test_bucket_size_only_for_bucketed_strategies() -> None:
    with pytest.raises(ValueError, match="takes no bucket_size_mb"):
        StepConfig("naive", "tiny", 2, 16, bucket_size_mb=25.0)
    with pytest.raises(ValueError, match="needs --bucket-size-mb"):
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
    policy = RoundOptions(min_rounds=5, max_rounds=50, warmup_rounds=0, target_precision=0.01, budget_seconds=1e9)
    rounds, precision = timed_rounds(lambda i: [[_Timing(next(steady))]], policy)
    assert len(rounds) == 5 and precision <= 0.01  # resolved as soon as min_rounds have run
    noisy = iter([1.0, 2.0, 0.5, 3.0] * 20)
    rounds, precision = timed_rounds(lambda i: [[_Timing(next(noisy))]], policy)
    assert len(rounds) == 50 and precision > 0.01  # never resolved: stops at max_rounds
    budgeted = RoundOptions(min_rounds=3, max_rounds=50, warmup_rounds=0, target_precision=0.01, budget_seconds=10.0)
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
    assert record.sync_wait_seconds == 1.0  # the slowest rank's wait: 0.5, 1.0, 1.0
    assert record.exposed_comm_seconds is None and record.bound_by is None  # nothing traced
    assert record.tokens_per_second == pytest.approx(2 * 2 * 8 / 3.0)


@pytest.mark.parametrize("strategy, precision, dtype", [("fsdp", "bf16", "bfloat16"), ("torch_fsdp", "bf16", "bfloat16"),
                                                      ("fsdp", "fp32", None), ("naive", "bf16", None)])
def test_the_record_names_the_dtype_a_sharded_strategy_computed_in(strategy, precision, dtype) -> None:
    config = StepConfig(strategy, "tiny", batch_size=2, seq_len=8, precision=precision)
    setup = StepSetup(0, 10, 2, None, 3, 40)
    rounds = [[[StepTiming(0, 1.0, 0.0, None), StepTiming(1, 1.0, 0.0, None)]]] * 3
    record = step_record(Measurement([config], [[setup, setup]], rounds, 0.5, 0.02), "gloo", "cpu", 0, None)
    assert record.compute_dtype == dtype


def test_busbw_is_algbw_times_2_n_minus_1_over_n() -> None:
    assert busbw_gbps(10**9, 1.0, 2) == pytest.approx(1.0)
    assert busbw_gbps(10**9, 1.0, 4) == pytest.approx(1.5)


def test_bandwidths_by_hand() -> None:
    # 100 MB in 50 ms: algbw 2 GB/s; on 8 ranks a ring moves 2 x 7/8 of it over each link: busbw 3.5 GB/s
    assert algbw_gbps(100 * 10**6, 0.05) == pytest.approx(2.0)
    assert busbw_gbps(100 * 10**6, 0.05, 8) == pytest.approx(3.5)


def test_a_wrong_sum_is_counted() -> None:
    world_size = 3
    summed = torch.full((1000,), 1.0 + 2.0 + 3.0)  # what all_reduce(SUM) leaves of rank + 1 on 3 ranks
    assert wrong_elements(summed, world_size) == 0
    summed[999] = float("nan")
    assert wrong_elements(summed, world_size) == 1  # a NaN alone: both ends of aminmax are NaN
    summed[17] = 5.0
    assert wrong_elements(summed, world_size) == 2
    summed[:] = 7.0
    assert wrong_elements(summed, world_size) == 1000


class _RanksReturning:
    """Stands in for a rank group whose ranks return ``timings`` for every all-reduce round."""

    backend, world_size = "gloo", 2

    def __init__(self, timings: list[AllReduceTiming]) -> None:
        self.timings = timings

    def run(self, fn, *args, **kwargs) -> list:
        return [[timing] for timing in self.timings] if fn.__name__ == "timed_all_reduces" else [None] * self.world_size


def test_a_corrupted_all_reduce_fails_the_benchmark() -> None:
    policy = RoundOptions.fixed(2, 0)
    good = measure_all_reduces(_RanksReturning([AllReduceTiming(0, 0.01, 0), AllReduceTiming(1, 0.02, 0)]), [4096], policy)
    assert good[0].wrong == 0 and good[0].seconds == 0.02  # the slowest rank's time
    # one timed round and the warm-up round every measurement takes (the first all-reduce connects
    # gloo's pairs): each counted
    with pytest.raises(RuntimeError, match="2 elements of 1024 held a wrong sum"):
        measure_all_reduces(_RanksReturning([AllReduceTiming(0, 0.01, 0), AllReduceTiming(1, 0.02, 1)]), [4096],
                            RoundOptions.fixed(1, 0))
