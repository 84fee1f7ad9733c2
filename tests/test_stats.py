"""ddp/bench/results/stats.py: intervals checked against hand-computed ranks and binomial sums, and
against simulation from distributions whose median is known; the verdict truth table; parsing.

Every simulation is seeded, so a failure is a real change in behaviour, not bad luck; the
bounds are several standard errors from the expected value so a changed seed would pass too.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from ddp.bench.config.parsing import percent
from ddp.bench.results.stats import (
    Verdict,
    clear_of_threshold,
    group_count,
    groups_to_decide,
    machine_adjusted_ratio_ci,
    median_ci,
    median_ci_coverage,
    median_interval,
    paired_ci,
    paired_difference_ci,
    paired_ratio_ci,
    ratio_of_medians_ci,
    relative_half_width,
    verdict,
)


def shuffled_ranks(n: int) -> list[float]:
    """1.0 .. n in a scrambled order, so an order statistic's value is its 1-based rank."""
    return np.random.default_rng(n).permutation(np.arange(1, n + 1, dtype=float)).tolist()


# --- median_ci: ranks and coverage from binomial tables ------------------------------------------

# (n, confidence, 1-based ranks). n=20 at 95%: the classic 6th and 15th. Worked out by hand from
# P(B <= j - 1), B ~ Binomial(n, 1/2):
#   n=10: P(B <= 1) = 11/1024 -> 1 - 2*11/1024 = 0.979 >= 0.95, but P(B <= 2) = 56/1024 -> 0.891: j=2.
#   n=20: P(B <= 5) = 21700/2**20 -> 0.9586; P(B <= 6) = 60460/2**20 -> 0.8847: j=6.
#   n=20 at 99%: P(B <= 3) = 1351/2**20 -> 0.99742; P(B <= 4) = 6196/2**20 -> 0.98818: j=4.
#   n=6: P(B <= 0) = 1/64 -> 0.969 (min, max is enough); n=1: the one sample.
@pytest.mark.parametrize(
    "n, confidence, ranks",
    [
        (10, 0.95, (2, 9)),
        (10, 1 - 2 * 11 / 1024, (2, 9)),  # a coverage exactly equal to the confidence reaches it
        (20, 0.95, (6, 15)),
        (20, 0.99, (4, 17)),
        (6, 0.95, (1, 6)),
        (1, 0.95, (1, 1)),
    ],
)
def test_median_ci_ranks_match_binomial_tables(n, confidence, ranks):
    assert median_ci(shuffled_ranks(n), confidence) == (float(ranks[0]), float(ranks[1]))


@pytest.mark.parametrize(
    "n, confidence, coverage",
    [
        (10, 0.95, 1 - 2 * 11 / 1024),
        (20, 0.95, 1 - 2 * 21700 / 2**20),
        (20, 0.99, 1 - 2 * 1351 / 2**20),
        # Too few samples for 95%: (min, max) covers only 1 - 2/2**n, and the caller can see it.
        (5, 0.95, 1 - 2 / 32),
        (2, 0.95, 0.5),
    ],
)
def test_median_ci_coverage_is_the_exact_binomial_sum(n, confidence, coverage):
    assert median_ci_coverage(n, confidence) == pytest.approx(coverage, rel=1e-12)


def test_too_few_samples_give_min_and_max():
    assert median_ci([3.0, 1.0, 2.0, 5.0, 4.0]) == (1.0, 5.0)
    assert median_ci_coverage(5) < 0.95 <= median_ci_coverage(6)


def test_many_rounds_stay_exact():
    # 2**-n underflows a float past n = 1074; the ranks must still be those of the normal
    # approximation, n/2 -+ 1.96 sqrt(n)/2 = 1500 -+ 53.7 for n = 3000.
    low, high = median_ci(shuffled_ranks(3000))
    assert abs(low - (1500 - 1.96 * math.sqrt(3000) / 2)) <= 2
    assert abs(high - (1501 + 1.96 * math.sqrt(3000) / 2)) <= 2
    assert median_ci_coverage(3000) == pytest.approx(0.95, abs=0.005)


