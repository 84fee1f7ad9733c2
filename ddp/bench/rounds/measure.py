"""The one timing loop: prepare configurations on every rank, warm up, then run rounds until the
median is resolved well enough or the budget is spent.

Every tool that times steps goes through ``measure``: perf_tests/ (a strategy and its ``local``
twin), ``ddp run`` under torchrun (the same), ``ddp versus`` (local, bucketed and torch). A round
runs one step of every configuration, in rotating order (``RankBench.round``), so what one
measurement compares is never separated by drift in the machine. A round's figure for a
configuration is its slowest rank's step time: the next step cannot start before that rank is done.

Rounds are added (``timed_rounds``) until at least ``min_rounds`` have run and the 95% interval of
every configuration's median is within ``target_precision`` of it, or the rounds have taken the
budget, or ``max_rounds`` have run; each record says the precision it reached. Given a
``StopCriterion`` (``--benchmark-compare`` gives ``ddp.analysis.compare.AimAtDecision``), rounds
are added until it says the comparison is settled instead.

``measure_in_groups`` spreads a measurement's rounds over groups of ranks started apart, a block
on each in turn, each group building and warming up its own models, the rounds in all as many as
one group would run; every round keeps its group (``Measurement.round_groups``) for the
two-level intervals of ``ddp.bench.results.stats``. Why (a median moves between processes more
than one process's interval admits): docs/regression-gate.md, "Rounds from groups of ranks". On
CUDA each group is a set of processes with CUDA contexts of their own on the same GPUs, and NCCL
a communicator per group: a group's models are freed and its cached blocks handed back before
the next group builds where the two would not fit together (``ddp.bench.memory.predict.fit``).

``ranks`` is anything with ``world_size`` and ``run(fn, *args) -> [result per rank]``: a
``ddp.launcher.RankGroup``, or ``InProcessRanks`` when this process is one of torchrun's ranks
(then the job is the only group, and the gate calls no slowdown from it alone).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch.distributed as dist

from ddp.bench.config.options import INTERLEAVE, RoundOptions
from ddp.bench.config.shape import cannot_run
from ddp.bench.config.step_config import StepConfig
from ddp.bench.memory.predict import NotBuilt, device_memory_bytes, fit, too_large
from ddp.bench.results.stats import relative_half_width
from ddp.bench.rounds.ledger import PREDICTIONS, Ledger
from ddp.bench.rounds.rank_state import (
    OutOfMemory,
    RankCannotRun,
    RankLost,
    first_withdrawn,
    prepare,
    release,
    return_cached_memory,
    set_model_reuse,
    skip_reason,
    take_ledger,
    timed_round,
    traced,
)
from ddp.bench.rounds.reuse import restorable, workload_key
from ddp.bench.rounds.trainer import StepSetup, StepTiming
from ddp.launcher import Rank, RankKilled, call_on_rank
from ddp.strategies.registry import FLOOR

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
    traces: list[list[list[dict]]] | None = None
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

    outcome = timed_rounds(lambda index: ranks.run(timed_round, configs, index), policy, budget_scale=benchmarks,
                           settled=None if stop is None else settled)
    if isinstance(outcome, (OutOfMemory, RankCannotRun)):
        return NotRun(configs[0], outcome)
    per_round, precision = outcome
    # per round, per rank, per configuration -> per round, per configuration, per rank
    rounds = [[[per_rank[index] for per_rank in round_] for index in range(len(configs))] for round_ in per_round]
    setups_by_config = [[rank_setups[index] for rank_setups in setups] for index in range(len(configs))]
    return Measurement(configs, setups_by_config, rounds, precision, policy.target_precision, traces=traces,
                       round_groups=[group] * len(rounds))


def group_share(policy: RoundOptions, groups: int, index: int = 0) -> RoundOptions:
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


def active_groups(groups: Sequence, policy: RoundOptions) -> list:
    """The groups that get rounds: all of them, or as many as ``policy.max_rounds`` where it is smaller."""
    return list(groups)[:max(1, min(len(groups), policy.max_rounds))]


def measure_in_groups(groups: Sequence, configs: Sequence[StepConfig], policy: RoundOptions, benchmarks: int = 1,
                      stop: StopCriterion | None = None, keep_built: bool = True, traced_steps: int = 0) -> Measurement | NotRun:
    """``measure`` with the rounds spread over ``groups`` of ranks, a block on each in turn
    (module docstring), each block's round policy ``group_share``; ``stop`` judges the last
    group's rounds together with the others' (the earlier blocks stop on their precision target
    or budget). ``keep_built``: each group keeps its configurations built once its block is done
    (False where the next group's build would not fit beside them: they are freed and, on CUDA,
    the cached blocks handed back); the last group keeps them built, as ``measure`` does.
    ``traced_steps``: the last group's fresh builds run that many traced steps in their warm-up
    (``measure``)."""
    configs = list(configs)
    groups = active_groups(groups, policy)
    if len(groups) == 1:
        return measure(groups[0], configs, policy, benchmarks, stop, traced_steps=traced_steps)
    blocks: list[Measurement] = []
    for index, ranks in enumerate(groups):
        seconds = [[s for block in blocks for s in block.round_seconds(c)] for c in range(len(configs))]
        labels = [g for block in blocks for g in block.round_groups]
        last = index == len(groups) - 1
        share = group_share(policy, len(groups), index)
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


def trace(ranks, configs: Sequence[StepConfig], policy: RoundOptions, keep_built: bool = False) -> list[list[list[dict]]] | None:
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


def free(ranks) -> None:
    """Free whatever the ranks keep built."""
    ranks.run(release)


class InProcessRanks:
    """``RankGroup``'s ``run`` for a process that is itself one of the ranks (under torchrun):
    run the function here and gather every rank's result to every rank, so that all of them take
    the same decisions (skip on out of memory, stop adding rounds).

    Results travel on a gloo group of their own with a timeout: a rank that ran out of memory
    alone cannot be joined by the others (they wait in a collective it left), and rather than hang
    until the NCCL watchdog, its gather fails after ``GATHER_TIMEOUT_SECONDS`` and the job ends with
    that rank's out-of-memory message (torchrun then stops the other ranks)."""

    GATHER_TIMEOUT_SECONDS = 60.0

    def __init__(self, rank: Rank) -> None:
        self.rank = rank
        self.world_size = rank.info.world_size
        self.backend = rank.info.backend
        self.device = rank.info.device.type
        self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.GATHER_TIMEOUT_SECONDS))

    def run(self, fn, *args, **kwargs) -> list:
        result = call_on_rank(self.rank, fn, args, kwargs)
        results = [None] * self.world_size
        try:
            dist.all_gather_object(results, result, group=self._group)
        except RuntimeError as error:
            if isinstance(result, OutOfMemory):
                raise RuntimeError(
                    f"rank {result.rank} ran out of memory alone ({result.message}) and the other ranks are waiting "
                    "in a collective it left: ending the job; use a smaller --batch-sizes, --seq-lens or --model"
                ) from error
            if isinstance(result, RankCannotRun):
                raise RuntimeError(
                    f"rank {result.rank} alone cannot run this configuration ({result.message}) and the other ranks are "
                    "waiting in a collective it left: ending the job"
                ) from error
            raise
        return results


