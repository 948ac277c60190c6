"""The statistics of a sweep: mean ± sample std over seeds, paired tests against the reference arm, Holm,
and the trend of paired differences over a quantity that shapes vary.

A value that cannot be computed is None (shown as "n/a"), never NaN, and the reason goes with it.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Optional, Sequence

from scipy import stats


@dataclass
class Spread:
    """Mean and sample standard deviation (ddof=1) of the values present."""

    mean: Optional[float]  # None without values
    std: Optional[float]  # None below two values
    n: int


def spread(values: Sequence[Optional[float]]) -> Spread:
    present = [v for v in values if v is not None]
    mean = statistics.fmean(present) if present else None
    std = statistics.stdev(present) if len(present) >= 2 else None
    return Spread(mean, std, len(present))


@dataclass
class PairedComparison:
    """An arm against the reference on one measure, over the seeds both have (difference = arm − reference)."""

    pairs: int
    mean_difference: Optional[float]
    t_test_p: Optional[float]  # scipy.stats.ttest_rel, two-sided
    wilcoxon_p: Optional[float]  # scipy.stats.wilcoxon, two-sided, zero differences discarded
    cohens_dz: Optional[float]  # mean of the differences / their sample std
    note: str  # why a value is n/a; empty when none is
    ci_low: Optional[float] = None  # 95% t interval of the mean difference (t_interval)
    ci_high: Optional[float] = None


def t_interval(values: Sequence[float], level: float = 0.95) -> tuple[Optional[float], Optional[float]]:
    """The t confidence interval of the mean of `values`: mean ± t_{(1+level)/2, n−1} · s / √n (s the
    sample std, ddof=1). (None, None) below two values or with zero spread, where it is undefined
    (as the t-test is), not a zero-width interval."""
    if len(values) < 2 or len(set(values)) == 1:
        return None, None
    mean = statistics.fmean(values)
    half = float(stats.t.ppf((1 + level) / 2, len(values) - 1)) * statistics.stdev(values) / math.sqrt(len(values))
    return mean - half, mean + half


def compare_paired(arm: dict[int, float], reference: dict[int, float]) -> PairedComparison:
    """Pair the two arms' values by seed and test whether their difference is centred on zero."""
    seeds = sorted(arm.keys() & reference.keys())
    arm_values, reference_values = [arm[s] for s in seeds], [reference[s] for s in seeds]
    differences = [a - r for a, r in zip(arm_values, reference_values)]
    mean_difference = statistics.fmean(differences) if differences else None
    if len(seeds) < 2:
        return PairedComparison(len(seeds), mean_difference, None, None, None, "fewer than two paired seeds")
    notes, t_p, dz = [], None, None
    if len(set(differences)) == 1:
        # ttest_rel would divide by a zero standard error (scipy warns and returns NaN or 0).
        notes.append("differences all equal (zero variance): t-test and d_z undefined")
    else:
        t_p = float(stats.ttest_rel(arm_values, reference_values).pvalue)
        dz = mean_difference / statistics.stdev(differences)
    w_p = None
    if all(d == 0 for d in differences):
        notes.append("all differences zero: nothing left for Wilcoxon")
    else:
        w_p = float(stats.wilcoxon(arm_values, reference_values, zero_method="wilcox",
                                   alternative="two-sided", method="auto").pvalue)
    return PairedComparison(len(seeds), mean_difference, t_p, w_p, dz, "; ".join(notes), *t_interval(differences))


HOLM_TESTS = ("t_test_p", "wilcoxon_p")  # the p-values of a PairedComparison, each Holm-corrected on its own


def add_holm(rows: Sequence[dict]) -> None:
    """Each row's `<test>_holm` for every test of HOLM_TESTS: Holm across the rows, test by test."""
    for test in HOLM_TESTS:
        for row, adjusted in zip(rows, holm([row[test] for row in rows])):
            row[f"{test}_holm"] = adjusted


def holm(p_values: Sequence[Optional[float]]) -> list[Optional[float]]:
    """Holm's step-down adjustment. The family is the p-values present (n/a ones stay n/a and do not
    count in m): the i-th smallest (from 0) is multiplied by m − i, capped at 1, and raised to the
    largest adjusted value before it so that the adjusted p-values keep the order of the raw ones."""
    present = sorted((p, i) for i, p in enumerate(p_values) if p is not None)
    adjusted: list[Optional[float]] = [None] * len(p_values)
    running_max = 0.0
    for rank, (p, i) in enumerate(present):
        running_max = max(running_max, min(1.0, (len(present) - rank) * p))
        adjusted[i] = running_max
    return adjusted


@dataclass
class Trend:
    """How paired differences move with log2 of a quantity x, seed by seed (log_trend)."""

    seeds: int  # seeds with differences at two or more distinct x
    slope: Optional[float]  # change of the difference per doubling of x: the mean of the seeds' slopes
    intercept: Optional[float]  # the mean of the seeds' intercepts (the difference at x = 1)
    ci_low: Optional[float]  # 95% t interval of the slope over the seeds (t_interval)
    ci_high: Optional[float]
    p: Optional[float]  # one-sample t-test of the seeds' slopes against 0, two-sided
    note: str  # why a value is n/a; empty when none is


def log_trend(points: dict[int, Sequence[tuple[float, float]]]) -> Trend:
    """Fit difference = a + b · log2(x) to each seed's (x, difference) points by least squares, then
    treat the seeds' slopes b_s as the sample: slope = mean b_s, its 95% t interval and one-sample
    t-test over the seeds (k − 1 degrees of freedom).

    Why this fit: the difference between two arms may change sign along x or sit at 0, where a power
    law a·x^b (one sign throughout) has no good fit and log|difference| none at all; a line in log2 x
    is defined for any sign, is closed-form (no convergence to fail) and its slope reads as the change
    per doubling of x. A power law with a small exponent is nearly that line over a few doublings
    (d(a·x^b)/d log2 x = a·b·ln 2·x^b). Why seed by seed: the seed sets the data order and the inits
    of every shape alike, so the differences of one seed at different x are not independent; a pooled
    least-squares fit over all points would take them as independent and understate the slope's
    error. The seeds are the independent samples (with the same x for every seed the mean slope is
    the pooled fit's slope). A seed with points at fewer than two distinct x has no slope."""
    slopes, intercepts = [], []
    for seed_points in points.values():
        if len({x for x, _ in seed_points}) < 2:
            continue
        logs = [math.log2(x) for x, _ in seed_points]
        values = [d for _, d in seed_points]
        mean_log, mean_value = statistics.fmean(logs), statistics.fmean(values)
        slope = (sum((u - mean_log) * (v - mean_value) for u, v in zip(logs, values))
                 / sum((u - mean_log) ** 2 for u in logs))
        slopes.append(slope)
        intercepts.append(mean_value - slope * mean_log)
    if not slopes:
        return Trend(0, None, None, None, None, None, "no seed has differences at two or more x")
    slope, intercept = statistics.fmean(slopes), statistics.fmean(intercepts)
    if len(slopes) < 2:
        return Trend(1, slope, intercept, None, None, None, "one seed: no interval")
    if len(set(slopes)) == 1:
        return Trend(len(slopes), slope, intercept, None, None, None,
                     "every seed has the same slope (zero variance): interval and t-test undefined")
    low, high = t_interval(slopes)
    return Trend(len(slopes), slope, intercept, low, high, float(stats.ttest_1samp(slopes, 0.0).pvalue), "")
