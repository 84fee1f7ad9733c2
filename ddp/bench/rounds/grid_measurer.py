"""``GridMeasurer``: how a grid's configurations share rounds (``--interleave``), what is built
together and what fits (``ddp.bench.memory.predict``), where each configuration's traced steps run,
and each one's record counts.

Words, one meaning each: a *rank group* is a ``ddp.launcher.RankGroup`` (``ranks``, ``rank_groups``:
the timing groups, ``tracer``); a *grid group* is ``StepConfig.group``, the configurations that
differ only in their strategy (a strategy's ``local`` twin is its grid group's floor); *members*
are the configurations timed together in one measurement.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from ddp.bench.config.options import INTERLEAVE, RoundOptions
from ddp.bench.config.shape import RecordedStep, cannot_run
from ddp.bench.config.step_config import StepConfig
from ddp.bench.memory.predict import NotBuilt, device_memory_bytes, fit, too_large
from ddp.bench.results.stats import relative_half_width
from ddp.bench.rounds.ledger import PREDICTIONS, Ledger
from ddp.bench.rounds.loop import Measurement, NotRun, StopCriterion, free
from ddp.bench.rounds.rank_state import (
    OutOfMemory,
    RankLost,
    return_cached_memory,
    set_model_reuse,
    skip_reason,
    take_ledger,
)
from ddp.bench.rounds.reuse import restorable, workload_key
from ddp.bench.rounds.spread import measure_in_rank_groups
from ddp.bench.rounds.traced import trace
from ddp.launcher import RankKilled
from ddp.strategies.registry import FLOOR, is_floor

IN_GROUP = "in group"
"""``GridMeasurer``'s tracer on CPU: each configuration traced where it was timed."""


