"""The one timing loop: prepare configurations on every rank, warm up, then run rounds until the
median is resolved well enough or the budget is spent.

Every tool that times steps goes through ``measure``: perf_tests/ (a strategy and its ``local``
twin, or a grid group's strategies together), ``ddp run`` under torchrun, ``ddp versus``, the
all-reduce benchmark (``timed_rounds``). A round runs one step of every configuration, in rotating
order (``RankBench.round``), so what one measurement compares is never separated by drift in the
machine. A round's figure for a configuration is its slowest rank's step time: the next step
cannot start before that rank is done.

Rounds are added (``timed_rounds``) until at least ``min_rounds`` have run and the 95% interval of
every configuration's median is within ``target_precision`` of it, or the rounds have taken the
budget, or ``max_rounds`` have run; each record says the precision it reached. Given a
``StopCriterion`` (``--benchmark-compare`` gives ``ddp.analysis.compare.AimAtDecision``), rounds
are added until it says the comparison is settled instead.

``ranks`` is anything with ``world_size`` and ``run(fn, *args) -> [result per rank]``: a
``ddp.launcher.RankGroup``, or ``ddp.bench.rounds.in_process.InProcessRanks`` when this process is
one of torchrun's ranks. Spreading a measurement over several groups of ranks is
``ddp.bench.rounds.spread``; a grid's schedule, ``ddp.bench.rounds.grid_measurer``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ddp.bench.config.options import RoundOptions
from ddp.bench.config.shape import RecordedStep
from ddp.bench.config.step_config import StepConfig
from ddp.bench.memory.predict import NotBuilt
from ddp.bench.results.stats import relative_half_width
from ddp.bench.rounds.rank_state import (
    OutOfMemory,
    RankCannotRun,
    RankLost,
    first_withdrawn,
    prepare,
    release,
    skip_reason,
    timed_round,
)
from ddp.bench.rounds.trainer import StepSetup, StepTiming

# The harness's step against a plain PyTorch loop of the same work, interleaved: within 2% is the
# suite's promise (perf_tests/test_harness_cost.py times it; gpu-check holds xl to it).
HARNESS_RATIO_BAR = 1.02


@dataclass
class Measurement:
    """What ``measure`` found for each configuration, in the order given."""

    configs: list[StepConfig]
    setups: list[list[StepSetup]]
    """Per configuration, per rank."""
    rounds: list[list[list[StepTiming]]]
    """Per timed round, per configuration, per rank."""
    reached_precision: float
    """The widest relative half-width of a median's 95% interval among the configurations."""
    target_precision: float
    traces: list[list[list[RecordedStep]]] | None = None
    """Per configuration, per rank, its traced steps (``ddp.bench.collectives.recording``: each collective's
    ready, launch and completion), run apart from the timed rounds (``trace``); None if none ran."""
    round_groups: list[int] | None = None
    """Per timed round, the group of ranks it ran in (``measure_in_groups``); None: one group."""

    def round_seconds(self, index: int = 0) -> list[float]:
        """Each timed round's step time of configuration ``index``: its slowest rank's."""
        return [max(t.step_seconds for t in timings[index]) for timings in self.rounds]

    def sync_wait_seconds(self, index: int = 0) -> list[float]:
        """Each timed round's wait for gradients (``StepTiming.sync_wait_seconds``) of configuration
        ``index`` on its slowest rank (the rank whose step time is the round's)."""
        return [max(timings[index], key=lambda t: t.step_seconds).sync_wait_seconds for timings in self.rounds]

    def rank_round_seconds(self, index: int = 0) -> list[list[float]]:
        """Per rank, each timed round's step time of configuration ``index``."""
        world_size = len(self.rounds[0][index])
        return [[timings[index][rank].step_seconds for timings in self.rounds] for rank in range(world_size)]

    def peak_memory_bytes(self, index: int = 0) -> list[int] | None:
        """Per rank, the CUDA allocator's peak over the timed rounds of configuration ``index``; None on CPU."""
        world_size = len(self.rounds[0][index])
        peaks = [[timings[index][rank].peak_memory_bytes for timings in self.rounds] for rank in range(world_size)]
        return None if any(p is None for rank in peaks for p in rank) else [max(rank) for rank in peaks]


@dataclass(frozen=True)
class NotRun:
    """A measurement that did not run: some rank ran out of memory, cannot run the configuration,
    or was killed by a signal."""

    config: StepConfig
    marker: OutOfMemory | RankCannotRun | RankLost | NotBuilt

    def reason(self, world_size: int) -> str:
        """A one-line skip reason naming the configuration (``ddp.bench.rounds.rank_state.skip_reason``)."""
        if isinstance(self.marker, NotBuilt):
            return self.marker.message
        return skip_reason(self.config, world_size, self.marker)


StopCriterion = Callable[[Sequence[StepConfig], list[list[float]], "list[int] | None"], "bool | None"]
"""``criterion(configs, seconds, groups)``, ``seconds`` holding per configuration its round times
so far (slowest rank), ``groups`` each round's group of ranks (None: one group): True once the
rounds have answered what they are measured for, False to go on, None when it has nothing to
judge (the precision target then decides)."""


