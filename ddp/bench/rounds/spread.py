"""A measurement's rounds spread over groups of ranks started apart (``measure_in_rank_groups``),
a block on each in turn, each group building and warming up its own models, the rounds in all as
many as one group would run; every round keeps its group (``Measurement.round_groups``) for the
two-level intervals of ``ddp.bench.results.stats``. Why (a median moves between processes more
than one process's interval admits): docs/regression-gate.md, "Rounds from groups of ranks". On
CUDA each group of ranks is a set of processes with CUDA contexts of their own on the same GPUs,
and NCCL a communicator per group: a group's models are freed and its cached blocks handed back
before the next group builds where the two would not fit together (``ddp.bench.memory.predict.fit``).

"Group" here means a group of ranks (``ddp.launcher.RankGroup``) and nothing else.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from ddp.bench.config.options import RoundOptions
from ddp.bench.config.step_config import StepConfig
from ddp.bench.results.stats import relative_half_width
from ddp.bench.rounds.loop import Measurement, NotRun, StopCriterion, free, measure
from ddp.bench.rounds.rank_state import (
    return_cached_memory,
)


def rank_group_share(policy: RoundOptions, groups: int, index: int = 0) -> RoundOptions:
    """Group ``index``'s share of a measurement's rounds spread over ``groups``: the minimum and
    maximum rounds divided among them (the first groups take one more where they do not divide,
    so the shares add up to the whole), the budget divided, and the precision target widened by
    sqrt(groups), so that the rounds of all groups together reach about the precision one group's
    would (the interval of a median narrows as the square root of its rounds). A share of no
    rounds (fewer maximum rounds than groups) is not run (``active_groups``)."""
    if groups == 1:
        return policy

    def part(total: int) -> int:
        return total // groups + (index < total % groups)

    max_rounds = part(policy.max_rounds)
    budget = policy.budget_seconds
    return dataclasses.replace(
        policy, min_rounds=min(part(policy.min_rounds), max_rounds), max_rounds=max_rounds,
        budget_seconds=None if budget is None else budget / groups,
        target_precision=min(1.0, policy.target_precision * math.sqrt(groups)),
    )


def active_rank_groups(groups: Sequence, policy: RoundOptions) -> list:
    """The groups that get rounds: all of them, or as many as ``policy.max_rounds`` where it is smaller."""
    return list(groups)[:max(1, min(len(groups), policy.max_rounds))]


def measure_in_rank_groups(groups: Sequence, configs: Sequence[StepConfig], policy: RoundOptions, benchmarks: int = 1,
                      stop: StopCriterion | None = None, keep_built: bool = True, traced_steps: int = 0) -> Measurement | NotRun:
    """``measure`` with the rounds spread over ``groups`` of ranks, a block on each in turn
    (module docstring), each block's round policy ``rank_group_share``; ``stop`` judges the last
    group's rounds together with the others' (the earlier blocks stop on their precision target
    or budget). ``keep_built``: each group keeps its configurations built once its block is done
    (False where the next group's build would not fit beside them: they are freed and, on CUDA,
    the cached blocks handed back); the last group keeps them built, as ``measure`` does.
    ``traced_steps``: the last group's fresh builds run that many traced steps in their warm-up
    (``measure``)."""
    configs = list(configs)
    groups = active_rank_groups(groups, policy)
    if len(groups) == 1:
        return measure(groups[0], configs, policy, benchmarks, stop, traced_steps=traced_steps)
    blocks: list[Measurement] = []
    for index, ranks in enumerate(groups):
        seconds = [[s for block in blocks for s in block.round_seconds(c)] for c in range(len(configs))]
        labels = [g for block in blocks for g in block.round_groups]
        last = index == len(groups) - 1
        share = rank_group_share(policy, len(groups), index)
        result = measure(ranks, configs, share, benchmarks, stop if last else None, (seconds, labels), index,
                         traced_steps=traced_steps if last else 0)
        if isinstance(result, NotRun):
            for earlier in groups[:index + 1]:
                free(earlier)
            return result
        blocks.append(result)
        if not last:
            if not keep_built:
                free(ranks)
            # The block's transient peak stays with this process otherwise (CUDA's caching
            # allocator, glibc's heap on CPU), out of the next group's reach; the group's next
            # block is prepared with warm-up steps, which take the first touch of that memory.
            ranks.run(return_cached_memory)
    merged = Measurement(configs, blocks[0].setups, [round_ for block in blocks for round_ in block.rounds],
                         float("inf"), policy.target_precision, traces=blocks[-1].traces,
                         round_groups=[g for block in blocks for g in block.round_groups])
    if len(merged.rounds) > 1:
        merged.reached_precision = max(relative_half_width(merged.round_seconds(c), groups=merged.round_groups)
                                       for c in range(len(configs)))
    return merged