class GridMeasurer:
    """Measures a grid's configurations as ``interleave`` says, and hands out each one's record.

    - ``group``: every strategy of one grid group (``StepConfig.group``) in the same rounds,
      ``local`` included (added if the grid lacks it): each round holds one step of each, so every
      comparison inside the grid group, the overhead over ``local`` too, is paired over rounds,
      and no step is spent on a local twin per benchmark. Holds the grid group's models at once.
    - ``local``: each configuration with a ``local`` twin in the same rounds (two models at once).
    - ``off``: each configuration alone (one model at once; no paired overhead).

    A configuration predicted not to fit alone (``ddp.bench.memory.predict``) is never built: it is
    skipped with its predicted and available memory, and the next one runs. A grid group predicted
    not to fit together is measured one configuration at a time, each with its ``local`` twin
    where the two fit; one that runs out of memory all the same is measured again that way, so
    that one configuration too large does not take the others with it. A rank that a signal ends
    meanwhile (the host's out-of-memory killer: ``ddp.launcher.RankKilled``) skips the
    measurement with a ``RankLost`` naming it; its rank group starts fresh ranks for the next.

    With more than one rank group (``rank_groups``: ``ranks`` first), each measurement's rounds
    are spread over all of them (``ddp.bench.rounds.spread.measure_in_rank_groups``).

    With ``policy.traced_steps``, each configuration is traced once (``trace``) on ``tracer``,
    ranks of the same size, backend and device that time nothing, one configuration at a time, so
    that no timed round of ``ranks`` ever follows a profiler in its process; where the tracer's
    build does not fit beside what the timing rank groups hold (their models and kept copies),
    they free theirs first. That is the CUDA layout (the profiler leaves CUPTI attached:
    ``trace``). With ``tracer`` ``IN_GROUP`` (CPU, where nothing stays attached) each fresh build
    of the last rank group runs its traced steps in its warm-up, before that group's rounds
    (``RankBench.prepare``'s ``traced_steps``): no third rank group, no build, no step of its own.
    Without a tracer nothing is traced here: ``trace_all`` traces every measurement once the
    timing is over.
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
        self.rank_groups = [ranks, *more_groups]
        self.configs = list(configs)
        self.policy = policy
        self.interleave = interleave
        self.stop = stop
        self.tracer = tracer
        self._measured: dict[StepConfig, tuple[Measurement, int, int | None] | NotRun] = {}
        self._alone: set[StepConfig] = set()
        self._traced: dict[StepConfig, list[list[RecordedStep]]] = {}
        self._memory_bytes = memory_bytes
        self.ledger = ledger if ledger is not None else Ledger()
        self._reusing = False
        """Whether the timing groups keep model copies now (``_timed``: where they fit)."""
        self.unpaired: dict[StepConfig, str] = {}
        """Why a configuration ran without its ``local`` twin where the grid pairs them (the record's
        ``unpaired_reason``)."""

    def _take_ledgers(self, keep: bool = True) -> None:
        """Add what every started group of ranks spent since the last call to ``ledger``: the
        first rank's figures (the ranks of a group run the same steps in step). ``keep=False``:
        empty them instead, before this grid's work, of what others did on the same ranks (a
        test's or the harness check's builds of the same configurations), which is not its cost."""
        for ranks in [*self.rank_groups, self.tracer]:
            if ranks is not None and ranks is not IN_GROUP and getattr(ranks, "usable", True):
                taken = ranks.run(take_ledger)[0]
                if keep:
                    self.ledger.merge(taken)

    def record_counts(self, config: StepConfig) -> dict[str, int]:
        """The builds, warm-up steps, memory counts and traced steps ``config`` took, over every
        group of ranks (``ddp.bench.rounds.ledger.RECORD_FIELDS``)."""
        return self.ledger.record_counts(config)

    def _fit(self, configs: Sequence[StepConfig], world_size: int, copies: Sequence[StepConfig] = ()):
        """``fit``, counting every rank process that shares a device (one per group of ranks and
        the tracer's) and the models kept for reuse."""
        memory = self._memory()
        processes = len(self.rank_groups) + (1 if self.tracer not in (None, IN_GROUP) else 0)
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
        return list({workload_key(c): c for c in members if restorable(c)}.values()) * len(self.rank_groups)

    def _timed(self, members: list[StepConfig], benchmarks: int = 1) -> Measurement | NotRun:
        """``members`` measured on every group of ranks; each group keeps them built where the
        groups' builds fit in a device's memory together (one process per rank and group)."""
        copies = self._copies(members)
        held = members * len(self.rank_groups)
        reuse = bool(copies) and self._fit(held, self.ranks.world_size, copies).together
        together = reuse or self._fit(held, self.ranks.world_size).together
        self._reusing = reuse
        self._take_ledgers(keep=False)
        try:
            for ranks in self.rank_groups:
                ranks.run(set_model_reuse, reuse)
            if not together:  # what the last group kept of the previous measurement would be in the way
                self._free()
                for ranks in self.rank_groups:
                    ranks.run(return_cached_memory)
            # On CPU the last group traces each fresh build in its warm-up (``IN_GROUP``).
            traced = self.policy.traced_steps if self.tracer is IN_GROUP else 0
            return measure_in_rank_groups(self.rank_groups, members, self.policy, benchmarks, self.stop, keep_built=together,
                                     traced_steps=traced)
        except RankKilled as error:  # its group was ended; the next call starts fresh ranks
            return NotRun(members[0], RankLost.of(error))
        finally:
            self._take_ledgers()

    def _free(self) -> None:
        for ranks in self.rank_groups:
            free(ranks)

    def measurement(self, config: StepConfig) -> tuple[Measurement, int, int | None] | NotRun:
        """(measurement, index of ``config`` in it, index of its local or None), or the out of memory."""
        if config not in self._measured and (reason := self._not_built(config)):
            self._measured[config] = NotRun(config, NotBuilt(reason))
        if config not in self._measured:
            if self.interleave == "group" and config.group not in self._alone:
                self._measure_grid_group(config)
            elif self.interleave == FLOOR and is_floor(config.strategy):
                self._measure_local_from_twins(config)
            if config not in self._measured:
                self._measure_alone(config)
        return self._measured[config]

    def _measure_local_from_twins(self, local: StepConfig) -> None:
        """With ``interleave`` local, the ``local`` benchmark is its twin's rounds while every other
        strategy of its group was measured: spread over the whole group's time rather than a few
        seconds of its own, so that a burst of load on a shared machine moves its median little."""
        others = [c for c in self.configs if c.local_twin() == local and not is_floor(c.strategy)]
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

    def _measure_grid_group(self, config: StepConfig) -> None:
        grid_group = [c for c in self.configs if c.group == config.group and not self._not_built(c)]
        floors = list(dict.fromkeys([config.group, *(c.local_twin() for c in grid_group)]))  # local first
        members = floors + [c for c in grid_group if c not in floors]
        if any(self._not_built(f) for f in floors) or not self._fit(members, self.ranks.world_size).together:
            self._alone.add(config.group)
            return
        result = self._timed(members, benchmarks=len(grid_group))
        if isinstance(result, NotRun):
            self._free()
            self._alone.add(config.group)
            return
        if self.tracer is not None:
            self._trace(result, self.tracer)
        for index, member in enumerate(members):
            self._measured[member] = (result, index, None if is_floor(member.strategy) else members.index(member.local_twin()))

    def _measure_alone(self, config: StepConfig) -> None:
        unpaired = None
        if self.interleave != "off" and not is_floor(config.strategy):
            twin = config.local_twin()
            together = None if self._not_built(twin) else self._fit([config, twin], self.ranks.world_size)
            if together is None:
                unpaired = f"its {FLOOR} twin is not built: {self._not_built(twin)}"
            elif not together.together:  # each fits alone, not the two at once
                unpaired = f"it and its {FLOOR} twin are predicted not to fit together ({together.explain()})"
        paired = self.interleave != "off" and not is_floor(config.strategy) and unpaired is None
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
            ranks = self.rank_groups[-1]  # the group that timed last keeps the configurations built
            for config, rank_traces in zip(measurement.configs, measurement.traces or []):
                if any(rank_traces):  # traced in its warm-up there (``_timed``)
                    self._traced.setdefault(config, rank_traces)
        elif ranks is not self.ranks:
            for rank_group in self.rank_groups:
                rank_group.run(return_cached_memory)  # the timed rounds' peak, cached, would not leave room
        traces = []
        for config in measurement.configs:
            if config not in self._traced:
                held = measurement.configs * len(self.rank_groups)
                # The timing groups keep their configurations built, and their model copies where
                # reuse is on: both share the device with the tracer's build.
                copies = self._copies(measurement.configs) if self._reusing else []
                if not in_group and ranks is not self.ranks and \
                        not self._fit([*held, config], len(measurement.setups[0]), copies).together:
                    self._free()
                self._take_ledgers(keep=False)
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