def test_median_ci_covers_the_true_median_as_often_as_it_claims():
    # Exponential(1) is skewed like round times; its median is ln 2. 2000 trials of 25 rounds:
    # coverage should be median_ci_coverage(25) = 0.957, standard error sqrt(.957 * .043 / 2000) =
    # 0.0045, so +-0.02 is over 4 standard errors either way: too narrow AND too wide fail.
    rng = np.random.default_rng(1)
    trials = rng.exponential(1.0, size=(2000, 25))
    covered = 0
    for samples in trials:
        low, high = median_ci(samples)
        covered += low <= math.log(2) <= high
    assert covered / len(trials) == pytest.approx(median_ci_coverage(25), abs=0.02)


def test_relative_half_width():
    # 1..20: median 10.5, interval (6, 15) from the table above: half width 4.5.
    assert relative_half_width(shuffled_ranks(20)) == pytest.approx(4.5 / 10.5)
    assert relative_half_width([2.0] * 30) == 0.0


# --- bootstrap intervals --------------------------------------------------------------------------


def test_ratio_of_medians_ci_contains_the_true_ratio_and_narrows_with_more_rounds():
    # Lognormal round times: median exp(mu), so new / old has a true ratio of medians of 1.2.
    rng = np.random.default_rng(2)
    widths = []
    for n in (10, 40, 160):
        new = rng.lognormal(math.log(1.2e-3), 0.2, size=n)
        old = rng.lognormal(math.log(1.0e-3), 0.2, size=n)
        point, low, high = ratio_of_medians_ci(new, old)
        assert low <= point <= high
        assert low < 1.2 < high, (n, low, high)
        widths.append(high - low)
    # Width shrinks like 1/sqrt(n): quadrupling n should about halve it.
    assert widths[1] < 0.75 * widths[0] and widths[2] < 0.75 * widths[1], widths


def test_ratio_of_medians_ci_coverage():
    # 300 trials of 40 rounds each side: nominal 0.95 (0.96 measured with these seeds), standard
    # error sqrt(.95 * .05 / 300) = 0.013. The percentile bootstrap is only approximately at its
    # level for a median at small n, so the bounds are wide: 0.90 (4 standard errors) and 0.99.
    rng = np.random.default_rng(3)
    covered = 0
    trials = 300
    for trial in range(trials):
        new = rng.lognormal(math.log(1.2), 0.3, size=40)
        old = rng.lognormal(0.0, 0.3, size=40)
        _, low, high = ratio_of_medians_ci(new, old, resamples=500, seed=trial)
        covered += low <= 1.2 <= high
    assert 0.90 <= covered / trials <= 0.99


def test_machine_adjusted_ratio_is_the_formula_and_covers_the_modelled_truth():
    # Exact: every round alike, old step 10 ms of which 6 ms compute (local), new machine's compute
    # x0.8 and 1.5 ms added: new step 4.8 + 4 + 1.5 = 10.3 ms, L = 0.8, f = 0.6, the truth
    # (10.3 / 10) / (0.6 * 0.8 + 0.4) = 1.17045...
    point, low, high = machine_adjusted_ratio_ci([10.3e-3] * 5, [4.8e-3] * 5, [10e-3] * 5, [6e-3] * 5)
    assert point == pytest.approx(1.03 / 0.88) and low == pytest.approx(point) and high == pytest.approx(point)
    # With noise, the interval covers the modelled truth about as often as it claims (nominal 0.95)
    rng = np.random.default_rng(7)

    def rounds(compute: float, rest: float, n: int) -> tuple[np.ndarray, np.ndarray]:
        local = compute * rng.lognormal(0, 0.1, n)
        return local + rest * rng.lognormal(0, 0.1, n), local

    population = [np.median(a) for pair in (rounds(4.8e-3, 5.5e-3, 400_000), rounds(6e-3, 4e-3, 400_000)) for a in pair]
    truth, = machine_adjusted_ratio_ci(*[[m] for m in population], resamples=1)[:1]  # the statistic of the population
    covered, trials = 0, 200
    for trial in range(trials):
        old_step, old_local = rounds(6e-3, 4e-3, 40)
        new_step, new_local = rounds(4.8e-3, 5.5e-3, 40)
        _, low, high = machine_adjusted_ratio_ci(new_step, new_local, old_step, old_local, resamples=500, seed=trial)
        covered += low <= truth <= high
    assert 0.88 <= covered / trials <= 0.995
    with pytest.raises(ValueError, match="as many local rounds as step rounds"):
        machine_adjusted_ratio_ci([1.0, 2.0], [1.0], [1.0], [1.0])


