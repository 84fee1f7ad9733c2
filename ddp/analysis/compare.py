"""Regression checks that know noise: two runs compared benchmark by benchmark, each ratio
new / old with its 95% interval, and a verdict that only a significant slowdown beyond the
threshold can fail.

- ``decide``: one benchmark's verdict at a threshold t (0.10 is 10%), from its raw ratio, its
  ratio paired with the ``local`` rounds beside it and ``local``'s own ratio: *slower* (fails),
  *machine slower* (the step moved no more than ``local``: reported, not gated), *unchanged*,
  *faster*, or *not resolved* (beyond a threshold but within noise). Nothing but *not resolved*
  is read from fewer than ``MIN_ROUNDS_TO_JUDGE`` rounds, or from a run of one group of ranks.
- ``settled`` and ``AimAtDecision``: whether more rounds could still change a verdict; the
  timing loop (``ddp.bench.rounds.loop.timed_rounds``) stops on it under ``--benchmark-compare``.
- ``gate``: the one gate, for ``ddp compare`` and pytest's ``--ddp-fail-slower`` alike (exit status
  1 on a slowdown), and ``table``, the one comparison table.

The rule, why it pairs with ``local`` and how it guards against a machine that got faster, and the
false-alarm rate and power it was measured to have: docs/regression-gate.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ddp.analysis.figures import machine_differences
from ddp.analysis.tables import ms, ratio_interval
from ddp.analysis.tables import table as render
from ddp.bench.config.parsing import MAX_ROUNDS
from ddp.bench.results.records import EXPOSED_CHANGED_IN, Run
from ddp.bench.results.stats import (
    Groups,
    Verdict,
    clear_of_threshold,
    group_count,
    groups_to_decide,
    machine_adjusted_ratio_ci,
    ratio_of_medians_ci,
    verdict,
)
from ddp.strategies.registry import is_floor

DEFAULT_THRESHOLD = 0.10
"""The gate's threshold unless told: ``ddp compare --fail-slower``, pytest's ``--ddp-fail-slower``
and the rounds aimed at it, and the comparison in a report."""


RAW = "raw"
PAIRED = "paired with local"
ADJUSTED = "adjusted for the machine"
MACHINE_REFERENCE = "raw (machine reference, not gated)"


def machine_reference(record) -> str | None:
    """Why a benchmark is one of the machine's references, reported and never gated, or None where
    it is gated. ``local``: the step with nothing to synchronize. Every all-reduce: it times the
    backend on this machine, which no DDP's code changes, and has no twin in its rounds to take the
    machine out: between unchanged default runs on this project's 2-core machine, one all-reduce in
    six or two moved by x1.19 to x1.31 in 3 pairs of 7, ``local`` anywhere from x0.98 to x1.11
    (docs/regression-gate.md)."""
    if is_floor(strategy := getattr(record, "strategy", None)):
        return f"{strategy} is the machine's reference"
    if getattr(record, "kind", None) == "allreduce":
        return "an all-reduce times the backend on this machine, which a DDP's code does not change"
    return None


MACHINE = "machine"  # the prefix of the verdicts a moved machine explains: "machine slower", "machine faster"


MIN_ROUNDS_TO_JUDGE = 20
"""No ratio is judged (slower, faster or unchanged) from fewer rounds in either run: a percentile bootstrap of
a median is too narrow on a handful of samples (its resamples take few distinct values; Efron and
Tibshirani 1993, section 7.3), and the distribution-free interval of a median needs 6 to reach 95%
at all. On this project's shared 2-core machine, 10 rounds once resolved an unchanged step x0.85
[0.65, 0.94] against a saved run."""


@dataclass(frozen=True)
class Ratio:
    """new / old with its 95% bootstrap interval, its verdict at the threshold
    (``ddp.bench.results.stats.verdict``), and whether the interval lies clear of the threshold's edges."""

    point: float
    low: float
    high: float
    verdict: Verdict
    clear: bool
    """``ddp.bench.results.stats.clear_of_threshold``: more rounds would hardly change the verdict."""

    @classmethod
    def judged(cls, point: float, low: float, high: float, threshold: float, rounds: int) -> Ratio:
        """``rounds``: the fewer of the two runs' rounds; below ``MIN_ROUNDS_TO_JUDGE`` every ratio
        is *not resolved*, within the threshold or beyond it, significant or not."""
        judged = verdict(point, low, high, threshold)
        if rounds < MIN_ROUNDS_TO_JUDGE:
            judged = Verdict.NOT_RESOLVED
        return cls(point, low, high, judged, clear_of_threshold(low, high, threshold) and judged is not Verdict.NOT_RESOLVED)

    @classmethod
    def of(cls, new: list[float], old: list[float], threshold: float, new_groups: Groups = None,
           old_groups: Groups = None) -> Ratio:
        interval = ratio_of_medians_ci(new, old, new_groups=new_groups, old_groups=old_groups)
        return cls.judged(*interval, threshold, min(len(new), len(old)))

    @classmethod
    def adjusted(cls, new: list[float], new_local: list[float], old: list[float], old_local: list[float],
                 threshold: float, new_groups: Groups = None, old_groups: Groups = None) -> Ratio:
        interval = machine_adjusted_ratio_ci(new, new_local, old, old_local, new_groups=new_groups, old_groups=old_groups)
        return cls.judged(*interval, threshold, min(len(new), len(old)))

    def __str__(self) -> str:
        return f"x{self.point:.2f} [{self.low:.2f}, {self.high:.2f}]"


