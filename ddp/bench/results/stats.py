"""Confidence intervals for timing figures, and the verdict a noise-aware regression check gives:
pure functions of lists of round times (numpy and the standard library, no torch), so the
benchmark core, the report and the command line compute an interval the same way.

* ``median_ci``: the distribution-free interval of a median from order statistics (Conover,
  *Practical Nonparametric Statistics*, 3rd ed. 1999, section 3.2): the rounds below the true
  median are Binomial(n, 1/2) whatever the distribution of round times, which are skewed and have
  outliers; it assumes only independent rounds.
* ``paired_ci``, ``ratio_of_medians_ci``: percentile bootstrap intervals (Efron and Tibshirani,
  *An Introduction to the Bootstrap*, 1993, ch. 13; for ratios of two runs, Kalibera and Jones,
  "Rigorous Benchmarking in Reasonable Time", ISMM 2013). Paired rounds (measured alternately)
  cancel a drift both share.
* ``machine_adjusted_ratio_ci``: new / old of a step measured beside its ``local`` twin in both
  runs, divided by f L + (1 - f) (f the twin's share of the old step, L the twin's ratio): the
  machine's change taken out of the compute share only, as in Amdahl's law; a bootstrap of
  (step, twin) pairs.
* ``groups``: each round's group of ranks (processes started apart). Given more than one, every
  interval is a two-level bootstrap, groups and then rounds within them (Davison and Hinkley,
  *Bootstrap Methods and their Application*, 1997, section 3.8), each group's rounds first moved
  from the mean of the groups' log medians by sqrt(G / (G - 1)); with one group, the one-level
  bootstrap. Why two levels, and why the interval is left up to sqrt(2) wider where groups agree:
  docs/regression-gate.md, "Rounds from groups of ranks".
* ``verdict``: a ratio against a relative threshold t by asv's ``--factor`` rule: ``SLOWER``
  (beyond 1 + t and its interval above 1: the only verdict a gate fails on), ``UNCHANGED``
  (within [1 - t, 1 + t]), ``FASTER``, or ``NOT_RESOLVED`` (beyond a threshold but within noise:
  measure more; ``groups_to_decide`` says about how many groups). ``clear_of_threshold`` says when
  rounds aimed at a decision may stop.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from enum import Enum

import numpy as np

# 2000 resamples: Efron and Tibshirani advise 1000 or more for the tails of a percentile interval.
# The bootstrap holds a few (resamples, rounds) arrays of 8-byte numbers, 16 kB per round each at
# 2000, so a few hundred rounds stay within tens of MB.
DEFAULT_RESAMPLES = 2000


Statistic = Callable[[np.ndarray, np.ndarray], np.ndarray]

Groups = Sequence[int] | None
"""Per round, the group of ranks it ran in (any labels; None: one group)."""


def _samples(values: Sequence[float], name: str, *, positive: bool = False) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f"{name} must be a non-empty list of numbers, got shape {array.shape}")
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{name} contains NaN or infinity: {array[~np.isfinite(array)][:3].tolist()}")
    if positive and np.any(array <= 0):
        bad = array[array <= 0][:3].tolist()
        raise ValueError(f"{name} must be positive for a ratio (times in seconds), got {bad}")
    return array


def _check_confidence(confidence: float) -> None:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be a fraction between 0 and 1 such as 0.95, got {confidence!r}")


def _median_ci_rank(n: int, confidence: float) -> tuple[int, float]:
    """The 1-based lower rank j of the interval (X_(j), X_(n+1-j)) and its exact coverage.

    P(X_(j) <= median <= X_(n+1-j)) = 1 - 2 P(B <= j - 1), B ~ Binomial(n, 1/2): the largest j
    whose coverage still reaches ``confidence`` gives the narrowest such interval. When even
    j = 1 (min, max) falls short (n <= 5 at 95%), j = 1 and the coverage it has are returned.
    """
    _check_confidence(confidence)
    if n < 1:
        raise ValueError(f"a median interval needs at least one sample, got n={n}")
    total = 2**n  # exact integers: 2**-n underflows a float beyond n = 1074 rounds
    j, term, lower_tail = 1, 1, 1  # term = comb(n, j - 1); lower_tail = sum of comb(n, i), i <= j - 1
    while 2 * (j + 1) <= n + 1:  # the interval (X_(j+1), X_(n-j)) still has low rank <= high rank
        next_term = term * (n - j + 1) // j  # comb(n, j); a fresh math.comb per step took 0.3 s at n = 3000
        if (total - 2 * (lower_tail + next_term)) / total < confidence:
            break
        j, term, lower_tail = j + 1, next_term, lower_tail + next_term
    return j, (total - 2 * lower_tail) / total


def smallest_rounds(confidence: float = 0.95) -> int:
    """The fewest samples whose (min, max) interval of the median reaches ``confidence``: 6 at 95%
    (1 - 2/2^6 = 96.9%; 5 give 93.75%). Fewer give an interval that covers less than it says: the
    suite takes at least this many rounds by default, and flags a figure from fewer."""
    n = 1
    while median_ci_coverage(n, confidence) < confidence:
        n += 1
    return n


def interval_coverage(n: int, groups: Groups = None, confidence: float = 0.95) -> float | None:
    """The exact coverage of ``median_interval`` over ``n`` rounds of one group (order statistics:
    ``median_ci_coverage``); None for rounds of several groups, whose two-level bootstrap interval
    is nominal (its coverage is not known exactly)."""
    return median_ci_coverage(n, confidence) if group_count(groups) <= 1 else None


def median_ci_coverage(n: int, confidence: float = 0.95) -> float:
    """The coverage ``median_ci`` achieves for n samples: >= ``confidence``, except below the
    smallest n that can reach it (n <= 5 at 95%), where (min, max) covers 1 - 2**(1 - n)."""
    return _median_ci_rank(n, confidence)[1]


def median_ci(samples: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """Distribution-free (low, high) interval of the median of ``samples``, in their unit.

    Too few samples to reach ``confidence`` give (min, max); ``median_ci_coverage(len(samples))``
    says what that interval covers.
    """
    ordered = np.sort(_samples(samples, "samples"))
    j, _ = _median_ci_rank(ordered.size, confidence)
    return float(ordered[j - 1]), float(ordered[ordered.size - j])


def relative_half_width(samples: Sequence[float], confidence: float = 0.95, groups: Groups = None) -> float:
    """Half the width of the median's interval over the median: 0.02 means +-2%, the precision an
    adaptive round loop compares with its target before it stops adding rounds and a record
    reports (``median_ci``, or ``median_interval`` over several ``groups`` of ranks)."""
    array = _samples(samples, "samples")
    median = float(np.median(array))
    if median <= 0:
        raise ValueError(f"a relative width needs a positive median (a time), got {median!r}")
    low, high = median_interval(array, groups, confidence)
    return (high - low) / 2 / median


def _percentile_interval(boot: np.ndarray, confidence: float) -> tuple[float, float]:
    tail = (1 - confidence) / 2
    low, high = np.quantile(boot, [tail, 1 - tail])
    return float(low), float(high)


def _check_resamples(resamples: int) -> None:
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 1:
        raise ValueError(f"resamples must be a positive whole number such as {DEFAULT_RESAMPLES}, got {resamples!r}")


def group_count(groups: Groups) -> int:
    """How many groups of ranks the rounds came from (1 when not given)."""
    return 1 if groups is None or len(groups) == 0 else len(set(groups))


def _group_slots(groups: Groups, n: int) -> np.ndarray | None:
    """Each round's group as 0 .. G - 1, or None for fewer than two groups."""
    if groups is None:
        return None
    labels = np.asarray(groups)
    if labels.shape != (n,):
        raise ValueError(f"groups must give one group per round: {labels.size} groups for {n} rounds")
    _, slots = np.unique(labels, return_inverse=True)
    return slots if slots.max() >= 1 else None


