"""``bucketed`` against PyTorch's DistributedDataParallel, side by side on one rank group.

Both strategies, and ``local`` (the floor with no communication), wrap the same workload built from
the same seed, with the same bucket size, and train the same shards with the same step
(``ddp.bench.trainer``). Every round runs one step of each in an order that rotates from round to
round (``ddp.bench.measure``), so that drift in the machine falls on all of them alike; the ratio
bucketed / torch and each DDP's overhead over ``local`` are paired over rounds, with intervals.

When the three do not fit in memory together (``ddp.bench.memory``: xl on one 80 GB GPU needs
about 3 x 35 GiB), they race one at a time in alternating blocks of rounds instead
(``ddp.bench.measure.measure_in_blocks``, which states what that pairing guarantees); when even
one does not fit alone, the race is refused before anything is built.

After the race, bucketed and torch must hold the same weights: the correctness check inside the
performance run, since a fast DDP that trains differently is no result. ``same_weights`` says where
they differ; the callers (``ddp versus``, perf_tests) assert it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddp.bench.measure import MeasuredOutOfMemory, RoundPolicy, free, measure, measure_in_blocks
from ddp.bench.memory import Fit, fit_on
from ddp.bench.records import RaceRecord, race_record
from ddp.bench.config import StepConfig
from ddp.bench.rank_state import oom_reason, parameters_of

CONTENDERS = ("local", "bucketed", "torch")


@dataclass(frozen=True)
class RaceResult:
    record: RaceRecord
    weights_differ: str | None
    """None when bucketed and torch ended with the same weights; else where they differ."""
    interleaving: str
    """How the contenders shared the rounds, for the reader: built together, a step of each per
    round, or one at a time in alternating blocks (and why)."""


def race_configs(model: str, batch_size: int, seq_len: int, bucket_size_mb: float) -> list[StepConfig]:
    return [
        StepConfig(name, model, batch_size, seq_len, bucket_size_mb if name != "local" else None)
        for name in CONTENDERS
    ]


def race(ranks, model: str, batch_size: int, seq_len: int, bucket_size_mb: float, policy: RoundPolicy) -> RaceResult:
    """Race the contenders on ``ranks``: built together when they fit (a step of each per round,
    in rotating order), else one at a time in alternating blocks. Raises ``MemoryError`` with a
    one-line reason when one cannot fit even alone (before building) or a rank ran out."""
    configs = race_configs(model, batch_size, seq_len, bucket_size_mb)
    memory: Fit = fit_on(ranks, configs)
    if memory.too_large():
        raise MemoryError(memory.too_large())
    if memory.together:
        measurement = measure(ranks, configs, policy)
        if not isinstance(measurement, MeasuredOutOfMemory):
            bucketed = ranks.run(parameters_of, configs[1])[0]
            reference = ranks.run(parameters_of, configs[2])[0]
            free(ranks)
            result = RaceResult(race_record(measurement, ranks.backend), weights_difference(bucketed, reference),
                                "built together, one step of each per round in rotating order")
            return result
        free(ranks)  # the estimate let them through but they did not fit: race them one at a time
        why = "they ran out of memory built together"
    else:
        why = f"they do not fit in memory together: {memory.explain()}"
    measurement, parameters = measure_in_blocks(ranks, configs, policy, collect=parameters_of)
    if isinstance(measurement, MeasuredOutOfMemory):
        raise MemoryError(oom_reason(measurement.config, ranks.world_size, measurement.marker))
    differ = weights_difference(parameters[configs[1]][0], parameters[configs[2]][0])
    return RaceResult(race_record(measurement, ranks.backend), differ, f"one at a time in alternating blocks of rounds ({why})")


def weights_difference(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> str | None:
    """Where two lists of parameters differ beyond float rounding, or None."""
    for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
        try:
            torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)
        except AssertionError as error:
            return f"parameter {index}: {str(error).splitlines()[0]}"
    return None