def timed_rounds(run_round: Callable[[int], list], policy: RoundOptions, budget_scale: int = 1,
                 settled: Callable[[list[list]], bool | None] | None = None) -> tuple[list[list], float] | OutOfMemory | RankCannotRun:
    """The loop: call ``run_round(index)`` (per-rank results of one round: on each rank a list of
    timings with ``seconds``, one per configuration or all-reduce size) until the policy says stop; returns
    the rounds and the precision reached (the worst configuration's), or the first
    marker (``OutOfMemory``, ``RankCannotRun``) a rank returned. ``budget_scale`` multiplies the time budget: a round of a
    group of n benchmarks holds n benchmarks' steps. ``settled(rounds)``, when given and not None,
    replaces the precision target as the reason to stop before the budget."""
    rounds: list[list] = []
    spent = 0.0
    precision = float("inf")
    while True:
        per_rank = run_round(len(rounds))
        marker = first_withdrawn(per_rank)
        if marker is not None:
            return marker
        rounds.append(per_rank)
        # Time spent is counted from the gathered times, not from this process's clock, so that
        # every rank under torchrun takes the same decision to stop.
        spent += max(_seconds(result) for result in per_rank)
        precision = _worst_precision(rounds) if len(rounds) > 1 else float("inf")
        if len(rounds) >= policy.max_rounds:
            break
        if len(rounds) < policy.min_rounds:
            continue
        if spent >= policy.budget_seconds * budget_scale:
            break
        answer = settled(rounds) if settled is not None else None
        if answer if answer is not None else precision <= policy.target_precision:
            break
    return rounds, precision


def config_round_seconds(rounds: list[list]) -> list[list[float]]:
    """Per configuration, each round's time (its slowest rank's), from rounds as ``timed_rounds`` keeps them."""
    return [[max(per_rank[index].seconds for per_rank in round_) for round_ in rounds] for index in range(len(rounds[0][0]))]


def _seconds(result: list) -> float:
    """All the time one rank's round took: every configuration's step, or every all-reduce."""
    return sum(t.seconds for t in result)


def _worst_precision(rounds: list[list]) -> float:
    """The widest relative half-width among the configurations of these rounds (slowest rank)."""
    return max(relative_half_width(seconds) for seconds in config_round_seconds(rounds))


def measure(ranks, configs: Sequence[StepConfig], policy: RoundOptions, benchmarks: int = 1,
            stop: StopCriterion | None = None, before: tuple[list[list[float]], list[int]] | None = None,
            group: int = 0, fixed_warmup: bool = False, traced_steps: int = 0) -> Measurement | NotRun:
    """Time ``configs`` side by side on ``ranks`` (see the module docstring), with the time budget
    of ``benchmarks`` benchmarks (a strategy and its local twin are one; a group of n is n), until
    ``stop`` (if given) says the rounds are settled. The configurations stay built on the ranks
    afterwards (``release`` frees them). ``before``: per configuration the round times other groups
    of ranks measured, and their groups, which ``stop`` judges with these rounds (of ``group``).
    ``fixed_warmup``: every fresh build trains its settling steps alone before the rounds
    (``ddp.bench.rounds.rank_state.RankBench.prepare``), so that configurations trained alike.
    ``traced_steps``: each fresh build runs that many traced steps in its warm-up (CPU only,
    ``trace``), the measurement's ``traces``."""
    configs = list(configs)
    # A measurement's setups are its first group's: the others' training state is not counted
    # (an untimed step under MemTracker on CPU, seconds a configuration).
    setups = ranks.run(prepare, configs, policy.warmup_rounds, group == 0, fixed_warmup, traced_steps)
    marker = first_withdrawn(setups)
    if marker is not None:
        return NotRun(configs[0], marker)
    traces = None
    if traced_steps:
        traces = [[rank_setups[index].traced or [] for rank_setups in setups] for index in range(len(configs))]

    seconds_before, groups_before = before or ([[] for _ in configs], [])

    def settled(rounds: list[list]) -> bool | None:
        seconds = [earlier + now for earlier, now in zip(seconds_before, config_round_seconds(rounds))]
        return stop(configs, seconds, groups_before + [group] * len(rounds))

    outcome = timed_rounds(functools.partial(ranks.run, timed_round, configs), policy, budget_scale=benchmarks,
                           settled=None if stop is None else settled)
    if isinstance(outcome, (OutOfMemory, RankCannotRun)):
        return NotRun(configs[0], outcome)
    per_round, precision = outcome
    # per round, per rank, per configuration -> per round, per configuration, per rank
    rounds = [[[per_rank[index] for per_rank in round_] for index in range(len(configs))] for round_ in per_round]
    setups_by_config = [[rank_setups[index] for rank_setups in setups] for index in range(len(configs))]
    return Measurement(configs, setups_by_config, rounds, precision, policy.target_precision, traces=traces,
                       round_groups=[group] * len(rounds))


def free(ranks) -> None:
    """Free whatever the ranks keep built."""
    ranks.run(release)
