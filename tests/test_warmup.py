"""How a fresh build is warmed up before its timed rounds (``ddp.bench.rounds.rank_state.RankBench._build``):
its plan's settling steps, then the steps that run anyway (its memory count, its traced steps) also
telling whether the step still changes, then plain steps while it does; the memory counted in those
steps is the count made after a separate warm-up. And two defects of the measurement core found by
reading: a build's timer on CUDA stopped before the device finished, and the tracer's fit decision
left out the timing groups' kept model copies."""

from __future__ import annotations

import types
from unittest import mock

import pytest
import torch

from ddp.bench.config.options import RoundOptions
from ddp.bench.config.step_config import StepConfig
from ddp.bench.rounds import grid_measurer, rank_state
from ddp.bench.rounds.grid_measurer import GridMeasurer
from ddp.bench.rounds.ledger import BUILDS, MEMORY_COUNTS, TRACED, WARMUP, Ledger
from ddp.bench.rounds.loop import Measurement
from ddp.bench.rounds.rank_state import MAX_WARMUP_STEPS, WARMUP_CHANGE, RankBench, still_changing
from ddp.bench.rounds.trainer import StepTiming, Trainer
from ddp.launcher import Rank, RankInfo, on_rank
from ddp.strategies.registry import steps_to_settle

BASE = dict(model="tiny", batch_size=2, seq_len=32, bucket_size_mb=1.0)


def test_a_step_still_changes_while_it_is_more_than_the_tolerance_faster_than_the_one_before():
    assert still_changing([]) and still_changing([0.3])  # fewer than two: nothing to compare yet
    assert still_changing([0.30, 0.30 * (1 - WARMUP_CHANGE) - 0.001])
    assert not still_changing([0.30, 0.30 * (1 - WARMUP_CHANGE) + 0.001])
    assert not still_changing([0.30, 0.33])  # slower is not getting faster


class _FakeTrainer:
    """Steps whose times follow ``seconds``, then stay at the last; a memory count of two steps."""

    states_its_collectives = True
    cuda = False

    def __init__(self, config, info, workloads=None, seconds=(1.0,)) -> None:
        self.config = config
        self.times = list(seconds)
        self.steps = 0
        self.memory = None
        self.traced = None

    def step(self, observer=None) -> StepTiming:
        seconds = self.times[min(self.steps, len(self.times) - 1)]
        self.steps += 1
        return StepTiming(0, seconds, 0.0, None)

    def count_memory(self) -> list[StepTiming]:
        timings = [self.step(), self.step()]
        self.memory = "counted"
        return timings


def _bench_with(seconds: list[float], device: str = "cpu") -> tuple[RankBench, RankInfo]:
    info = RankInfo(0, 1, "gloo", torch.device(device))
    bench = RankBench()
    bench.release = lambda *args, **kwargs: None  # nothing real to free
    return bench, info


@pytest.mark.parametrize("seconds, expected", [
    ([1.0, 1.0], 2),                      # steady from the first step: one to compare with
    ([2.0, 1.0, 0.99], 3),                # the first step slow, then steady
    ([3.0, 2.0, 1.4, 1.0, 1.0], 5),       # still getting faster for four steps
    ([5.0 * 0.7**i for i in range(20)], MAX_WARMUP_STEPS),  # never settles: capped
])
def test_a_fresh_build_warms_up_as_long_as_its_step_changes(seconds, expected):
    config = StepConfig.of("local", BASE)
    bench, info = _bench_with(seconds)
    with mock.patch.object(rank_state, "Trainer", lambda c, i, workloads=None: _FakeTrainer(c, i, seconds=seconds)):
        bench._build(info, [config], warmup_steps=0)
    assert bench.trainers[config].steps == expected == bench.ledger.count(config, WARMUP)


def test_the_memory_count_steps_are_the_warm_ups_last_and_tell_whether_it_settled():
    """The two steps under MemTracker follow the settling steps and compare with each other: a
    strategy that settles in three steps is counted and timed after five, not six."""
    config = StepConfig.of("torch", BASE)
    settle = steps_to_settle("torch")
    bench, info = _bench_with([1.0])
    with mock.patch.object(rank_state, "Trainer", lambda c, i, workloads=None: _FakeTrainer(c, i, seconds=[1.0])):
        bench._build(info, [config], warmup_steps=0, count_memory=True)
    trainer = bench.trainers[config]
    assert trainer.memory == "counted" and trainer.steps == settle + 2
    assert bench.ledger.count(config, WARMUP) == settle and bench.ledger.count(config, MEMORY_COUNTS) == 1


