"""Traced steps on ranks (``trace``): every collective of a configuration's untimed steps timed
(``ddp.bench.collectives.recording``), the record's ``collectives``. On CUDA on ranks that time
nothing afterwards (the profiler leaves CUPTI attached to a process); on CPU, where nothing stays
attached, in the warm-up of the group of ranks that times last (``RankBench.prepare``'s
``traced_steps``), or after everything is timed (``ddp run``).
"""

from __future__ import annotations

from collections.abc import Sequence

from ddp.bench.config.options import RoundOptions
from ddp.bench.config.shape import RecordedStep
from ddp.bench.config.step_config import StepConfig
from ddp.bench.rounds.rank_state import (
    first_withdrawn,
    traced,
)


def trace(ranks, configs: Sequence[StepConfig], policy: RoundOptions, keep_built: bool = False) -> list[list[list[RecordedStep]]] | None:
    """``policy.traced_steps`` traced steps of each configuration on ``ranks``
    (``ddp.bench.rounds.rank_state.traced``: each built and warmed up there unless it is, then traced, then
    everything freed): per configuration, per rank, the step records; None when a rank could not
    run them (out of memory under the profiler): the record then has no collectives.

    ``ranks`` must time nothing afterwards: the profiler of a traced step leaves CUPTI attached to
    the process on CUDA. ``GridMeasurer`` traces on a group of ranks of its own (its ``tracer``),
    ``ddp run`` on its own ranks once every benchmark is timed. On CPU nothing stays attached (no
    CUPTI; the profiler's callbacks, the recorder and its hooks are gone afterwards:
    ``tests/test_traced_steps.py``); ``gpu-check`` times rounds before and after on a GPU. So on
    CPU a grid traces each configuration where it was just timed, ``keep_built`` (no build, no
    warm-up, nothing freed: ``GridMeasurer``'s ``trace_in_group``)."""
    per_rank = ranks.run(traced, list(configs), policy.warmup_rounds, policy.traced_steps, keep_built)
    if first_withdrawn(per_rank) is not None:
        return None
    return [[rank_traces[index] for rank_traces in per_rank] for index in range(len(configs))]