IN_GROUP = "in group"
"""``GridMeasurer``'s tracer on CPU: each configuration traced where it was timed."""


class GridMeasurer:
    """Measures a grid's configurations as ``interleave`` says, and hands out each one's record.

    - ``group``: every strategy of one group (``StepConfig.group``) in the same rounds, ``local``
      included (added if the grid lacks it): each round holds one step of each, so every
      comparison inside the group, the overhead over ``local`` too, is paired over rounds, and no
      step is spent on a local twin per benchmark. Holds the group's models at once.
    - ``local``: each configuration with a ``local`` twin in the same rounds (two models at once).
    - ``off``: each configuration alone (one model at once; no paired overhead).

    A configuration predicted not to fit alone (``ddp.bench.memory.predict``) is never built: it is
    skipped with its predicted and available memory, and the next one runs. A group predicted not
    to fit together is measured one configuration at a time, each with its ``local`` twin where
    the two fit; a group that runs out of memory all the same is measured again that way, so that
    one configuration too large does not take the others with it. A rank that a signal ends
    meanwhile (the host's out-of-memory killer: ``ddp.launcher.RankKilled``) skips the
    measurement with a ``RankLost`` naming it; its group starts fresh ranks for the next.

    With more than one group of ranks (``groups``), each measurement's rounds are spread over all
    of them (``measure_in_groups``), ``ranks`` first.

    With ``policy.traced_steps``, each configuration is then traced once (``trace``) on
    ``tracer``, ranks of the same size, backend and device that time nothing, one configuration at
    a time, so that no timed round of ``ranks`` ever follows a profiler in its process; where the
    tracer's build does not fit beside what ``ranks`` hold, ``ranks`` free theirs first. That is
    the CUDA layout (the profiler leaves CUPTI attached: ``trace``). With ``tracer`` ``IN_GROUP``
    (CPU, where nothing stays attached) each configuration is traced on the last group of ranks
    right after its rounds, as it is built there: no third group, no build, no warm-up. Without a
    tracer nothing is traced here: ``trace_all`` traces every measurement once the timing is over.
    """

    def __init__(self, ranks, configs: Sequence[StepConfig], policy: RoundOptions, interleave: str,
                 stop: StopCriterion | None = None, tracer=None, memory_bytes: int | None = None,
                 more_groups: Sequence = (), ledger: Ledger | None = None) -> None:
        """``stop``: rounds aimed at a comparison (``measure``'s), for every measurement of the grid;
        ``tracer``: the ranks that run the traced steps (see the class docstring); ``memory_bytes``:
        the memory of a rank's device to fit configurations in (None: what the ranks have);
        ``more_groups``: groups of ranks like ``ranks``, started apart, that share every
        measurement's rounds with it; ``ledger``: where the time of each part of the work goes
        (``ddp.bench.rounds.ledger``; a run's, shared by its grids), else one of its own."""
        if interleave not in INTERLEAVE:
            raise ValueError(f"interleave must be one of {', '.join(INTERLEAVE)}, got {interleave!r}")
        self.ranks = ranks
        self.groups = [ranks, *more_groups]
        self.configs = list(configs)
        self.policy = policy
        self.interleave = interleave
        self.stop = stop
        self.tracer = tracer
        self._measured: dict[StepConfig, tuple[Measurement, int, int | None] | NotRun] = {}
        self._alone: set[StepConfig] = set()
        self._traced: dict[StepConfig, list[list[dict]]] = {}
        self._memory_bytes = memory_bytes
        self.ledger = ledger if ledger is not None else Ledger()
        self._reusing = False
        """Whether the timing groups keep model copies now (``_timed``: where they fit)."""
        self.unpaired: dict[StepConfig, str] = {}
        """Why a configuration ran without its ``local`` twin where the grid pairs them (the record's
        ``unpaired_reason``)."""

    def _take_ledgers(self) -> None:
        """Add what every started group of ranks spent since the last call to ``ledger``: the
        first rank's figures (the ranks of a group run the same steps in step)."""
        for ranks in [*self.groups, self.tracer]:
            if ranks is not None and ranks is not IN_GROUP and getattr(ranks, "usable", True):
                self.ledger.merge(ranks.run(take_ledger)[0])

    def record_counts(self, config: StepConfig) -> dict[str, int]:
        """The builds, warm-up steps, memory counts and traced steps ``config`` took, over every
        group of ranks (``ddp.bench.rounds.ledger.RECORD_FIELDS``)."""
        return self.ledger.record_counts(config)

    def _fit(self, configs: Sequence[StepConfig], world_size: int, copies: Sequence[StepConfig] = ()):
        """``fit``, counting every rank process that shares a device (one per group of ranks and
        the tracer's) and the models kept for reuse."""
        memory = self._memory()
        processes = len(self.groups) + (1 if self.tracer not in (None, IN_GROUP) else 0)
        with self.ledger.timing(PREDICTIONS):
            return fit(configs, memory, world_size, processes, self.ranks.device, copies)

    def _memory(self) -> int:
        """The smallest memory a rank may use (``ddp.bench.memory.predict.device_memory_bytes``), asked once."""
        if self._memory_bytes is None:
            self._memory_bytes = min(self.ranks.run(device_memory_bytes))
        return self._memory_bytes

    def _not_built(self, config: StepConfig) -> str | None:
        """Why ``config`` is not built on these ranks (``NotBuilt``: a step its strategy or model
        cannot run, or a peak predicted not to fit), or None."""
        memory = self._memory()
        with self.ledger.timing(PREDICTIONS):
            return cannot_run(config) or too_large(config, self.ranks.world_size, memory)

    def _copies(self, members: Sequence[StepConfig]) -> list[StepConfig]:
        """The kept model copies ``members`` hold beside them: one per workload and group of ranks
        (``ddp.bench.rounds.reuse``), what ``fit`` counts as ``copies``."""
        return list({workload_key(c): c for c in members if restorable(c)}.values()) * len(self.groups)

    def _timed(self, members: list[StepConfig], benchmarks: int = 1) -> Measurement | NotRun:
        """``members`` measured on every group of ranks; each group keeps them built where the
        groups' builds fit in a device's memory together (one process per rank and group)."""
        copies = self._copies(members)
        held = members * len(self.groups)
        reuse = bool(copies) and self._fit(held, self.ranks.world_size, copies).together
        together = reuse or self._fit(held, self.ranks.world_size).together
        self._reusing = reuse
        try:
            for ranks in self.groups:
                ranks.run(set_model_reuse, reuse)
            if not together:  # what the last group kept of the previous measurement would be in the way
                self._free()
                for ranks in self.groups:
                    ranks.run(return_cached_memory)
            # On CPU the last group traces each fresh build in its warm-up (``IN_GROUP``).
            traced = self.policy.traced_steps if self.tracer is IN_GROUP else 0
            return measure_in_groups(self.groups, members, self.policy, benchmarks, self.stop, keep_built=together,
                                     traced_steps=traced)
        except RankKilled as error:  # its group was ended; the next call starts fresh ranks
            return NotRun(members[0], RankLost.of(error))
        finally:
            self._take_ledgers()

    def _free(self) -> None:
        for ranks in self.groups:
            free(ranks)

    def measurement(self, config: StepConfig) -> tuple[Measurement, int, int | None] | NotRun:
        """(measurement, index of ``config`` in it, index of its local or None), or the out of memory."""
        if config not in self._measured and (reason := self._not_built(config)):
            self._measured[config] = NotRun(config, NotBuilt(reason))
        if config not in self._measured:
            if self.interleave == "group" and config.group not in self._alone:
                self._measure_group(config)
            elif self.interleave == FLOOR and config.strategy == FLOOR:
                self._measure_local_from_twins(config)
            if config not in self._measured:
                self._measure_alone(config)
        return self._measured[config]

    def _measure_local_from_twins(self, local: StepConfig) -> None:
        """With ``interleave`` local, the ``local`` benchmark is its twin's rounds while every other
        strategy of its group was measured: spread over the whole group's time rather than a few
        seconds of its own, so that a burst of load on a shared machine moves its median little."""
        others = [c for c in self.configs if c.group == local.group and c.strategy != FLOOR]
        pairs = [self.measurement(c) for c in others]
        pairs = [p for p in pairs if not isinstance(p, NotRun)]
        if not pairs:
            return  # nothing measured beside it: measured alone
        rounds = [[round_[twin]] for measurement, _, twin in pairs for round_ in measurement.rounds]
        labels = [g for measurement, _, _ in pairs for g in measurement.round_groups or [0] * len(measurement.rounds)]
        setups = [pairs[0][0].setups[pairs[0][2]]]
        seconds = [max(t.seconds for t in round_[0]) for round_ in rounds]
        first, _, twin = pairs[0]
        traces = None if first.traces is None else [first.traces[twin]]  # the twin's traced steps: the same configuration
        measurement = Measurement([local], setups, rounds, relative_half_width(seconds, groups=labels),
                                  self.policy.target_precision, traces=traces, round_groups=labels)
        self._measured[local] = (measurement, 0, None)

    def _measure_group(self, config: StepConfig) -> None:
        group = [c for c in self.configs if c.group == config.group and not self._not_built(c)]
        local = next((c for c in group if c.strategy == FLOOR), None) or config.local_twin()
        members = [local] + [c for c in group if c != local]
        if self._not_built(local) or not self._fit(members, self.ranks.world_size).together:
            self._alone.add(config.group)
            return
        result = self._timed(members, benchmarks=len(group))
        if isinstance(result, NotRun):
            self._free()
            self._alone.add(config.group)
            return
        if self.tracer is not None:
            self._trace(result, self.tracer)
        for index, member in enumerate(members):
            self._measured[member] = (result, index, None if index == 0 else 0)

    def _measure_alone(self, config: StepConfig) -> None:
        unpaired = None
        if self.interleave != "off" and config.strategy != FLOOR:
            twin = config.local_twin()
            together = None if self._not_built(twin) else self._fit([config, twin], self.ranks.world_size)
            if together is None:
                unpaired = f"its {FLOOR} twin is not built: {self._not_built(twin)}"
            elif not together.together:  # each fits alone, not the two at once
                unpaired = f"it and its {FLOOR} twin are predicted not to fit together ({together.explain()})"
        paired = self.interleave != "off" and config.strategy != FLOOR and unpaired is None
        members = [config, config.local_twin()] if paired else [config]
        result = self._timed(members)
        if isinstance(result, NotRun) and paired and isinstance(result.marker, (OutOfMemory, RankLost)):
            # Predicted to fit together, but ran out of memory (or the host's out-of-memory killer
            # ended a rank): alone, as a group that does.
            unpaired = (f"it and its {FLOOR} twin could not run together "
                        f"({skip_reason(config, self.ranks.world_size, result.marker)})")
            self._free()
            paired, members = False, [config]
            result = self._timed(members)
        if unpaired is not None:
            self.unpaired[config] = unpaired
        if isinstance(result, NotRun):
            self._free()
            self._measured[config] = result
            return
        if self.tracer is not None:
            self._trace(result, self.tracer)
        self._measured[config] = (result, 0, 1 if paired else None)

    def _trace(self, measurement: Measurement, ranks) -> None:
        """Give ``measurement`` the traced steps of each of its configurations, ``local`` included
        (every row carries what bounds its step), run on ``ranks`` one configuration at a time;
        ``self.ranks`` free what they hold first where the two do not fit together. A
        configuration traced before in this grid (a ``local`` twin shared by a group's
        benchmarks) keeps its traced steps: it is not traced again."""
        if self.policy.traced_steps == 0:
            return
        in_group = ranks is IN_GROUP
        if in_group:
            ranks = self.groups[-1]  # the group that timed last keeps the configurations built
            for config, rank_traces in zip(measurement.configs, measurement.traces or []):
                if any(rank_traces):  # traced in its warm-up there (``_timed``)
                    self._traced.setdefault(config, rank_traces)
        elif ranks is not self.ranks:
            for group in self.groups:
                group.run(return_cached_memory)  # the timed rounds' peak, cached, would not leave room
        traces = []
        for config in measurement.configs:
            if config not in self._traced:
                held = measurement.configs * len(self.groups)
                # The timing groups keep their configurations built, and their model copies where
                # reuse is on: both share the device with the tracer's build.
                copies = self._copies(measurement.configs) if self._reusing else []
                if not in_group and ranks is not self.ranks and \
                        not self._fit([*held, config], len(measurement.setups[0]), copies).together:
                    self._free()
                try:
                    traced_steps = trace(ranks, [config], self.policy, keep_built=in_group)
                except RankKilled as error:  # as out of memory under the profiler: the timing stands
                    warnings.warn(f"{config.describe()} not traced: {error.summary}", RuntimeWarning, stacklevel=2)
                    traced_steps = None
                self._take_ledgers()
                if traced_steps is None:
                    return  # could not run (out of memory under the profiler): no collectives in the record
                self._traced[config] = traced_steps[0]
            traces.append(self._traced[config])
        measurement.traces = traces

    def trace_all(self) -> None:
        """Trace every measurement on ``self.ranks``, once nothing more is timed on them (``ddp run``)."""
        done = set()
        for result in self._measured.values():
            if not isinstance(result, NotRun) and id(result[0]) not in done and result[0].traces is None:
                done.add(id(result[0]))
                self._trace(result[0], self.ranks)


