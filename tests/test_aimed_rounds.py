"""Rounds aimed at the decision: the one timing loop (``ddp.bench.rounds.loop``) adds rounds until the
comparison with a saved run is settled (``ddp.analysis.compare.AimAtDecision``) or the budget is
spent, on synthetic rounds with a known slowdown (no ranks: a stand-in answers ``prepare`` and
``timed_round`` as the ranks would)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from ddp.analysis.compare import AimAtDecision
from ddp.bench.config.options import RoundOptions
from ddp.bench.config.step_config import StepConfig
from ddp.bench.results.records import Run, run_from_data
from ddp.bench.rounds.loop import measure
from ddp.bench.rounds.rank_state import prepare, timed_round
from ddp.bench.rounds.spread import measure_in_rank_groups
from tests.synthetic import run_json as run
from tests.synthetic import strategy_benchmark as step


@dataclass(frozen=True)
class Timing:
    step_seconds: float

    @property
    def seconds(self) -> float:
        return self.step_seconds


STEP = StepConfig("slowed", "mini", batch_size=4, seq_len=64)  # named as test_compare.step names it
LOCAL = STEP.local_twin()


class SyntheticRanks:
    """One rank whose rounds are drawn: the step and its local twin share each round's drift."""

    world_size = 1

    def __init__(self, step_seconds: float, local_seconds: float, seed: int, spread: float = 0.03) -> None:
        self.rng = np.random.default_rng(seed)
        self.step_seconds, self.local_seconds, self.spread = step_seconds, local_seconds, spread
        self.rounds = 0

    def run(self, fn, configs=(), *args):
        if fn is prepare:
            return [[None for _ in configs]]
        if fn is not timed_round:
            return [None]  # release, return_cached_memory between groups
        self.rounds += 1
        drift = float(np.exp(self.rng.normal(0.0, self.spread)))
        step, local = (float(np.exp(self.rng.normal(0.0, 0.01))) * drift for _ in range(2))
        return [[Timing(self.step_seconds * step), Timing(self.local_seconds * local)]]


def groups(step_seconds: float, local_seconds: float, seed: int, spread: float = 0.03) -> list[SyntheticRanks]:
    """Two groups of ranks, as the suite spreads a benchmark's rounds over."""
    return [SyntheticRanks(step_seconds, local_seconds, seed + 100 * index, spread) for index in range(2)]


def saved_run(step_seconds: float, local_seconds: float, rounds: int, seed: int) -> Run:
    measured = measure_in_rank_groups(groups(step_seconds, local_seconds, seed), [STEP, LOCAL], RoundOptions.fixed(rounds, 0))
    return run_from_data(Path("old.json"), run([step("slowed", measured.round_seconds(0), measured.round_seconds(1),
                                                      groups=measured.round_groups)]))


def name(config: StepConfig) -> str:
    return f"test_step[{config.test_id}]"


POLICY = RoundOptions(min_rounds=5, max_rounds=400, warmup_rounds=0, target_precision=0.0001, budget_seconds=1e9)


@pytest.mark.parametrize("slowdown, verdict", [(1.25, "slower"), (1.0, "unchanged")])
def test_rounds_stop_once_the_comparison_is_settled(slowdown, verdict):
    old = saved_run(0.03, 0.01, 40, seed=1)
    criterion = AimAtDecision(old, 0.10, name)
    measured = measure_in_rank_groups(groups(0.03 * slowdown, 0.01, seed=2), [STEP, LOCAL], POLICY, stop=criterion)
    outcome = criterion.outcomes[name(STEP)]
    # a precision target of 0.01% is never reached: what stopped the last group's rounds is the
    # settled comparison, judged with the first group's (which ran its share: half the maximum)
    assert outcome.settled and outcome.decision.verdict == verdict and outcome.decision.groups == (2, 2)
    assert len(measured.rounds) == outcome.rounds < POLICY.max_rounds
    assert measured.round_groups == [0] * (POLICY.max_rounds // 2) + [1] * (outcome.rounds - POLICY.max_rounds // 2)
    # never on a snapshot: at least MIN_SECONDS of rounds (5 s at 40 ms a round: 125 rounds)
    spent = sum(sum(measured.round_seconds(i)) for i in range(2))
    assert spent >= AimAtDecision.MIN_SECONDS and outcome.rounds >= AimAtDecision.MIN_ROUNDS


def test_rounds_go_on_to_the_budget_while_the_comparison_straddles_the_threshold():
    old = saved_run(0.03, 0.01, 40, seed=1)
    criterion = AimAtDecision(old, 0.10, name)
    ranks = groups(0.03 * 1.10, 0.01, seed=3, spread=0.01)  # exactly at the threshold: never settles
    policy = RoundOptions(min_rounds=5, max_rounds=60, warmup_rounds=0, target_precision=0.5, budget_seconds=1e9)
    measured = measure_in_rank_groups(ranks, [STEP, LOCAL], policy, stop=criterion)
    assert len(measured.rounds) == 3 + 30  # the first group's precision target (+-50%) stops it at its 3; the last aims


def test_rounds_of_one_group_never_settle_on_a_slowdown():
    old = saved_run(0.03, 0.01, 40, seed=1)
    criterion = AimAtDecision(old, 0.10, name)
    policy = RoundOptions(min_rounds=5, max_rounds=300, warmup_rounds=0, target_precision=0.5, budget_seconds=1e9)
    measured = measure(SyntheticRanks(0.03 * 1.25, 0.01, seed=2), [STEP, LOCAL], policy, stop=criterion)
    outcome = criterion.outcomes[name(STEP)]
    assert len(measured.rounds) == 300 and not outcome.settled  # to the budget: one group cannot call it
    assert outcome.decision.verdict == "not resolved" and "one group of ranks" in outcome.decision.why
    assert not criterion.outcomes[name(STEP)].settled


def test_without_a_saved_benchmark_the_precision_target_decides():
    criterion = AimAtDecision(Run(Path("old.json"), {}, {}, None, []), 0.10, name)
    policy = RoundOptions(min_rounds=5, max_rounds=60, warmup_rounds=0, target_precision=0.5, budget_seconds=1e9)
    measured = measure(SyntheticRanks(0.03, 0.01, seed=4), [STEP, LOCAL], policy, stop=criterion)
    assert len(measured.rounds) == 5 and criterion.outcomes == {}


def test_the_decision_is_checked_from_the_first_round_of_the_next_measurement():
    # Checks thin out as the rounds grow (every fifth's growth); a new measurement starts them
    # afresh even where its first aimed round comes after as many rounds as the last one ended on.
    old = saved_run(0.03, 0.01, 40, seed=1)
    criterion = AimAtDecision(old, 0.10, name)
    seconds = [[0.03] * 300, [0.01] * 300]
    criterion([STEP, LOCAL], seconds, [0] * 150 + [1] * 150)  # checked at 300 rounds: next check at 361
    other = StepConfig("slowed", "mini", batch_size=4, seq_len=64, seed=1)
    criterion([other, other.local_twin()], [[0.03] * 301, [0.01] * 301], [0] * 150 + [1] * 151)
    assert criterion._next_check == int(301 * AimAtDecision.GROWTH) + 1  # checked now, not skipped to 361