def test_a_fixed_warmup_trains_the_settling_steps_alone():
    config = StepConfig.of("bucketed", BASE)
    bench, info = _bench_with([3.0, 2.0, 1.0])
    with mock.patch.object(rank_state, "Trainer", lambda c, i, workloads=None: _FakeTrainer(c, i, seconds=[3.0, 2.0, 1.0])):
        bench._build(info, [config], warmup_steps=0, fixed_warmup=True)
    assert bench.trainers[config].steps == steps_to_settle("bucketed")


@on_rank
def memory_both_ways(rank: Rank, config: StepConfig) -> tuple:
    """``config``'s training state counted in its warm-up, and after a separate warm-up of as many
    steps (the count ``prepare`` made before it was folded into the warm-up)."""
    in_warmup = RankBench()
    in_warmup.prepare(rank.info, [config], warmup_steps=0, count_memory=True)
    counted = in_warmup.trainers[config].memory
    in_warmup.release(rank.info)
    trainer = Trainer(config, rank.info)
    try:
        for _ in range(steps_to_settle(config.strategy) + 2):
            trainer.step()
        trainer.count_memory()
        return counted, trainer.memory
    finally:
        trainer.close()


@pytest.mark.parametrize("strategy", ["local", "naive", "overlap", "bucketed", "torch"])
def test_memory_counted_in_the_warmup_is_the_count_made_after_it(rank_group, strategy):
    for in_warmup, after in rank_group.run(memory_both_ways, StepConfig.of(strategy, BASE)):
        assert in_warmup == after


def test_a_builds_timer_on_cuda_stops_once_the_device_has_finished_the_build():
    """On CUDA a build's allocations and initialising kernels are queued on the device: its timer
    stops after a synchronize, or the first warm-up step is charged for the build's work."""
    events = []
    config = StepConfig.of("local", BASE)
    bench, info = _bench_with([1.0], device="cuda")

    def trainer(c, i, workloads=None):
        events.append("build")
        return _FakeTrainer(c, i)

    real_add = bench.ledger.add

    def add(part, seconds, key=None, count=1):
        if part == BUILDS:
            events.append("builds timed")
        real_add(part, seconds, key, count)

    bench.ledger.add = add
    with mock.patch.object(rank_state, "Trainer", trainer), \
            mock.patch.object(rank_state, "_allocated_bytes", lambda info: 0), \
            mock.patch.object(torch.cuda, "synchronize", lambda device=None: events.append("synchronize")):
        bench._build(info, [config], warmup_steps=0)
    assert events[:3] == ["build", "synchronize", "builds timed"], events


class _Ranks:
    """Stands in for a group of ranks that records what it is asked to run."""

    world_size, backend, device, usable = 2, "gloo", "cuda", True

    def __init__(self) -> None:
        self.calls = []

    def run(self, fn, *args, **kwargs):
        self.calls.append(fn.__name__)
        return [Ledger(), Ledger()] if fn.__name__ == "take_ledger" else [None, None]


def test_the_tracers_fit_counts_the_kept_model_copies_of_the_timing_groups():
    """On CUDA the tracer builds beside what the timing groups keep: their configurations and,
    where reuse is on, a copy of each workload's model per group. Left out, the tracer may run out
    of memory under the profiler, and every later trace and bound_by is lost."""
    configs = [StepConfig.of("bucketed", BASE), StepConfig.of("local", BASE)]
    ranks, tracer = _Ranks(), _Ranks()
    measurer = GridMeasurer(ranks, configs, RoundOptions.fixed(2, 0, traced_steps=2), "local", tracer=tracer,
                            memory_bytes=2**40, more_groups=[_Ranks()])
    measurer._reusing = True
    asked = []

    def fit(configs_, memory, world_size, processes, device, copies=()):
        asked.append(list(copies))
        return types.SimpleNamespace(together=True)

    measurement = Measurement(configs, [[None, None]] * 2, [], 0.0, 0.02)
    with mock.patch.object(grid_measurer, "fit", fit), mock.patch.object(grid_measurer, "trace", lambda *a, **k: [[[], []]]):
        measurer._trace(measurement, tracer)
    assert asked and all(len(copies) == len(measurer.rank_groups) for copies in asked), asked
    assert all(TRACED not in call for call in ranks.calls)
