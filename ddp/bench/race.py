"""``bucketed`` against PyTorch's DistributedDataParallel, side by side on one rank group.

Both strategies, and ``local`` (the floor with no communication), wrap the same workload built from
the same seed, with the same bucket size, and train the same shards with the same step
(``ddp.bench.trainer``). Every round runs one step of each in an order that rotates from round to
round (``ddp.bench.measure``), so that drift in the machine falls on all of them alike; the ratio
bucketed / torch and each DDP's overhead over ``local`` are paired over rounds, with intervals.

After the race, bucketed and torch must hold the same weights: the correctness check inside the
performance run, since a fast DDP that trains differently is no result. ``same_weights`` says where
they differ; the callers (``ddp versus``, perf_tests) assert it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddp.bench.measure import MeasuredOutOfMemory, RoundPolicy, measure
from ddp.bench.records import RaceRecord, race_record
from ddp.bench.config import StepConfig
from ddp.bench.rank_state import oom_reason, parameters_of

CONTENDERS = ("local", "bucketed", "torch")


@dataclass(frozen=True)
class RaceResult:
    record: RaceRecord
    weights_differ: str | None
    """None when bucketed and torch ended with the same weights; else where they differ."""


def race_configs(model: str, batch_size: int, seq_len: int, bucket_size_mb: float, **numerics) -> list[StepConfig]:
    """``numerics``: ``StepConfig``'s precision, optimizer and grad_comm (local communicates nothing)."""
    local = StepConfig("local", model, batch_size, seq_len, **{**numerics, "grad_comm": "fp32"})
    return [local] + [StepConfig(name, model, batch_size, seq_len, bucket_size_mb, **numerics) for name in CONTENDERS[1:]]


def race(ranks, model: str, batch_size: int, seq_len: int, bucket_size_mb: float, policy: RoundPolicy, **numerics) -> RaceResult:
    """Race the contenders on ``ranks``; raises ``MemoryError`` (with the skip reason) if a rank ran out."""
    configs = race_configs(model, batch_size, seq_len, bucket_size_mb, **numerics)
    measurement = measure(ranks, configs, policy)
    if isinstance(measurement, MeasuredOutOfMemory):
        raise MemoryError(oom_reason(measurement.config, ranks.world_size, measurement.marker))
    bucketed = ranks.run(parameters_of, configs[1])[0]
    reference = ranks.run(parameters_of, configs[2])[0]
    return RaceResult(race_record(measurement, ranks.backend), weights_difference(bucketed, reference))


def weights_difference(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> str | None:
    """Where two lists of parameters differ beyond float rounding, or None."""
    for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
        try:
            torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)
        except AssertionError as error:
            return f"parameter {index}: {str(error).splitlines()[0]}"
    return None
