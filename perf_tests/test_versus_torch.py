"""``bucketed`` against PyTorch's DistributedDataParallel, alternating on the session's rank group.

One benchmark round is one step of each of local, bucketed and torch (see ddp/versus.py); the
round's time is what pytest-benchmark saves, and the figures that matter (each median step time,
the ratio bucketed / torch, each DDP's overhead over local) are in ``extra_info``. The test fails
if bucketed and torch end the race with different weights.

Models: the deep MLP (101M parameters) by default, whose rounds fit in about a minute on a 2-core
CPU; the Transformer LM "small" (129M) with NCCL; ``--model-size tiny`` (the CI smoke run) races
the tiny Transformer instead. ``--rounds`` and ``--warmup-rounds`` apply as to every benchmark.
"""

from __future__ import annotations

import pytest

from ddp.versus import Race, VersusConfig

DEFAULT_ROUNDS = 8
DEFAULT_WARMUP_ROUNDS = 2
BUCKET_SIZE_MB = 25.0  # the default of both DDPs


def versus_config(config: pytest.Config, backend: str) -> VersusConfig:
    if config.getoption("--model-size", default=None) == "tiny":
        model = "transformer-tiny"
    else:
        model = "transformer-small" if backend == "nccl" else "mlp"
    rounds = config.getoption("--rounds", default=None)
    warmup_rounds = config.getoption("--warmup-rounds", default=None)
    return VersusConfig(
        model=model,
        bucket_size_mb=BUCKET_SIZE_MB,
        rounds=DEFAULT_ROUNDS if rounds is None else rounds,
        warmup_rounds=DEFAULT_WARMUP_ROUNDS if warmup_rounds is None else warmup_rounds,
    )


def test_bucketed_versus_torch(benchmark, rank_group, request: pytest.FixtureRequest) -> None:
    config = versus_config(request.config, rank_group.backend)
    benchmark.group = f"versus: {config.model}, bucket {config.bucket_size_mb:g} MiB"
    with Race(rank_group, config) as race:
        benchmark.pedantic(race.round, rounds=config.rounds, warmup_rounds=0, iterations=1)
    result = race.result
    benchmark.extra_info.update(
        {
            "model": config.model,
            "parameters": result.parameters,
            "bucket_size_mb": config.bucket_size_mb,
            "median_step_seconds": {name: result.median_seconds(name) for name in result.step_seconds},
            "ratio_bucketed_over_torch": result.ratio,
            "paired_ratio_bucketed_over_torch": result.paired_ratio,
            "overhead_over_local_seconds": {name: result.overhead_seconds(name) for name in ("bucketed", "torch")},
            "step_seconds": result.step_seconds,
        }
    )
    assert all(seconds > 0 for times in result.step_seconds.values() for seconds in times)
