"""Traced steps (``ddp.bench.collectives.recording``) leave nothing attached behind them: the profiler off, the
strategy's collective recorder detached, no hook added to a parameter, the step's own observers
gone. On CUDA the profiler also leaves CUPTI attached to the process, which no check on a CPU can
see: that is why traced steps run on ranks that time nothing afterwards (``ddp.bench.rounds.traced.trace``,
``GridMeasurer``'s tracer), checked here by where they run, and timed on a GPU by ``gpu-check``."""

from __future__ import annotations

import pytest
import torch

from ddp.bench.collectives import recording
from ddp.bench.collectives.recording import traced_steps
from ddp.bench.config.options import RoundOptions
from ddp.bench.config.step_config import StepConfig
from ddp.bench.rounds.grid_measurer import GridMeasurer
from ddp.bench.rounds.loop import free
from ddp.bench.rounds.trainer import Trainer
from ddp.launcher import Rank, RankGroup, on_rank


def _hooks(module: torch.nn.Module) -> int:
    return sum(len(p._post_accumulate_grad_hooks or {}) + len(p._backward_hooks or {}) for p in module.parameters())


@on_rank
def attached_after_traced_steps(rank: Rank, strategy: str) -> dict:
    """Runs on every rank: what is attached before and after three traced steps of ``strategy``."""
    trainer = Trainer(StepConfig(strategy, "tiny", 2, 16, 1.0), rank.info)
    try:
        for _ in range(3):
            trainer.step()  # settled: PyTorch's DDP has rebuilt its buckets
        before = _hooks(trainer.workload.module)
        steps = traced_steps(trainer, 3)
        return {
            "collectives": sum(len(step.collectives) for step in steps),
            "profiler_on": torch.autograd.profiler._is_profiler_enabled,
            "recorder": getattr(trainer.model, "collective_recorder", None) is not None,
            "hooks_added": _hooks(trainer.workload.module) - before,
        }
    finally:
        trainer.close()


def test_traced_steps_leave_nothing_attached(rank_group):
    # bucketed: its own records; torch: the profiler's (PyTorch's reducer launches from C++)
    for strategy in ("bucketed", "torch"):
        for rank, found in enumerate(rank_group.run(attached_after_traced_steps, strategy)):
            assert found["collectives"] > 0, (strategy, rank)
            assert found == {**found, "profiler_on": False, "recorder": False, "hooks_added": 0}, (strategy, rank, found)


class _Traced:
    """How many traced steps this rank has run (``ddp.bench.collectives.recording.recorded_step`` calls)."""

    def __init__(self) -> None:
        self.count = 0
        self.recorded_step = recording.recorded_step


@on_rank
def count_traced_steps(rank: Rank) -> None:
    """From now on, count every traced step this rank runs."""
    counter = rank.keep(_Traced)

    def counted(*args, **kwargs):
        counter.count += 1
        return counter.recorded_step(*args, **kwargs)

    recording.recorded_step = counted


@on_rank
def traced_so_far(rank: Rank) -> int:
    """The traced steps counted since ``count_traced_steps``, which stops counting."""
    counter = rank.keep(_Traced)
    recording.recorded_step = counter.recorded_step
    count, counter.count = counter.count, 0
    return count


@pytest.mark.slow
def test_a_grid_traces_on_its_tracer_and_never_on_the_ranks_it_times(rank_group):
    """The grid's traced steps run on the tracer's ranks, the timed rounds on the timing ranks, and
    the benchmark that communicates still gets its collectives, and ``local`` its partition."""
    with RankGroup(rank_group.world_size, rank_group.backend, rank_group.device) as tracer:
        for ranks in (tracer, rank_group):
            ranks.run(count_traced_steps)
        configs = [StepConfig("local", "tiny", 2, 16), StepConfig("bucketed", "tiny", 2, 16, 1.0)]
        policy = RoundOptions(3, 3, 1, 1.0, float("inf"), traced_steps=4)
        measurer = GridMeasurer(rank_group, configs, policy, "local", tracer=tracer)
        measurement, index, twin = measurer.measurement(configs[1])
        local, local_index, _ = measurer.measurement(configs[0])  # its twin's rounds, and its twin's traced steps
        free(rank_group)
        assert local.traces[local_index] is measurement.traces[twin]
        assert tracer.run(traced_so_far) == [8] * tracer.world_size  # 4 of local, 4 of bucketed
        assert rank_group.run(traced_so_far) == [0] * rank_group.world_size
    assert len(measurement.rounds) == 3
    assert all(len(steps) == 4 and not steps[0].collectives and steps[0].timeline["bound_by"] == "compute"
               for steps in measurement.traces[twin])
    assert all(len(steps) == 4 and steps[0].collectives for steps in measurement.traces[index])
