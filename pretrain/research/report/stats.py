"""The statistics of a sweep: mean ± sample std over seeds, paired tests against the reference arm, Holm,
and the trend of paired differences over a quantity that shapes vary.

A value that cannot be computed is None (shown as "n/a"), never NaN, and the reason goes with it.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Optional, Sequence

from pretrain.job.extras import needs_extra

with needs_extra("research"):
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
    """How paired differences move with a quantity x, seed by seed (log_trend, power_trend)."""

    seeds: int  # seeds with a fit: differences at two or more distinct x
    slope: Optional[float]  # b = mean of the seeds' b_s: log_trend's change per doubling of x, power_trend's exponent
    intercept: Optional[float]  # mean of the seeds' a_s: log_trend's difference at x = 1, power_trend's ln a
    ci_low: Optional[float]  # 95% t interval of b over the seeds (t_interval)
    ci_high: Optional[float]
    p: Optional[float]  # one-sample t-test of the seeds' b_s against 0, two-sided
    note: str  # why a value is n/a; empty when none is


def seed_fits(points: dict[int, Sequence[tuple[float, float]]]) -> Trend:
    """Fit v = a_s + b_s · u to each seed's (u, v) points by least squares, then treat the seeds' b_s as
    the sample: b = mean b_s, its 95% t interval and one-sample t-test over the seeds (k − 1 degrees
    of freedom).

    Why seed by seed: the seed sets the data order and the inits of every shape alike, so the
    differences of one seed at different x are not independent; a pooled least-squares fit over all
    points would take them as independent and understate b's error. The seeds are the independent
    samples (with the same x for every seed the mean b is the pooled fit's). A seed with points at
    fewer than two distinct u has no fit."""
    slopes, intercepts = [], []
    for seed_points in points.values():
        if len({u for u, _ in seed_points}) < 2:
            continue
        us, vs = [u for u, _ in seed_points], [v for _, v in seed_points]
        mean_u, mean_v = statistics.fmean(us), statistics.fmean(vs)
        slope = sum((u - mean_u) * (v - mean_v) for u, v in zip(us, vs)) / sum((u - mean_u) ** 2 for u in us)
        slopes.append(slope)
        intercepts.append(mean_v - slope * mean_u)
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


def log_trend(points: dict[int, Sequence[tuple[float, float]]]) -> Trend:
    """difference = a + b · log2(x), fitted seed by seed (seed_fits): b is the change per doubling of x.

    Why this fit first: the difference between two arms may change sign along x or sit at 0, where a
    power law a·x^b (one sign throughout) has no fit; a line in log2 x is defined for any sign, is
    closed-form (no convergence to fail) and its slope reads as the change per doubling of x."""
    return seed_fits({seed: [(math.log2(x), d) for x, d in seed_points] for seed, seed_points in points.items()})


def power_trend(points: dict[int, Sequence[tuple[float, float]]]) -> Trend:
    """difference = a · x^b, fitted seed by seed as ln d = ln a + b · ln x (seed_fits): b is the
    exponent, as scaling laws state it, and the Trend's intercept is ln a. Defined only where every
    difference is positive: one at or below 0 makes the power law undefined (the Trend says where),
    rather than dropped, which would bias the exponent towards the seeds that happened to stay above 0."""
    for seed, seed_points in sorted(points.items()):
        for x, d in seed_points:
            if d <= 0:
                return Trend(0, None, None, None, None, None,
                             f"seed {seed} has a difference ≤ 0 at x = {x:g}: no power law (one sign) fits")
    return seed_fits({seed: [(math.log(x), math.log(d)) for x, d in seed_points]
                      for seed, seed_points in points.items()})


def fitted_value(fit: str, trend: Trend, x: float) -> float:
    """The fitted difference at x of a trend from FITS[fit]: a + b · log2 x, or a · x^b (intercept ln a)."""
    if fit == "log2":
        return trend.intercept + trend.slope * math.log2(x)
    return math.exp(trend.intercept) * x**trend.slope


FITS = {"log2": log_trend, "power": power_trend}  # the trends of paired differences over x, by name
