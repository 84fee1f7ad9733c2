"""Strategies raced side by side on one rank group: by default ``bucketed`` against PyTorch's
DistributedDataParallel, any list of contenders alike.

Every contender, and ``local`` (the floor with no communication), wraps the same workload built
from the same seed, with the same bucket size where it takes one, and trains the same shards with
the same step (``ddp.bench.rounds.trainer``). Every round runs one step of each in an order that rotates
from round to round (``ddp.bench.rounds.loop``), so that drift in the machine falls on all of them
alike; each contender's ratio over the reference (the last contender given: PyTorch's DDP by
default) and each one's overhead over ``local`` are paired over rounds, with intervals.

When the contenders do not fit in memory together (``ddp.bench.memory.predict``: xl on one 80 GB GPU
needs about 3 x 35 GiB), they race one at a time in alternating blocks of rounds instead
(``ddp.bench.rounds.blocks.measure_in_blocks``, which states what that pairing guarantees); when even
one does not fit alone, the race is refused before anything is built (``CannotRun``).

After the race, every contender must hold the reference's weights (each parameter's norm and
evenly spaced elements, compared in the parent): the correctness check inside the performance run,
since a fast DDP that trains differently is no result. ``weights_differ``
says where they differ; the callers (``ddp versus``, perf_tests) assert it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ddp.bench.config.options import RoundOptions
from ddp.bench.config.step_config import StepConfig
from ddp.bench.memory.predict import fit_on
from ddp.bench.results.records import RaceRecord
from ddp.bench.rounds.blocks import measure_in_blocks
from ddp.bench.rounds.loop import NotRun, free, measure
from ddp.bench.rounds.rank_state import OutOfMemory, weights_sample
from ddp.bench.rounds.summary import race_record
from ddp.bench.rounds.trainer import CannotRun
from ddp.strategies.registry import DEFAULT_CONTENDERS, FLOOR, is_floor, traits


@dataclass(frozen=True)
class RaceResult:
    record: RaceRecord
    weights_differ: str | None
    """None when every contender ended with the reference's weights; else which did not, and where."""
    interleaving: str
    """How the contenders shared the rounds, for the reader: built together, a step of each per
    round, or one at a time in alternating blocks (and why)."""


def check_contenders(contenders: Sequence[str]) -> tuple[str, ...]:
    """The contenders as raced: ``ValueError`` unless at least one of them communicates (the
    reference is the last one that does)."""
    named = tuple(c for c in contenders if not is_floor(c))
    if not any(traits(c).communicates for c in named):
        raise ValueError(f"a race needs a strategy that communicates among its contenders, got {', '.join(contenders) or 'none'}")
    return named


def race_configs(contenders: Sequence[str], values: Mapping) -> list[StepConfig]:
    """``local`` first, then any other floor a contender is paired with (``local_mixed``:
    ``StepConfig.local_twin``), then the contenders in the order given, each with ``values``
    (``StepConfig`` fields by name: model, batch size, bucket cap, precision, ...) where they apply to it."""
    named = [StepConfig.of(name, values) for name in check_contenders(contenders)]
    floors = dict.fromkeys([StepConfig.of(FLOOR, values), *(c.local_twin() for c in named)])
    return [*floors, *named]


def race(ranks, values: Mapping, policy: RoundOptions, contenders: Sequence[str] = DEFAULT_CONTENDERS) -> RaceResult:
    """Race the contenders on ``ranks`` with ``values`` (``StepConfig`` fields by name): built
    together when they fit in memory (a step of each per round, in rotating order), else one at a
    time in alternating blocks of rounds. Raises ``CannotRun`` with a one-line reason when one
    cannot fit even alone (before anything is built), a rank ran out of memory, or one cannot run here."""
    configs = race_configs(contenders, values)
    # Every contender warms up as long as the slowest to settle, so that all have trained the same
    # steps when their weights are compared.
    settled = max(traits(c.strategy).steps_to_settle for c in configs)
    policy = dataclasses.replace(policy, warmup_rounds=max(policy.warmup_rounds, settled))
    communicating = [c for c in configs if traits(c.strategy).communicates]
    memory = fit_on(ranks, configs)
    if memory.too_large():
        raise CannotRun(memory.too_large())
    measurement = measure(ranks, configs, policy, fixed_warmup=True) if memory.together else None
    if isinstance(measurement, NotRun) and not isinstance(measurement.marker, OutOfMemory):
        raise CannotRun(measurement.reason(ranks.world_size))
    if measurement is not None and not isinstance(measurement, NotRun):
        weights = {c.strategy: ranks.run(weights_sample, c)[0] for c in communicating}
        interleaving = "built together, one step of each per round in rotating order"
    else:
        if measurement is not None:
            free(ranks)  # the estimate let them through, but they did not fit: one at a time
        why = f"they do not fit in memory together: {memory.explain()}" if measurement is None else \
            "they ran out of memory built together"
        measurement, collected = measure_in_blocks(ranks, configs, policy, collect=weights_sample, collect_for=communicating)
        if isinstance(measurement, NotRun):
            raise CannotRun(measurement.reason(ranks.world_size))
        weights = {c.strategy: collected[c][0] for c in communicating}
        interleaving = f"one at a time in alternating blocks of rounds ({why})"
    record = race_record(measurement, ranks.backend, communicating[-1].strategy)
    reference = weights[record.reference]
    for name, actual in weights.items():
        where = weights_difference(actual, reference) if name != record.reference else None
        if where is not None:
            return RaceResult(record, f"{name} against {record.reference}: {where}", interleaving)
    return RaceResult(record, None, interleaving)


def weights_difference(actual: list[tuple[float, torch.Tensor]], expected: list[tuple[float, torch.Tensor]]) -> str | None:
    """Where two contenders' trained parameters (``ddp.bench.rounds.rank_state.weights_sample``: each
    one's norm and evenly spaced elements) differ beyond float rounding, or None."""
    for index, ((norm, sample), (expected_norm, expected_sample)) in enumerate(zip(actual, expected, strict=True)):
        try:
            torch.testing.assert_close(sample, expected_sample, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(norm, expected_norm, rtol=1e-4, atol=1e-5)
        except AssertionError as error:
            return f"parameter {index}: {str(error).splitlines()[0]}"
    return None
