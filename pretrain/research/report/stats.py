"""The statistics of a sweep: mean ± sample std over seeds, paired tests against the reference arm, Holm.

A value that cannot be computed is None (shown as "n/a"), never NaN, and the reason goes with it.
"""

from __future__ import annotations

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
    return PairedComparison(len(seeds), mean_difference, t_p, w_p, dz, "; ".join(notes))


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
