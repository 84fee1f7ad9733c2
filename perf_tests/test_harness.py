"""The benchmark harness on a real rank group (not timed): running out of memory, on every rank or
on one, and a configuration the machine cannot run, are skips the rank group survives. The harness's pure units (the timing loop's
stopping rule, records, ids, bandwidths) are tested in tests/test_measure.py, which CI
runs in full."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from ddp.bench.config.options import RoundOptions
from ddp.bench.config.step_config import StepConfig
from ddp.bench.rounds.loop import Measurement, NotRun, measure
from ddp.bench.rounds.rank_state import release
from ddp.bench.rounds.trainer import CannotRun
from ddp.model import build_model
from ddp.strategies.declarations import declarations, declare
from ddp.strategies.local import LocalTraining
from ddp.strategies.overlap import OverlapDDP


class OutOfMemoryDDP(LocalTraining):
    """A strategy whose forward runs out of memory, as xl at batch 4 x 512 tokens does on a GPU."""

    def forward(self, *args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")


declare(OutOfMemoryDDP, **declarations(LocalTraining))


class CannotRunHereDDP(LocalTraining):
    """A strategy that says this machine cannot run it (``ddp.bench.rounds.trainer.CannotRun``), as a
    configuration does whose compiler is missing."""

    def __init__(self, module, **options) -> None:
        raise CannotRun("no compiler for this backend here: install one, or leave the option off")


def test_a_configuration_that_cannot_run_here_is_skipped_with_its_reason(rank_group) -> None:
    config = StepConfig(f"{__name__}:CannotRunHereDDP", "tiny", batch_size=2, seq_len=16)
    result = measure(rank_group, [config], RoundOptions.fixed(2, 0))
    assert isinstance(result, NotRun)
    assert result.reason(rank_group.world_size) == (
        f"cannot run {config.describe()}: no compiler for this backend here: install one, or leave the option off")
    measured = measure(rank_group, [StepConfig("local", "tiny", batch_size=2, seq_len=16)], RoundOptions.fixed(2, 0))
    assert isinstance(measured, Measurement) and len(measured.rounds) == 2  # the next configuration runs
    rank_group.run(release)


def test_out_of_memory_is_reported_and_the_group_survives(rank_group) -> None:
    config = StepConfig(f"{__name__}:OutOfMemoryDDP", "tiny", batch_size=2, seq_len=16)
    starts = rank_group.starts if rank_group.started else rank_group.starts + 1
    result = measure(rank_group, [config], RoundOptions.fixed(2, 0))
    assert isinstance(result, NotRun)
    reason = result.reason(rank_group.world_size)
    assert "batch 2, seq len 16" in reason and "Tried to allocate 20.00 GiB" in reason
    # The ranks freed their state and answer the next call without being replaced.
    working = StepConfig("local", "tiny", batch_size=2, seq_len=16)
    measured = measure(rank_group, [working], RoundOptions.fixed(2, 0))
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
        if dist.get_rank() == 1 and self._steps > self.steps_before_failing and self._gradients_seen % 3 == 0:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory on one rank only. Tried to allocate 1.00 GiB")


declare(OutOfMemoryOnRankOneInBackward, **declarations(OverlapDDP))


@pytest.mark.ranks(2, why="one runs out of memory while another waits for it")
def test_out_of_memory_on_one_rank_mid_backward_is_reported_quickly_and_the_next_benchmark_runs(rank_group) -> None:
    config = StepConfig(f"{__name__}:OutOfMemoryOnRankOneInBackward", "tiny", batch_size=2, seq_len=16)
    began = time.monotonic()
    result = measure(rank_group, [config], RoundOptions.fixed(3, 0))
    assert time.monotonic() - began < 60, "the ranks must not wait out the launcher's timeout"
    assert isinstance(result, NotRun) and result.marker.rank == 1
    assert "one rank only" in result.reason(rank_group.world_size)
    starts = rank_group.starts
    measured = measure(rank_group, [StepConfig("local", "tiny", batch_size=2, seq_len=16)], RoundOptions.fixed(2, 0))
    assert isinstance(measured, Measurement) and len(measured.rounds) == 2
    assert rank_group.starts == starts + 1, "rank 0 was stuck in a collective: the group must have been replaced"
    rank_group.run(release)
