"""Time one full training step per round (forward, backward, gradient synchronization, AdamW) on
every rank, for each strategy x batch size x sequence length x bucket size of the grid.

A round is one ``RankGroup.run(timed_step)``: it ends when the slowest rank has finished (and, on
GPU, synchronized). Benchmarks are grouped by (batch, sequence length) so that a table puts the
strategies side by side. The figures behind each row are in ``extra_info``; see ddp/benchmark.py.
"""

from __future__ import annotations

import pytest

from ddp.benchmark import (
    OutOfMemory,
    StepConfig,
    device_name,
    extra_info,
    first_out_of_memory,
    oom_reason,
    prepare_step,
    release_step,
    summarize,
    timed_step,
)
from perf_tests.conftest import HarnessOverhead


class _RanOutOfMemory(Exception):
    def __init__(self, marker: OutOfMemory) -> None:
        super().__init__(marker.message)
        self.marker = marker


@pytest.fixture(scope="module")
def step_group(rank_group):
    """The session's ranks; the last configuration's model is freed when this module is done."""
    yield rank_group
    if rank_group.started:
        rank_group.run(release_step)


def test_step(benchmark, step_group, step_config: StepConfig, grid, harness_overheads) -> None:
    group = step_group
    benchmark.group = step_config.group_name
    setups = group.run(prepare_step, step_config, warmup_steps=1)
    marker = first_out_of_memory(setups)
    if marker is not None:
        group.run(release_step)
        pytest.skip(oom_reason(step_config, group.world_size, marker))

    rounds = []

    def one_round() -> None:
        timings = group.run(timed_step, step_config)
        marker = first_out_of_memory(timings)
        if marker is not None:
            raise _RanOutOfMemory(marker)
        rounds.append(timings)

    try:
        benchmark.pedantic(one_round, rounds=grid.rounds, warmup_rounds=grid.warmup_rounds, iterations=1)
    except _RanOutOfMemory as error:
        group.run(release_step)
        pytest.skip(oom_reason(step_config, group.world_size, error.marker))

    timed_rounds = rounds[-grid.rounds :]
    summary = summarize(step_config, group.world_size, timed_rounds)
    benchmark.extra_info.update(
        extra_info(step_config, group.backend, device_name(group.device), group.world_size, setups[0], summary)
    )

    assert all(s.num_parameters == setups[0].num_parameters for s in setups), "ranks built different models"
    assert 0.0 <= summary.comm_wait_seconds <= summary.step_seconds
    if step_config.strategy == "local":
        assert setups[0].allreduce_calls_per_step == 0 and setups[0].bytes_per_step == 0
    else:
        assert setups[0].allreduce_calls_per_step >= 1 and setups[0].bytes_per_step > 0

    if benchmark.stats is not None:  # None under --benchmark-disable: nothing was timed
        round_seconds = benchmark.stats.stats.data
        slowest_rank = [max(t.step_seconds for t in timings) for timings in timed_rounds]
        harness_overheads.append(
            HarnessOverhead(
                step_config.test_id,
                [r - s for r, s in zip(round_seconds, slowest_rank)],
                summary.step_seconds,
            )
        )