def _spread_groups(values: np.ndarray, slots: np.ndarray | None) -> np.ndarray:
    """``values`` (positive) with each group's median moved away from the mean of the groups'
    medians by sqrt(G / (G - 1)) in log time: drawing G groups from G then varies the medians as
    much as G independent groups would (module docstring)."""
    if slots is None:
        return values
    count = int(slots.max()) + 1
    logs = np.log(values)
    medians = np.array([np.median(logs[slots == k]) for k in range(count)])
    widen = math.sqrt(count / (count - 1)) - 1.0
    return np.exp(logs + widen * (medians[slots] - medians.mean()))


def _resampled_rows(slots: np.ndarray | None, n: int, rng: np.random.Generator, resamples: int) -> np.ndarray:
    """(resamples, n) indices of rounds: one level (rounds with replacement) without groups; with
    groups, two: each group's place is taken by a group drawn with replacement, and its rounds by
    rounds drawn with replacement from the drawn group (as many as the place held)."""
    if slots is None:
        return rng.integers(0, n, size=(resamples, n))
    count = int(slots.max()) + 1
    members = np.argsort(slots, kind="stable")
    sizes = np.bincount(slots, minlength=count)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    drawn = rng.integers(0, count, size=(resamples, count))[:, slots]  # (resamples, n): each round's drawn group
    within = (rng.random((resamples, n)) * sizes[drawn]).astype(np.int64)
    return members[starts[drawn] + within]