BLOCKS = 2  # forward then reversed order: the fewest blocks in which a linear drift cancels


def measure_in_blocks(ranks, configs: Sequence[StepConfig], policy: RoundOptions, collect=None, collect_for=None,
                      blocks: int = BLOCKS) -> tuple[Measurement | NotRun, dict]:
    """``measure`` for configurations that do not fit in memory together: each is built alone,
    runs a block of rounds and is freed, in the order given and then reversed (A B C, C B A, ...).

    Round i of a configuration's block is paired with round i of every other configuration's block
    of the same index, so each paired comparison is between steps at most one block apart instead
    of one round apart: drift slower than a block cancels in the ratios, and the reversed order
    cancels a drift that is linear over the whole race; a faster drift widens the intervals
    instead of biasing them. Every block is a fresh build with its own warm-up, so the time to
    build is not in the rounds. Rounds: ``policy.min_rounds`` in all, split evenly among the
    blocks (at least one each); the precision target and budget are not used.

    ``collect(config)``, a rank function, runs after the last block of each configuration in
    ``collect_for`` (default: all), while it is still built (e.g. ``weights_sample``); returns
    (measurement, {config: per-rank results})."""
    configs = list(configs)
    blocks = max(1, min(blocks, policy.min_rounds))
    block_policy = RoundOptions.fixed(-(-policy.min_rounds // blocks), policy.warmup_rounds)
    timings: dict[StepConfig, list] = {config: [] for config in configs}
    setups: dict[StepConfig, list[StepSetup]] = {}
    collected = {}
    for block in range(blocks):
        order = configs if block % 2 == 0 else configs[::-1]
        for config in order:
            result = measure(ranks, [config], block_policy, fixed_warmup=True)
            if isinstance(result, NotRun):
                free(ranks)
                return result, collected
            setups.setdefault(config, result.setups[0])
            timings[config] += [round_[0] for round_ in result.rounds]
            if collect is not None and block == blocks - 1 and (collect_for is None or config in collect_for):
                collected[config] = ranks.run(collect, config)
            free(ranks)
    count = min(len(rounds) for rounds in timings.values())
    rounds = [[timings[config][index] for config in configs] for index in range(count)]
    precision = max(relative_half_width([max(t.seconds for t in per_rank) for per_rank in timings[config]]) for config in configs)
    return Measurement(configs, [setups[config] for config in configs], rounds, precision, policy.target_precision), collected
