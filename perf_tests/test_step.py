"""Time one full training step (``ddp.bench.rounds.trainer``: forward, backward, gradient
synchronization, AdamW) for each strategy x batch size x sequence length x bucket size of the grid.

What shares a round is ``--interleave`` (``ddp.bench.rounds.grid_measurer.GridMeasurer``): by default each
strategy with a ``local`` twin, so that its overhead is paired over rounds (alone where the two do
not fit in memory together); ``group`` runs every strategy of one group (model, batch, sequence
length, options) in the same rounds (measured when its first test runs); ``off`` each alone. A
round's time is the slowest rank's step. The rounds are spread over ``--rank-groups`` groups of
ranks started apart (``more_rank_groups``), so that their intervals hold from one run to the next
(``ddp.bench.rounds.spread.measure_in_rank_groups``). Rounds are added until every median's 95% interval is
within ``--target-precision`` or the budget is spent; under ``--benchmark-compare``, until each
comparison with the saved run is settled (``ddp.analysis.compare.AimAtDecision``). The rounds are handed to pytest-benchmark as they were measured (``record_rounds``), and
the figures behind each row, intervals included, are the ``StepRecord`` in ``extra_info``. Each
step's collectives come from traced steps: on CUDA on a group of ranks that times nothing
(``tracing_group``), so that no timed round runs in a process after a profiler; on CPU, where
nothing stays attached, on the group that timed it last, right after its rounds.
"""

from __future__ import annotations

import pytest

from ddp.bench.config.step_config import StepConfig
from ddp.bench.results.machine import device_name
from ddp.bench.rounds.grid_measurer import IN_GROUP, GridMeasurer
from ddp.bench.rounds.loop import NotRun
from ddp.bench.rounds.rank_state import release
from ddp.bench.rounds.summary import step_record
from ddp.strategies.registry import traits


@pytest.fixture(scope="module")
def measurer(rank_group, more_rank_groups, request, grid, aim_at_decision, run_ledger):
    """Measures the grid a group at a time, its rounds spread over ``--rank-groups`` groups of
    ranks, aimed at the comparison with a saved run under ``--benchmark-compare``, each
    benchmark's traced steps on CUDA on ranks of their own (``tracing_group``), on CPU where it
    was timed; the last models are freed when this module is done."""
    tracer = request.getfixturevalue("tracing_group") if rank_group.device == "cuda" else IN_GROUP
    yield GridMeasurer(rank_group, grid.configs(), grid.round_options(), grid.interleave, stop=aim_at_decision,
                       tracer=tracer, memory_bytes=grid.device_memory_bytes, more_groups=more_rank_groups,
                       ledger=run_ledger)
    for group in [rank_group, *more_rank_groups]:
        if group.started:
            group.run(release)


def test_step(benchmark, rank_group, measurer, step_config: StepConfig, record_rounds, record_precision) -> None:
    group = rank_group
    benchmark.group = step_config.group_name
    result = measurer.measurement(step_config)
    if isinstance(result, NotRun):
        pytest.skip(result.reason(group.world_size))
    measurement, index, local_index = result
    record = step_record(measurement, group.backend, device_name(group.device), index, local_index,
                         unpaired_reason=measurer.unpaired.get(step_config), **measurer.record_counts(step_config))
    record_rounds(record.round_seconds, record)
    record_precision(record.reached_precision, record.target_precision)

    setups = measurement.setups[index]
    assert len({s.num_parameters for s in setups}) == 1, "ranks built different models"
    # every strategy's collectives are known: its own figure, or counted in a warm-up step
    if traits(step_config.strategy).communicates:
        assert setups[0].bytes_per_step > 0 and setups[0].collectives_per_step >= 1
    else:
        assert setups[0].bytes_per_step == 0 and setups[0].collectives_per_step == 0