@dataclass(frozen=True)
class Decision:
    """The verdict on one benchmark, the basis that decided it and why (docs/regression-gate.md)."""

    verdict: str
    """slower, faster, unchanged, not resolved, machine slower or machine faster."""
    basis: str
    """``RAW``, ``PAIRED``, ``ADJUSTED`` or ``MACHINE_REFERENCE``: the ratio the verdict was read from."""
    why: str
    raw: Ratio
    paired: Ratio | None = None
    """Each round's step / local, where both runs paired them."""
    reference: Ratio | None = None
    """``local``'s own raw ratio, from the rounds interleaved with this step."""
    adjusted: Ratio | None = None
    """The raw ratio with the machine's change taken out of the step's compute share only
    (``ddp.bench.results.stats.machine_adjusted_ratio_ci``), where ``local`` got faster (its interval below 1)."""
    groups: tuple[int, int] = (1, 1)
    """Groups of ranks the old and the new run's rounds came from (``ddp.bench.results.stats.group_count``)."""

    @property
    def ratio(self) -> Ratio:
        """The ratio the verdict was read from."""
        return {PAIRED: self.paired, ADJUSTED: self.adjusted}.get(self.basis) or self.raw


ONE_GROUP = "one group of ranks"


def decide(old_rounds: list[float], new_rounds: list[float], threshold: float, old_local: list[float] | None = None,
           new_local: list[float] | None = None, reference: bool | str = False, old_groups: Groups = None,
           new_groups: Groups = None) -> Decision:
    """Judge one benchmark from its rounds in the two runs (and its ``local`` twin's, where both runs
    paired them), each round's group of ranks given where the rounds were spread over several: the
    rules of the module docstring. ``reference``: the benchmark is one of the machine's references,
    never gated (``machine_reference``: why, where a string). A slowdown is called only from runs of two or more groups each: from
    one group the spread between runs is unmeasured, and the verdict is *not resolved*."""
    decision = _decide(old_rounds, new_rounds, threshold, old_local, new_local, reference, old_groups, new_groups)
    counts = (group_count(old_groups), group_count(new_groups))
    decision = dataclasses.replace(decision, groups=counts)
    if decision.verdict == str(Verdict.SLOWER) and min(counts) < 2:
        which = "the old run's" if counts[0] < 2 else "the new run's"
        return dataclasses.replace(
            decision, verdict=str(Verdict.NOT_RESOLVED),
            why=f"{which} rounds come from {ONE_GROUP}: the spread between runs is not measured, so no slowdown is "
                f"called from them ({decision.why})")
    return decision


