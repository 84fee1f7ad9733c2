"""``bucketed`` against PyTorch's DistributedDataParallel, raced on the session's rank group.

One round is one step of each of local, bucketed and torch (``ddp.bench.rounds.race``); the rounds of
bucketed are what pytest-benchmark saves, and the figures that matter (each median with its
interval, the paired ratio bucketed / torch, each DDP's overhead over local) are the
``RaceRecord`` in ``extra_info``, under the name ``ddp versus --json`` gives the same race
(``ddp.bench.results.benchmark_json.race_id``). The test fails if bucketed and torch end with different weights.

Workload: on CPU the grid's model at its first batch size and sequence length (mini at 4 x 64 by
default: about 30 s of the default run, where the 101M-parameter mlp took 100 s of its 10 minutes;
``python -m ddp versus --model mlp --batch-size 16`` races that one); with CUDA the Transformer LM
"small" at 1 x 64 tokens.
"""

from __future__ import annotations

import pytest

from ddp.bench.results.benchmark_json import race_group_name, race_id
from ddp.bench.rounds.loop import free
from ddp.bench.rounds.race import race, race_configs
from ddp.bench.rounds.trainer import CannotRun
from ddp.strategies.bucketed import DEFAULT_BUCKET_SIZE_MB
from ddp.strategies.registry import DEFAULT_CONTENDERS
from perf_tests.conftest import benchmark_grid, launch


def race_values(grid, device: str) -> dict:
    """The race's model, batch size and seq len, at the DDPs' default bucket cap."""
    if device == "cuda" and grid.model != "tiny":
        model, batch_size, seq_len = "small", 1, 64
    else:
        model, batch_size, seq_len = grid.model, grid.values("batch_size")[0], grid.values("seq_len")[0]
    return {"model": model, "batch_size": batch_size, "seq_len": seq_len, "bucket_size_mb": DEFAULT_BUCKET_SIZE_MB}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "values" in metafunc.fixturenames:
        values = race_values(benchmark_grid(metafunc.config), launch(metafunc.config).device)
        metafunc.parametrize("values", [values], ids=[race_id(race_configs(DEFAULT_CONTENDERS, values))])


def test_versus(benchmark, rank_group, grid, values, record_rounds) -> None:
    benchmark.group = race_group_name(race_configs(DEFAULT_CONTENDERS, values))
    try:
        result = race(rank_group, values, grid.round_options())
    except CannotRun as error:
        pytest.skip(str(error))
    finally:
        free(rank_group)
    record_rounds(result.record.round_seconds[result.record.primary], result.record)
    assert result.weights_differ is None, f"trained differently: {result.weights_differ}"