def drifting_rounds(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Two strategies measured alternately for n rounds on a machine whose speed drifts by +-30%
    (clock boost, a neighbour's job): ``new`` is truly 1.10x ``old`` in every round, with 1% noise."""
    rng = np.random.default_rng(seed)
    drift = 1.0 + 0.3 * np.sin(np.linspace(0, 3 * math.pi, n))
    old = 1e-3 * drift * rng.lognormal(0.0, 0.01, size=n)
    new = 1.10e-3 * drift * rng.lognormal(0.0, 0.01, size=n)
    return new, old


def test_pairing_cancels_a_shared_drift():
    new, old = drifting_rounds(40, seed=4)
    point, low, high = paired_ratio_ci(new, old)
    assert low < 1.10 < high and low <= point <= high
    _, unpaired_low, unpaired_high = ratio_of_medians_ci(new, old)
    assert unpaired_low < 1.10 < unpaired_high  # right, but blurred by the drift
    assert (high - low) < (unpaired_high - unpaired_low) / 5, ((low, high), (unpaired_low, unpaired_high))
    # Only the paired interval lies clear of a 5% threshold's edge.
    assert verdict(point, low, high, 0.05) is Verdict.SLOWER
    assert clear_of_threshold(low, high, 0.05)
    assert not clear_of_threshold(unpaired_low, unpaired_high, 0.05)


def test_paired_difference_ci():
    # An additive drift shared by both series, and a true difference of 0.05 ms per round.
    rng = np.random.default_rng(5)
    drift = np.linspace(0.0, 0.5, 30)
    old = 1.0 + drift + rng.normal(0.0, 0.005, size=30)
    new = 1.05 + drift + rng.normal(0.0, 0.005, size=30)
    point, low, high = paired_difference_ci(new, old)
    assert low < 0.05 < high and high - low < 0.02
    assert point == pytest.approx(float(np.median(new - old)))


def test_paired_ci_with_any_statistic_over_the_last_axis():
    # A constant per-round difference of 2: every resample sees exactly 2.
    a, b = np.arange(10.0) + 2, np.arange(10.0)
    assert paired_ci(a, b, lambda x, y: np.mean(x - y, axis=-1)) == (2.0, 2.0, 2.0)
    with pytest.raises(ValueError, match="statistic must reduce over the last axis"):
        paired_ci(a, b, lambda x, y: np.mean(x - y))


def test_same_seed_same_interval_other_seed_other_interval():
    new, old = drifting_rounds(25, seed=6)
    assert ratio_of_medians_ci(new, old, seed=7) == ratio_of_medians_ci(new, old, seed=7)
    assert paired_ratio_ci(new, old, seed=7) == paired_ratio_ci(new, old, seed=7)
    assert ratio_of_medians_ci(new, old, seed=7) != ratio_of_medians_ci(new, old, seed=8)
    assert paired_ratio_ci(new, old, seed=7) != paired_ratio_ci(new, old, seed=8)


# --- verdict and percent ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "point, low, high, expected",
    [
        # Just outside the threshold: slower once significant (the interval above 1), else open.
        (1.101, 1.001, 1.20, Verdict.SLOWER),
        (1.101, 0.999, 1.20, Verdict.NOT_RESOLVED),
        (1.15, 1.10, 1.20, Verdict.SLOWER),  # the case: x1.136 [1.096, 1.174] fails a 10% gate
        (1.136, 1.096, 1.174, Verdict.SLOWER),
        (1.30, 0.95, 1.70, Verdict.NOT_RESOLVED),  # beyond, but within noise
        (1.15, 1.00, 1.30, Verdict.NOT_RESOLVED),  # an interval that touches 1 is not above it
        # Just inside: unchanged, significant or not.
        (1.099, 1.05, 1.15, Verdict.UNCHANGED),
        (1.10, 1.09, 1.11, Verdict.UNCHANGED),  # on the threshold is not beyond it
        (1.099, 0.90, 1.30, Verdict.UNCHANGED),
        (1.0, 0.95, 1.05, Verdict.UNCHANGED),
        # Faster, symmetrically.
        (0.899, 0.80, 0.999, Verdict.FASTER),
        (0.899, 0.80, 1.001, Verdict.NOT_RESOLVED),
        (0.901, 0.80, 0.95, Verdict.UNCHANGED),
        (0.90, 0.85, 0.95, Verdict.UNCHANGED),  # on the threshold, significant: not beyond it
        (0.85, 0.80, 1.00, Verdict.NOT_RESOLVED),
    ],
)
def test_verdict_truth_table_at_10_percent(point, low, high, expected):
    assert verdict(point, low, high, 0.10) is expected


@pytest.mark.parametrize(
    "low, high, clear",
    [
        (1.12, 1.30, True), (0.70, 0.85, True), (0.95, 1.05, True), (0.90, 1.10, True),
        (1.05, 1.15, False), (0.85, 0.95, False), (0.80, 1.20, False), (1.10, 1.20, False),
    ],
)
def test_clear_of_threshold(low, high, clear):
    assert clear_of_threshold(low, high, 0.10) is clear


def test_groups_to_decide_by_hand():
    # x1.15 [0.95, 1.35]: the standard error is 0.20 / 1.96 and must fall to 0.15 / (1.96 + 0.84),
    # the variance to (0.15 * 1.96 / (2.8016 * 0.20))^2 = 0.27531 of what it is: 2 groups of each
    # run become 2 / 0.27531 = 7.3, so 8.
    assert groups_to_decide(1.15, 0.95, 1.35, 2) == 8
    # Faster, on the other side, alike; from 3 groups, 3 / 0.27531 = 10.9.
    assert groups_to_decide(0.85, 0.65, 1.05, 3) == 11
    # Just across 1: (0.15 * 1.96 / (2.8016 * 0.151))^2 = 0.48298, 4 / 0.48298 = 8.3. An interval
    # across 1 is at least |point - 1| wide towards it, so at least 2 / (1 + 0.84 / 1.96)^2 = 0.98 times the groups.
    assert groups_to_decide(1.15, 0.999, 1.30, 4) == 9


@pytest.mark.parametrize("point, low, high, groups, message", [
    (float("nan"), 0.9, 1.3, 2, "finite"),
    (1.1, 0.9, float("inf"), 2, "finite"),
    (1.1, 1.3, 0.9, 2, "low <= high"),
    (1.1, 0.9, 1.3, 0, "at least 1"),
])
def test_groups_to_decide_refuses_what_is_not_a_ratio(point, low, high, groups, message):
    with pytest.raises(ValueError, match=message):
        groups_to_decide(point, low, high, groups)


@pytest.mark.parametrize("point, low, high", [(1.15, 1.01, 1.30), (1.0, 0.9, 1.1), (1.2, 0.5, 0.9)])
def test_nothing_to_decide_where_the_interval_does_not_reach_across_1(point, low, high):
    assert groups_to_decide(point, low, high, 2) is None


def test_verdict_values_are_the_words_a_report_prints():
    assert [v.value for v in Verdict] == ["slower", "faster", "unchanged", "not resolved"]
    assert Verdict.SLOWER == "slower"
    assert f"{Verdict.NOT_RESOLVED}, {Verdict.FASTER!s}" == "not resolved, faster"


@pytest.mark.parametrize("point, low, high, threshold", [
    (1.15, 1.2, 1.1, 0.1), (1.0, math.nan, 1.0, 0.1), (1.05, 1.0, 1.1, 0.0), (1.05, 1.0, 1.1, -0.1),
    (math.inf, 1.0, 1.1, 0.1),
])
def test_verdict_bad_input(point, low, high, threshold):
    with pytest.raises(ValueError):
        verdict(point, low, high, threshold)


@pytest.mark.parametrize("text, fraction", [("10%", 0.10), (" 2.5 % ", 0.025), ("0.1", 0.1), ("150%", 1.5), ("1e-2", 0.01)])
def test_percent(text, fraction):
    assert percent(text) == pytest.approx(fraction)


@pytest.mark.parametrize("text", ["10", "1", "1.0", "-5%", "-0.1", "0", "0%", "abc", "", "%", "nan", "inf%", "10%%"])
def test_percent_refuses_and_says_what_to_write(text):
    with pytest.raises(ValueError, match=r"^--fail-slower takes a percentage such as 10% \(or a fraction such as 0.1\)"):
        percent(text, "--fail-slower")


# --- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: median_ci([]), "non-empty"),
        (lambda: median_ci([[1.0, 2.0]]), "non-empty list"),
        (lambda: median_ci([1.0, math.nan]), "NaN or infinity"),
        (lambda: median_ci([1.0, 2.0], confidence=95), "fraction between 0 and 1"),
        (lambda: median_ci_coverage(0), "at least one sample"),
        (lambda: relative_half_width([-1.0, -2.0]), "positive median"),
        (lambda: paired_difference_ci([1.0, 2.0], [1.0]), "as many a as b: 2 != 1"),
        (lambda: paired_ratio_ci([1.0, 2.0], [1.0, 0.0]), "b must be positive"),
        (lambda: ratio_of_medians_ci([1.0, -2.0], [1.0]), "new must be positive"),
        (lambda: ratio_of_medians_ci([1.0], [1.0], resamples=0), "resamples must be a positive whole number"),
    ],
)
def test_bad_input_says_what_is_wrong(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_two_level_interval_of_groups_that_disagree_by_hand():
    # Two groups of ranks, each steady (no spread within), 21% apart: 1.0 s and 1.21 s. Treated as
    # one group, the interval of the median is (1.0, 1.21), the order statistics. Two levels: the
    # groups' log medians (0 and ln 1.21 = 2 ln 1.1) are moved from their mean (ln 1.1) by
    # sqrt(2) - 1 of their distance, to ln 1.1 -+ sqrt(2) ln 1.1; a resample draws two groups with
    # replacement: both the first (1/4), both the second (1/4), or one of each (1/2, median
    # between). The 2.5% and 97.5% points are the two extremes: (1.1^(1 - sqrt 2), 1.1^(1 + sqrt 2)).
    rounds, groups = [1.0] * 20 + [1.21] * 20, [0] * 20 + [1] * 20
    assert median_ci(rounds) == (1.0, 1.21)
    low, high = median_interval(rounds, groups)
    assert low == pytest.approx(1.1 ** (1 - math.sqrt(2))) and high == pytest.approx(1.1 ** (1 + math.sqrt(2)))
    assert low < 1.0 and high > 1.21  # wider than the same rounds as one group
    assert median_interval(rounds, [0] * 40) == median_ci(rounds)  # one group: the one-level interval


def test_groups_that_agree_keep_about_the_one_level_interval():
    generator = np.random.default_rng(7)
    rounds = list(np.exp(generator.normal(0.0, 0.05, 400)))
    one_low, one_high = median_ci(rounds)
    low, high = median_interval(rounds, [0] * 200 + [1] * 200)
    assert 0.7 < (high - low) / (one_high - one_low) < 1.6
    # the ratio of two such runs: within a few % of 1 either way
    other = list(np.exp(generator.normal(0.0, 0.05, 400)))
    point, low, high = ratio_of_medians_ci(other, rounds, new_groups=[0] * 200 + [1] * 200, old_groups=[0] * 200 + [1] * 200)
    assert low < 1 < high and high - low < 0.06


def test_group_count():
    assert group_count(None) == 1 and group_count([0, 0, 0]) == 1 and group_count([0, 0, 1, 1, 2]) == 3