def _decide(old_rounds, new_rounds, threshold, old_local, new_local, reference, old_groups, new_groups) -> Decision:
    raw = Ratio.of(new_rounds, old_rounds, threshold, new_groups, old_groups)
    if reference:
        why = reference if isinstance(reference, str) else "local is the machine's reference"
        if raw.verdict in (Verdict.SLOWER, Verdict.FASTER):
            return Decision(f"{MACHINE} {raw.verdict}", MACHINE_REFERENCE, why, raw)
        return Decision(str(raw.verdict), MACHINE_REFERENCE, why, raw)
    paired_both = (old_local and new_local and len(old_local) == len(old_rounds) and len(new_local) == len(new_rounds))
    if not paired_both:
        return Decision(str(raw.verdict), RAW, "no rounds paired with local in both runs", raw)
    paired = Ratio.of([s / f for s, f in zip(new_rounds, new_local)], [s / f for s, f in zip(old_rounds, old_local)],
                      threshold, new_groups, old_groups)
    local = Ratio.of(new_local, old_local, threshold, new_groups, old_groups)
    # Only where the machine resolved faster, and by enough that the bias it gives step / local (at
    # most 1 / L - 1, as the step's compute share goes to 0) could alone carry it past 1 + t.
    machine_faster = local.high < 1.0 and local.low * (1 + threshold) < 1.0
    adjusted = Ratio.adjusted(new_rounds, new_local, old_rounds, old_local, threshold, new_groups,
                              old_groups) if machine_faster else None

    def decision(verdict_: Verdict | str, basis: str, why: str) -> Decision:
        return Decision(str(verdict_), basis, why, raw, paired, local, adjusted)

    if paired.verdict is Verdict.SLOWER:
        if adjusted is None:
            return decision(Verdict.SLOWER, PAIRED, f"step / local judged slower; local {local}")
        if adjusted.verdict is Verdict.SLOWER:
            return decision(Verdict.SLOWER, ADJUSTED, f"local got faster ({local}), and the step adjusted for that "
                                                      f"on its compute share alone is slower too; step / local {paired}")
        return decision(Verdict.NOT_RESOLVED, ADJUSTED,
                        f"step / local {paired} is slower, but local got faster ({local}) and the step adjusted "
                        f"for that on its compute share alone is {adjusted}: a faster machine raises step / local by itself")
    if raw.verdict is Verdict.SLOWER:
        if paired.high <= 1 + threshold:
            return decision(f"{MACHINE} slower", PAIRED,
                            f"the step moved no more than local ({local}): step / local {paired}")
        # Neither ratio settles it: take the machine's change, as local measured it, out of the
        # step's compute share alone (a step that waits or communicates keeps the rest).
        adjusted = Ratio.adjusted(new_rounds, new_local, old_rounds, old_local, threshold, new_groups, old_groups)

        def adjusted_decision(verdict_: Verdict | str, why: str) -> Decision:
            return Decision(str(verdict_), ADJUSTED, why, raw, paired, local, adjusted)

        if adjusted.verdict is Verdict.SLOWER:
            return adjusted_decision(Verdict.SLOWER, f"slower than local's change ({local}) explains on the step's compute "
                                                     f"share: adjusted {adjusted}, step / local {paired}")
        if adjusted.verdict is Verdict.NOT_RESOLVED:
            return adjusted_decision(Verdict.NOT_RESOLVED, f"raw {raw} slower, but with local's change ({local}) taken "
                                                           f"out of the step's compute share it is {adjusted}")
        return adjusted_decision(f"{MACHINE} slower", f"local's change ({local}) on the step's compute share explains it: "
                                                      f"adjusted {adjusted}, step / local {paired}")
    if paired.verdict is not Verdict.NOT_RESOLVED:
        return decision(paired.verdict, PAIRED, f"step / local decided; raw {raw}, local {local}")
    if raw.verdict is Verdict.UNCHANGED and local.verdict is Verdict.FASTER:
        return decision(Verdict.NOT_RESOLVED, PAIRED, f"raw {raw} unchanged but local got faster ({local})")
    return decision(raw.verdict, RAW, f"step / local {paired} within noise; local {local}")


