"""What a benchmark run's time goes to (``ddp.bench.rounds.ledger``), counted where the work runs:
each configuration's builds (and those from a kept copy), warm-up steps, memory counts, rounds
and traced steps over every group of ranks, against what the grid asked for."""

from __future__ import annotations

import pytest

from ddp.bench.config.options import RoundOptions
from ddp.bench.config.step_config import StepConfig
from ddp.bench.rounds.grid_measurer import IN_GROUP, GridMeasurer
from ddp.bench.rounds.ledger import BUILDS, PARTS, ROUNDS, Ledger, SavedRun, estimated_length, minutes_text, take, time_left
from ddp.bench.rounds.rank_state import prepare, release
from ddp.launcher import RankGroup
from ddp.strategies.registry import steps_to_settle


def test_a_ledger_adds_by_configuration_and_part_and_is_emptied_when_taken():
    ledger = Ledger()
    ledger.add(BUILDS, 1.5, "a")
    ledger.add(BUILDS, 0.5, "b")
    ledger.add(ROUNDS, 2.0, "a", count=4)
    assert ledger.by_part()[BUILDS] == 2.0 and set(ledger.by_part()) == set(PARTS)
    assert ledger.record_counts("a")["builds"] == 1 and ledger.count("a", ROUNDS) == 4
    taken = take(ledger)
    assert not ledger.seconds and taken.by_part()[ROUNDS] == 2.0
    with pytest.raises(ValueError, match="unknown part"):
        ledger.add("lunch", 1.0)
    assert minutes_text(61.4) == "1 min 1 s" and minutes_text(9.6) == "10 s"


@pytest.fixture
def second_group(rank_group):
    group = RankGroup(rank_group.world_size, rank_group.backend, rank_group.device, label="the second timing group")
    yield group
    group.close()


@pytest.mark.slow
def test_each_record_counts_what_its_configuration_cost_over_both_groups(rank_group, second_group):
    """Two timing groups, the default layout on CPU (each strategy with its local twin, traced
    where it was timed): every configuration built once a group (the second strategy of the
    workload from a kept copy), warmed up as its strategy needs, counted once, traced once; what
    other callers did on the same ranks before (a build of the same configuration) is not its."""
    base = dict(model="tiny", batch_size=2, seq_len=16, bucket_size_mb=1.0)
    configs = [StepConfig.of(name, base) for name in ("bucketed", "torch")]
    rank_group.run(prepare, [configs[0]], 1)  # as tests/test_release.py does before this test, in reverse order
    rank_group.run(release)
    policy = RoundOptions.fixed(4, 1, traced_steps=2)
    measurer = GridMeasurer(rank_group, configs, policy, "local", tracer=IN_GROUP, more_groups=[second_group])
    for config in configs:
        measurer.measurement(config)
    local = configs[0].local_twin()
    for config in configs:
        counts = measurer.record_counts(config)
        assert counts["builds"] == 2, counts  # one per group: no tracer's build on CPU
        assert counts["memory_counts"] == 1 and counts["traced_steps"] == policy.traced_steps, counts
        # each group settles the plan, then more steps only while the step changes (tests/test_warmup.py)
        assert counts["warmup_rounds"] >= 2 * max(steps_to_settle(config.strategy), policy.warmup_rounds), counts
        assert set(counts["seconds_by_part"]) == {"builds", "warm-up", "memory counts", "rounds", "traced steps"}, counts
    assert measurer.record_counts(configs[0])["restored_builds"] == 0
    assert measurer.record_counts(configs[1])["restored_builds"] == 2, "torch's model was not taken from bucketed's"
    # local: built once a group and kept; traced once (in the last group's warm-up); warmed up again before
    # its second measurement
    assert measurer.record_counts(local)["builds"] == 2 and measurer.record_counts(local)["traced_steps"] == 2
    rounds = sum(measurer.ledger.count(c, ROUNDS) for c in configs)
    assert rounds == 2 * policy.min_rounds


def saved(label: str, seconds: dict, run_seconds: float | None = None, rounds: dict | None = None) -> SavedRun:
    return SavedRun(label, seconds, run_seconds, rounds)


ROUNDS_ASKED = {"min_rounds": 24, "max_rounds": 2000, "warmup_rounds": 0, "target_precision": 0.02, "budget_seconds": 9.0,
                "traced_steps": 3}


def test_the_length_is_the_last_saved_run_of_the_same_benchmarks_with_the_same_rounds():
    older = saved("0001_a.json", {"a": 10.0, "b": 20.0}, 40.0, ROUNDS_ASKED)
    other_rounds = saved("0003_c.json", {"a": 1.0, "b": 2.0}, 4.0, {**ROUNDS_ASKED, "min_rounds": 3})
    partial = saved("0002_b.json", {"a": 12.0, "b": None}, 50.0, ROUNDS_ASKED)  # b not counted there
    estimate = estimated_length(["a", "b"], [other_rounds, partial, older], ROUNDS_ASKED, 2, 13)
    # a and b as the newest complete run took them, and its 10 s besides its benchmarks
    assert estimate.seconds == pytest.approx(40.0)
    assert estimate.line.startswith("estimated length: 40 s, what these 2 benchmarks took") and "0001_a.json" in estimate.line
    subset = estimated_length(["a"], [older], ROUNDS_ASKED, 1, 13)
    assert subset.seconds == pytest.approx(10.0 + 10.0)


def test_without_a_saved_run_the_length_is_the_ceiling_the_options_set():
    estimate = estimated_length(["a", "b", "c"], [], ROUNDS_ASKED, 2, 13)
    assert estimate.seconds is None
    assert "at most 18 s (9 s each, more only where 24 rounds of a step take longer)" in estimate.line
    assert "about 13 untimed steps" in estimate.line


def test_time_left_is_the_rate_of_the_benchmarks_done():
    assert time_left(0, 10, 5.0) is None
    assert time_left(4, 10, 60.0) == pytest.approx(90.0)