def median_interval(samples: Sequence[float], groups: Groups = None, confidence: float = 0.95,
                    resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> tuple[float, float]:
    """The (low, high) interval of the median of ``samples``: ``median_ci`` for rounds of one
    group, the two-level bootstrap (module docstring) for rounds of several."""
    array = _samples(samples, "samples", positive=groups is not None)
    slots = _group_slots(groups, array.size)
    if slots is None:
        return median_ci(array, confidence)
    _check_confidence(confidence)
    _check_resamples(resamples)
    spread = _spread_groups(array, slots)
    rows = _resampled_rows(slots, array.size, np.random.default_rng(seed), resamples)
    return _percentile_interval(np.median(spread[rows], axis=-1), confidence)


def paired_ci(
    a: Sequence[float],
    b: Sequence[float],
    statistic: Statistic,
    confidence: float = 0.95,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
    groups: Groups = None,
) -> tuple[float, float, float]:
    """(point, low, high): percentile bootstrap of a statistic of paired rounds (a_i, b_i).

    Rounds are resampled as pairs, so what a_i and b_i share cancels; at two levels where
    ``groups`` gives several groups of ranks (the module docstring; a and b, times, each spread by
    their groups). ``statistic(a, b)`` reduces over the last axis: it gets 1-D arrays for the point
    estimate and (resamples, n) arrays for the bootstrap, e.g. ``lambda a, b: np.median(a - b,
    axis=-1)``. Same seed, same interval.
    """
    _check_confidence(confidence)
    _check_resamples(resamples)
    a_array, b_array = _samples(a, "a"), _samples(b, "b")
    if a_array.size != b_array.size:
        raise ValueError(f"paired rounds need as many a as b: {a_array.size} != {b_array.size}")
    point = float(statistic(a_array, b_array))
    slots = _group_slots(groups, a_array.size)
    rows = _resampled_rows(slots, a_array.size, np.random.default_rng(seed), resamples)
    a_spread, b_spread = _spread_groups(a_array, slots), _spread_groups(b_array, slots)
    boot = np.asarray(statistic(a_spread[rows], b_spread[rows]), dtype=np.float64)
    if boot.shape != (resamples,):
        raise ValueError(
            f"statistic must reduce over the last axis: (resamples, n) -> ({resamples},), got {boot.shape}"
        )
    return (point, *_percentile_interval(boot, confidence))


def paired_difference_ci(
    a: Sequence[float], b: Sequence[float], confidence: float = 0.95, resamples: int = DEFAULT_RESAMPLES, seed: int = 0,
    groups: Groups = None,
) -> tuple[float, float, float]:
    """(point, low, high) of the median of per-round differences a_i - b_i, in the samples' unit."""
    return paired_ci(a, b, lambda x, y: np.median(x - y, axis=-1), confidence, resamples, seed, groups)


def paired_ratio_ci(
    a: Sequence[float], b: Sequence[float], confidence: float = 0.95, resamples: int = DEFAULT_RESAMPLES, seed: int = 0,
    groups: Groups = None,
) -> tuple[float, float, float]:
    """(point, low, high) of the median of per-round ratios a_i / b_i (1.1 means a is 10% slower)."""
    a_array, b_array = _samples(a, "a", positive=True), _samples(b, "b", positive=True)
    return paired_ci(a_array, b_array, lambda x, y: np.median(x / y, axis=-1), confidence, resamples, seed, groups)


def _two_runs_ci(
    new: tuple[np.ndarray, ...], old: tuple[np.ndarray, ...], statistic: Callable[..., np.ndarray],
    confidence: float, resamples: int, seed: int, new_groups: Groups = None, old_groups: Groups = None,
) -> tuple[float, float, float]:
    """(point, low, high): percentile bootstrap of ``statistic(*new, *old)`` over two unpaired runs,
    each resampled on its own, at two levels where its rounds came from several groups; the
    arrays of one run (a step and its twin) are resampled as rows together. ``statistic`` reduces
    over the last axis, as ``paired_ci``'s does. The point is the statistic of the rounds as
    measured."""
    rng = np.random.default_rng(seed)
    new_slots, old_slots = _group_slots(new_groups, new[0].size), _group_slots(old_groups, old[0].size)
    new_rows = _resampled_rows(new_slots, new[0].size, rng, resamples)
    old_rows = _resampled_rows(old_slots, old[0].size, rng, resamples)
    new_spread = tuple(_spread_groups(a, new_slots) for a in new)
    old_spread = tuple(_spread_groups(a, old_slots) for a in old)
    boot = statistic(*(a[new_rows] for a in new_spread), *(a[old_rows] for a in old_spread))
    return (float(statistic(*new, *old)), *_percentile_interval(boot, confidence))


def ratio_of_medians_ci(
    new: Sequence[float],
    old: Sequence[float],
    confidence: float = 0.95,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
    new_groups: Groups = None,
    old_groups: Groups = None,
) -> tuple[float, float, float]:
    """(point, low, high) of median(new) / median(old) for two unpaired runs (e.g. two saved runs
    from different days), each resampled on its own (at two levels where ``*_groups`` give several
    groups of ranks); the lengths may differ. Same seed, same interval."""
    _check_confidence(confidence)
    _check_resamples(resamples)
    new_array, old_array = _samples(new, "new", positive=True), _samples(old, "old", positive=True)
    return _two_runs_ci((new_array,), (old_array,), lambda n, o: np.median(n, axis=-1) / np.median(o, axis=-1),
                        confidence, resamples, seed, new_groups, old_groups)


def machine_adjusted_ratio_ci(
    new_step: Sequence[float],
    new_local: Sequence[float],
    old_step: Sequence[float],
    old_local: Sequence[float],
    confidence: float = 0.95,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
    new_groups: Groups = None,
    old_groups: Groups = None,
) -> tuple[float, float, float]:
    """(point, low, high) of (median(new_step) / median(old_step)) / (f L + 1 - f), where L is
    median(new_local) / median(old_local) and f = median(old_local) / median(old_step) within
    [0, 1]: the step's ratio with the machine's change taken out of its compute share only (module
    docstring). Each run's rounds are resampled as (step, local) pairs, at two levels where
``*_groups`` give several groups of ranks. Same seed, same interval."""
    _check_confidence(confidence)
    _check_resamples(resamples)
    new_s, new_l, old_s, old_l = (_samples(values, name, positive=True) for values, name in
                                  ((new_step, "new_step"), (new_local, "new_local"), (old_step, "old_step"),
                                   (old_local, "old_local")))
    if new_s.size != new_l.size or old_s.size != old_l.size:
        raise ValueError("each run needs as many local rounds as step rounds (they were measured in pairs)")

    def statistic(new_s, new_l, old_s, old_l):
        share = np.clip(np.median(old_l, axis=-1) / np.median(old_s, axis=-1), 0.0, 1.0)
        machine = np.median(new_l, axis=-1) / np.median(old_l, axis=-1)
        return np.median(new_s, axis=-1) / np.median(old_s, axis=-1) / (share * machine + 1.0 - share)

    return _two_runs_ci((new_s, new_l), (old_s, old_l), statistic, confidence, resamples, seed, new_groups, old_groups)


class Verdict(str, Enum):
    """What a new / old ratio says against a relative threshold t, by ``verdict``'s rule. A gate
    fails only on SLOWER; NOT_RESOLVED (beyond the threshold, within noise) asks for more rounds."""

    SLOWER = "slower"  # the ratio beyond 1 + t, and its interval above 1
    FASTER = "faster"  # the ratio below 1 - t, and its interval below 1
    UNCHANGED = "unchanged"  # the ratio within [1 - t, 1 + t]
    NOT_RESOLVED = "not resolved"  # the ratio beyond a threshold, its interval reaching across 1

    def __str__(self) -> str:  # the word, in f-strings too: a (str, Enum) prints "Verdict.SLOWER" from 3.11
        return self.value


def _check_ratio(point: float, low: float, high: float, threshold: float | None = None) -> None:
    if not all(map(math.isfinite, (point, low, high))) or low > high:
        raise ValueError(f"a ratio needs a finite point and interval with low <= high, got ({point!r}, {low!r}, {high!r})")
    if threshold is not None and not (math.isfinite(threshold) and threshold > 0):
        raise ValueError(f"threshold must be a positive fraction such as 0.10 for 10%, got {threshold!r}")


def verdict(point: float, low: float, high: float, threshold: float) -> Verdict:
    """The verdict on a ratio new / old (its point estimate and 95% interval) at a threshold t
    (0.10 for 10%), by asv's rule for ``--factor`` (asv compare: a change is reported when it is
    statistically significant and its ratio is beyond the factor): *slower* when the ratio is
    above 1 + t and its interval lies above 1, *faster* when it is below 1 - t and its interval
    lies below 1, *unchanged* when it is within [1 - t, 1 + t] (significant or not: a change
    smaller than the threshold is not what the threshold asks about), and *not resolved* when it
    is beyond a threshold but within noise (the interval reaches across 1): more rounds decide."""
    _check_ratio(point, low, high, threshold)
    if point > 1 + threshold:
        return Verdict.SLOWER if low > 1 else Verdict.NOT_RESOLVED
    if point < 1 - threshold:
        return Verdict.FASTER if high < 1 else Verdict.NOT_RESOLVED
    return Verdict.UNCHANGED


def clear_of_threshold(low: float, high: float, threshold: float) -> bool:
    """Whether the interval lies clear of both edges of the threshold: wholly above 1 + t, below
    1 - t, or within [1 - t, 1 + t]. Then more rounds would hardly carry the ratio across an edge
    and change ``verdict``; rounds aimed at a decision go on until it is (``ddp.analysis.compare``)."""
    _check_ratio(low, low, high, threshold)
    return low > 1 + threshold or high < 1 - threshold or (1 - threshold <= low and high <= 1 + threshold)


DECIDING_ODDS_Z = 0.8416
"""The normal quantile of 80%: ``groups_to_decide`` aims at an interval that excludes 1 four times in five."""


def _variance_shrink(point: float, low: float, high: float) -> float:
    """The variance of the ratio needed for |point - 1| to be (1.96 + 0.84)
    standard errors, as a fraction of its variance now (read off the interval's half-width towards 1)."""
    half = point - low if point > 1 else high - point
    return (abs(point - 1) * 1.96 / ((1.96 + DECIDING_ODDS_Z) * half)) ** 2


def groups_to_decide(point: float, low: float, high: float, groups: int) -> int | None:
    """For a ratio beyond 1 whose 95% interval reaches across 1, from runs whose rounds were spread
    over ``groups`` groups of ranks (the fewer of the two runs'): about how many groups in each
    run, both taken again with as many rounds per group, would make it significant four times in
    five if the ratio held. A run's variance is then between / G + within / (G n): G' groups of n
    rounds scale both parts by G / G' (the standard error read off the interval's half-width
    towards 1, 1.96 of them, must fall until |point - 1| is 1.96 + 0.84 of them: the usual power
    calculation of a two-sample comparison). None when the interval does not reach across 1 (it is
    significant already, or lies wholly on the other side of 1 from its point: too few rounds for
    its bootstrap to mean anything), or the ratio is 1."""
    _check_ratio(point, low, high)
    if groups < 1:
        raise ValueError(f"groups must be at least 1, got {groups}")
    if low > 1 or high < 1 or point == 1:
        return None
    return max(groups + 1, math.ceil(groups / _variance_shrink(point, low, high)))