def settled(decision: Decision) -> bool:
    """Whether more rounds could no longer change ``decision``'s verdict or its basis: it is
    decided, and it is *machine slower* (read from the top of step / local's interval, already
    within 1 + t), or its ratio's interval lies clear of the threshold's edges and either it was
    read from the paired (or adjusted) ratio, or no pairing exists, or ``local`` did not move (a raw
    verdict taken while the pairing is still open could turn into *machine slower*)."""
    if decision.verdict == str(Verdict.NOT_RESOLVED):
        return False
    if decision.verdict.startswith(MACHINE):
        return True
    if not decision.ratio.clear:
        return False
    if decision.paired is None or decision.basis in (PAIRED, ADJUSTED):
        return True
    return decision.reference is not None and decision.reference.clear and decision.reference.verdict is Verdict.UNCHANGED


def _rounds_flags(rounds: int) -> str:
    return f"--rounds {rounds}" + (f" --max-rounds {rounds}" if rounds > MAX_ROUNDS else "")


def what_would_decide(name: str, decision: Decision, old_rounds: int, new_rounds: int) -> str:
    """One line for a benchmark the rule left open (*not resolved*): what would decide it."""
    ratio = decision.ratio
    head = f"OPEN: {name} ({decision.basis} {ratio})"
    if min(old_rounds, new_rounds) < MIN_ROUNDS_TO_JUDGE:
        return (f"{head}: a run has fewer than {MIN_ROUNDS_TO_JUDGE} rounds ({old_rounds} old, {new_rounds} new), "
                f"too few to judge; take the runs again with {_rounds_flags(MIN_ROUNDS_TO_JUDGE)} or more")
    old_groups, new_groups = decision.groups
    if min(decision.groups) < 2:  # more rounds would not let a slowdown be called: more groups would
        which = " and ".join(run for run, count in (("old", old_groups), ("new", new_groups)) if count < 2)
        state = "slower by its rounds" if ratio.verdict is Verdict.SLOWER else "beyond the threshold but within noise"
        return (f"{head}: {state}, but the {which} run's rounds come from {ONE_GROUP}, whose spread from one run "
                "to the next is not measured; take it again under pytest with --rank-groups 2 or more "
                "(a torchrun run is one group)")
    moved = decision.reference is not None and decision.reference.verdict in (Verdict.SLOWER, Verdict.FASTER)
    if ratio.verdict is not Verdict.NOT_RESOLVED:  # the adjusted ratio did not confirm a paired slowdown
        return (f"{head}: local moved {decision.reference} between the runs and the step's slowdown may be the "
                "machine's; take both runs again on a quiet machine")
    groups = groups_to_decide(ratio.point, ratio.low, ratio.high, min(decision.groups))
    if groups is None:
        return f"{head}: its interval disagrees with its ratio, too few rounds to judge; take both runs again with more rounds"
    scale = groups / min(decision.groups)
    quiet = f"; local moved {decision.reference}, so a quiet machine may decide it sooner" if moved else ""
    return (f"{head} is beyond the threshold but within the spread of {old_groups} and {new_groups} groups of ranks; "
            f"about {groups} groups in each run, as many rounds each, both taken again (--rank-groups {groups} and "
            f"{scale:.3g} times the rounds: --session-budget or --round-budget, and --rounds), would decide it four "
            f"times in five{quiet}")


@dataclass
class AimedRounds:
    """How one benchmark's rounds aimed at the decision ended."""

    rounds: int
    decision: Decision
    settled: bool
    """False: the budget was spent first (``decision`` is then what those rounds gave)."""


