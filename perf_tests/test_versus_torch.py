"""``bucketed`` against PyTorch's DistributedDataParallel, raced on the session's rank group.

One round is one step of each of local, bucketed and torch (``ddp.bench.race``); the rounds of
bucketed are what pytest-benchmark saves, and the figures that matter (each median with its
interval, the paired ratio bucketed / torch, each DDP's overhead over local) are the
``RaceRecord`` in ``extra_info``. The test fails if bucketed and torch end with different weights.

Model: the deep MLP (101M parameters, 16 rows per rank) on CPU, whose rounds fit in about a minute
on 2 cores; the Transformer LM "small" with CUDA; ``--model tiny`` (the CI smoke run) races the
tiny Transformer instead.
"""

from __future__ import annotations

import pytest

from ddp.bench.measure import CannotMeasure, free
from ddp.bench.race import race

BUCKET_SIZE_MB = 25.0  # the default of both DDPs


def race_shape(grid, device: str) -> tuple[str, int, int]:
    """(model, batch size, seq len) of the race."""
    if grid.model == "tiny":
        return "tiny", 2, 32
    return ("small", 1, 64) if device == "cuda" else ("mlp", 16, 1)


def test_bucketed_versus_torch(benchmark, rank_group, grid, record_rounds) -> None:
    model, batch_size, seq_len = race_shape(grid, rank_group.device)
    benchmark.group = f"versus: {model}, bucket {BUCKET_SIZE_MB:g} MiB"
    try:
        values = {"model": model, "batch_size": batch_size, "seq_len": seq_len, "bucket_size_mb": BUCKET_SIZE_MB}
        result = race(rank_group, values, grid.round_options())
    except CannotMeasure as error:
        pytest.skip(str(error))
    finally:
        free(rank_group)
    record_rounds(result.record.round_seconds[result.record.primary], result.record)
    assert result.weights_differ is None, f"trained differently: {result.weights_differ}"