class AimAtDecision:
    """A ``ddp.bench.rounds.loop.StopCriterion``: rounds go on until every configuration of the round
    that ``old`` also measured has a ``settled`` decision against it (``local``, the machine's
    reference, is not waited for). ``name_of(config)`` is the benchmark's name in the saved run.
    ``outcomes`` keeps, per benchmark name, how its rounds ended.

    The decision is recomputed on a geometric schedule (every round up to ``EVERY_ROUND_UNTIL``,
    then each time the rounds grew by a fifth): a check is three bootstraps, which would otherwise
    cost more than a small model's step (0.8 s at 2000 rounds on this project's 2-core machine;
    checks at every fifth's growth cost about six times the last one in all, and overshoot a
    settled decision by at most a fifth of its rounds). The bootstrap's fixed seed makes every rank under torchrun take the
    same decision from the same gathered times."""

    EVERY_ROUND_UNTIL = 20
    GROWTH = 1.2
    MIN_ROUNDS = MIN_ROUNDS_TO_JUDGE
    """No decision settles on fewer new rounds."""

    MIN_SECONDS = 5.0
    """Nor on fewer seconds of new rounds: a machine's speed wanders over seconds, and 20 rounds
    of a 15 ms round are a 0.3 s snapshot of it. On this project's 2-core machine one such
    snapshot of an unchanged ``tiny`` step read x0.63 against the run before, and the next run,
    compared with it, raised a false alarm (docs/regression-gate.md)."""

    def __init__(self, old: Run, threshold: float, name_of) -> None:
        self.old = old.by_name()
        self.threshold = threshold
        self.name_of = name_of
        self.outcomes: dict[str, AimedRounds] = {}
        self._next_check = 0
        self._last_rounds = 0
        self._last_configs: list | None = None

    def __call__(self, configs, seconds: list[list[float]], groups: list[int] | None = None) -> bool | None:
        judged = []
        for index, config in enumerate(configs):
            old = self.old.get(self.name_of(config))
            if is_floor(config.strategy) or old is None or not old.round_seconds:
                continue
            twin = config.local_twin()
            judged.append((self.name_of(config), old, seconds[index], seconds[configs.index(twin)] if twin in configs else None))
        if not judged:
            return None  # nothing saved to compare with: the precision target decides
        rounds = len(seconds[0])
        if rounds <= self._last_rounds or list(configs) != self._last_configs:  # the next measurement's rounds began
            self._next_check = 0
        self._last_rounds, self._last_configs = rounds, list(configs)
        if rounds < self._next_check:
            return False
        self._next_check = rounds + 1 if rounds < self.EVERY_ROUND_UNTIL else int(rounds * self.GROWTH) + 1
        if rounds < self.MIN_ROUNDS:
            return False
        long_enough = sum(map(sum, seconds)) >= self.MIN_SECONDS
        done = True
        for name, old, new_rounds, new_local in judged:
            decision = decide(old.round_seconds, new_rounds, self.threshold,
                              getattr(old.record, "local_round_seconds", None), new_local,
                              old_groups=getattr(old.record, "round_groups", None), new_groups=groups)
            self.outcomes[name] = AimedRounds(rounds, decision, long_enough and settled(decision))
            done = done and self.outcomes[name].settled
        return done


@dataclass(frozen=True)
class BenchmarkComparison:
    name: str
    old_seconds: float | None
    new_seconds: float | None
    ratio: float | None
    """new / old on the basis that decided: the medians' ratio (raw) or of step / local (paired)."""
    ratio_ci95: tuple[float, float] | None
    verdict: str
    """slower, faster, unchanged, not resolved, machine slower/faster, or only in old / only in new / no rounds."""
    basis: str = RAW
    """``raw``: step times; ``paired with local``: each round's step / local (drift-corrected)."""
    why: str = ""
    """Why that basis decided (``Decision.why``)."""
    decision: Decision | None = None
    rounds: tuple[int, int] | None = None
    """Rounds in the old run and in the new one."""


def compare(old: Run, new: Run, threshold: float) -> list[BenchmarkComparison]:
    """Every benchmark of either run, in the new run's order, then those only in the old one."""
    old_by, new_by = old.by_name(), new.by_name()
    rows = []
    for name in list(new_by) + [n for n in old_by if n not in new_by]:
        a, b = old_by.get(name), new_by.get(name)
        if a is None or b is None:
            rows.append(BenchmarkComparison(name, a and a.median_seconds, b and b.median_seconds, None, None,
                                            "only in new" if a is None else "only in old"))
            continue
        config, other = getattr(a.record, "config", None), getattr(b.record, "config", None)
        if config is not None and config != other:
            rows.append(BenchmarkComparison(name, a.median_seconds, b.median_seconds, None, None,
                                            f"different configuration: {config.describe()} vs "
                                            f"{other.describe() if other is not None else 'none'}"))
            continue
        dtypes = getattr(a.record, "compute_dtype", None), getattr(b.record, "compute_dtype", None)
        if dtypes[0] != dtypes[1]:
            described = [f"computes in {d}" if d else "computes in its parameters' dtype" for d in dtypes]
            rows.append(BenchmarkComparison(name, a.median_seconds, b.median_seconds, None, None,
                                            f"different step: {described[0]} vs {described[1]} (FSDP's compute dtype, "
                                            "saved since schema 9)"))
            continue
        if not a.round_seconds or not b.round_seconds:
            rows.append(BenchmarkComparison(name, a.median_seconds, b.median_seconds, b.median_seconds / a.median_seconds,
                                            None, "no rounds saved"))
            continue
        judged = decide(a.round_seconds, b.round_seconds, threshold, getattr(a.record, "local_round_seconds", None),
                        getattr(b.record, "local_round_seconds", None),
                        reference=machine_reference(a.record) or False,
                        old_groups=getattr(a.record, "round_groups", None), new_groups=getattr(b.record, "round_groups", None))
        chosen = judged.ratio
        rows.append(BenchmarkComparison(name, a.median_seconds, b.median_seconds, chosen.point, (chosen.low, chosen.high),
                                        judged.verdict, judged.basis, judged.why, judged,
                                        (len(a.round_seconds), len(b.round_seconds))))
    return rows


def failed(rows: list[BenchmarkComparison]) -> list[BenchmarkComparison]:
    """The benchmarks that fail the gate: significant slowdowns beyond the threshold."""
    return [row for row in rows if row.verdict == str(Verdict.SLOWER)]


def machine_drift(rows: list[BenchmarkComparison]) -> list[BenchmarkComparison]:
    """Benchmarks whose change the machine explains: ``local`` judged slower or faster, and steps
    that moved no more than their ``local`` did (``machine slower``)."""
    return [row for row in rows if row.verdict.startswith(MACHINE)]


def machine_notes(rows: list[BenchmarkComparison]) -> list[str]:
    """The lines that name what the machine explains (``machine_drift``): printed, never failed."""
    drift = machine_drift(rows)
    references = [r for r in drift if r.basis == MACHINE_REFERENCE]
    local = [r for r in references if r.name.startswith("test_step")]
    collectives = [r for r in references if r not in local]
    steps = [r for r in drift if r.basis != MACHINE_REFERENCE]
    lines = []
    if local:
        lines.append(f"NOTE: local, the machine's reference, changed in {len(local)} configuration(s) ("
                     + ", ".join(f"{r.name} x{r.ratio:.2f}" for r in local) + "): the machine (or the model's own "
                     "compute) differed between the runs; this does not fail the gate")
    if collectives:
        lines.append(f"NOTE: {len(collectives)} all-reduce(s) changed (" + ", ".join(f"{r.name} x{r.ratio:.2f}" for r in collectives)
                     + "): they time the backend and the machine, not a DDP's code; reported, never failed")
    if steps:
        lines.append(f"NOTE: {len(steps)} step(s) moved, but no more than their local did ("
                     + ", ".join(r.name for r in steps) + "): blamed on the machine, not failed; if the machine was "
                     "the same, run both again on a quiet machine")
    return lines


def table(rows: list[BenchmarkComparison], tablefmt: str = "simple") -> str:
    """The comparison as a table: what ``ddp compare``, the pytest gate (text) and the report
    (``github``) show."""
    body = [
        [r.name, ms(r.old_seconds, missing="absent"), ms(r.new_seconds, missing="absent"),
         "" if r.ratio is None else f"{r.ratio:.3f}", ratio_interval(r.ratio_ci95), r.verdict, r.basis, r.why]
        for r in rows
    ]
    return render(body, ["benchmark", "old (ms)", "new (ms)", "new / old", "95% interval", "verdict", "basis", "why"], tablefmt)


@dataclass(frozen=True)
class Gate:
    """The regression gate of one comparison, as ``ddp compare`` and pytest's ``--ddp-fail-slower``
    both print it: warnings first (setups that differ), then the table and what it concluded."""

    rows: list[BenchmarkComparison]
    warnings: list[str]
    lines: list[str]
    failed: list[BenchmarkComparison]


def gate(old: Run, new: Run, threshold: float) -> Gate:
    """Compare ``new`` against ``old`` and judge: fails on a significant slowdown beyond ``threshold``."""
    warnings = []
    differences = machine_differences(old, new)
    if differences:
        facts = "; ".join(f"{key}: {a} vs {b}" for key, (a, b) in differences.items())
        warnings.append(f"WARNING: the runs come from different machines or setups ({facts}): the ratios measure the "
                        "machine as much as the code")
    rows = compare(old, new, threshold)
    migrated = sorted({f"{run.path.name} (schema {s.migrated_from})" for run in (old, new) for s in run.steps
                       if s.migrated_from is not None and s.migrated_from < EXPOSED_CHANGED_IN})
    if migrated:
        warnings.append(f"NOTE: {', '.join(migrated)} saved before schema {EXPOSED_CHANGED_IN}: a step's exposed communication there was the timed "
                        "wait for gradients, now sync_wait_seconds, and is not compared with exposed_comm_seconds (the "
                        "traced steps' communication alone); step times compare as before")
    one_group = [r.name for r in rows if r.decision is not None and r.decision.groups[0] < 2
                 and r.basis != MACHINE_REFERENCE]
    if one_group:
        warnings.append(f"WARNING: {len(one_group)} benchmark(s) of the old run were measured in {ONE_GROUP} (saved "
                        "before rounds were spread over groups, with --rank-groups 1, or by ddp run under torchrun): "
                        "no slowdown is called from them; save a new baseline under pytest with --rank-groups 2 or more")
    lines = [table(rows)]
    lines += machine_notes(rows)
    for missing, which in (("only in old", "of the old run are not in the new one"), ("only in new", "of the new run are not in the old one")):
        names = [r.name for r in rows if r.verdict == missing]
        if names:
            lines.append(f"NOTE: {len(names)} benchmark(s) {which}, not compared: {', '.join(names)}")
    slower = failed(rows)
    counts = {v: sum(r.verdict == v for r in rows) for v in dict.fromkeys(r.verdict for r in rows)}
    lines += [what_would_decide(r.name, r.decision, *r.rounds) for r in rows
              if r.verdict == str(Verdict.NOT_RESOLVED) and r.decision is not None and r.basis != MACHINE_REFERENCE]
    lines.append(", ".join(f"{n} {v}" for v, n in counts.items()) + f" (threshold {threshold:.0%})")
    if slower:
        lines.append(f"FAIL: {len(slower)} benchmark(s) slower by more than {threshold:.0%}: " + ", ".join(r.name for r in slower))
    return Gate(rows, warnings, lines, slower)
