"""The report's PNGs, drawn on matplotlib Figures (Agg canvas, no pyplot state): validation curves,
final loss, speed and memory, each per-layer evaluation metric by layer, and a spec's gaps against x.

Every arm appears on every per-arm plot's axis, finished seeds or not; an arm without one has no
mark. An arm without values has no line on a curve plot.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Optional, Sequence

from pretrain.job.extras import needs_extra
from pretrain.research.report.runs import RunMeasures
from pretrain.research.report.stats import Trend, fitted_value, spread

with needs_extra("research"):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator, NullLocator

VALID_CURVES = "valid_loss_curves.png"
FINAL_LOSS = "final_valid_loss.png"
SPEED_MEMORY = "speed_memory.png"
GAPS = "gaps.png"


def _save(figure: Figure, path: Path) -> Path:
    figure.tight_layout()
    FigureCanvasAgg(figure).print_png(path)
    return path


def _mean_with_band(axes, label: str, values_at: dict[float, list[float]], marker: Optional[str] = None) -> None:
    """A line through the mean of the values at each x, in a band from their minimum to their maximum
    (nothing without values)."""
    xs = sorted(x for x, values in values_at.items() if values)
    if not xs:
        return
    per_x = [values_at[x] for x in xs]
    line, = axes.plot(xs, [sum(v) / len(v) for v in per_x], label=label, marker=marker)
    axes.fill_between(xs, [min(v) for v in per_x], [max(v) for v in per_x],
                      color=line.get_color(), alpha=0.2, linewidth=0)


def plot_valid_curves(arms: Sequence[str], measures: Sequence[RunMeasures], path: Path) -> Path:
    """Per arm: mean validation loss over the seeds evaluated at each step, in a band from their
    minimum to their maximum."""
    figure = Figure(figsize=(8, 5))
    axes = figure.subplots()
    for arm in arms:
        losses_by_step: dict[int, list[float]] = defaultdict(list)
        for m in measures:
            if m.arm == arm:
                for step, loss in m.valid_curve:
                    losses_by_step[step].append(loss)
        _mean_with_band(axes, arm, losses_by_step)
    axes.set(xlabel="step", ylabel="validation loss", title="Validation loss: mean over seeds, band min–max")
    if axes.lines:
        axes.legend()
    return _save(figure, path)


def plot_by_layer(arms: Sequence[str], runs_by_arm: dict[str, list[list[Optional[float]]]], metric: str,
                  path: Path) -> Path:
    """Per arm: the metric's mean over the seeds at each layer (1..L), in a band from their minimum
    to their maximum; a seed's missing value (None) at a layer is left out there."""
    figure = Figure(figsize=(8, 5))
    axes = figure.subplots()
    for arm in arms:
        values_at: dict[int, list[float]] = defaultdict(list)
        for values in runs_by_arm.get(arm, []):
            for layer, value in enumerate(values, 1):
                if value is not None:
                    values_at[layer].append(value)
        _mean_with_band(axes, arm, values_at, marker="o")  # layers are discrete
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set(xlabel="layer", ylabel=metric, title=f"{metric} by layer: mean over seeds, band min–max")
    if axes.lines:
        axes.legend()
    return _save(figure, path)


def _arm_axis(axes, arms: Sequence[str]) -> None:
    """One slot per arm on x, every slot shown (an arm without a value too)."""
    axes.set_xticks(range(len(arms)), arms, rotation=30, ha="right")
    axes.set_xlim(-0.6, len(arms) - 0.4)


def _mark_na(axes, x: int) -> None:
    """An arm without a value gets "n/a" at the bottom of its slot instead of a mark."""
    axes.annotate("n/a", (x, 0.02), xycoords=("data", "axes fraction"), ha="center", color="0.4")


def plot_final_loss(arms: Sequence[str], measures: Sequence[RunMeasures], path: Path) -> Path:
    """Per arm: each seed's final validation loss, and their mean with ± sample-std error bars."""
    figure = Figure(figsize=(max(5, 1.2 * len(arms)), 4.5))
    axes = figure.subplots()
    for x, arm in enumerate(arms):
        losses = [m.final_valid_loss for m in measures if m.arm == arm]
        if not losses:
            _mark_na(axes, x)
            continue
        summary = spread(losses)
        axes.scatter([x] * len(losses), losses, color="0.6", s=12, zorder=2)
        axes.errorbar([x], [summary.mean], yerr=[summary.std or 0.0], fmt="o", color="C0", capsize=6, zorder=3)
    _arm_axis(axes, arms)
    axes.set(ylabel="final validation loss", title="Final validation loss: seeds, mean ± sample std")
    return _save(figure, path)


def plot_speed_memory(arms: Sequence[str], measures: Sequence[RunMeasures], path: Path) -> Path:
    """Per arm: median tokens/s and peak memory, each a bar at the mean over seeds with ± sample std."""
    figure = Figure(figsize=(max(8, 2.0 * len(arms)), 4.5))
    speed_axes, memory_axes = figure.subplots(1, 2)
    for axes, field, label, color in ((speed_axes, "tokens_per_s_median", "tokens/s (median over steps)", "C2"),
                                      (memory_axes, "peak_memory_gib", "peak memory (GiB, rank 0)", "C1")):
        for x, arm in enumerate(arms):
            summary = spread([getattr(m, field) for m in measures if m.arm == arm])
            if summary.mean is None:
                _mark_na(axes, x)
                continue
            axes.bar([x], [summary.mean], yerr=[summary.std or 0.0], capsize=5, color=color)
        _arm_axis(axes, arms)
        axes.set(ylabel=label, title=label)
    return _save(figure, path)


def _x_label(value: float) -> str:
    """A tick label: the value, in millions (M) from 1M, in thousands (k) from 10k (a sequence length
    such as 2048 stays exact), at most 3 significant digits then."""
    for scale, suffix, start in ((1e6, "M", 1e6), (1e3, "k", 1e4)):
        if value >= start:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:g}"


TREND_STYLES = {"log2": ("--", "C3", "trend: {:+.3g} per doubling"),  # by stats.FITS name
                "power": (":", "C2", "power law: exponent {:+.3g}")}


def plot_gaps(rows: Sequence[dict], trends: dict[str, Trend], x_name: str, difference: str, path: Path) -> Path:
    """Per shape with an x (rows of report.gaps.gap_rows): the mean gap with its 95% interval as error
    bars, each seed's gap as a grey dot (one seed's dots joined by a thin line, seeds shifted sideways
    a little so they do not hide each other), the trend line a + b · log2 x and the power law a · x^b
    where each is defined (trends: report.gaps.trends_of), and a line at 0. x is on a log2 axis with a
    tick at each shape's x, labelled with its value and the shape."""
    figure = Figure(figsize=(8, 5))
    axes = figure.subplots()
    shown = [row for row in rows if row["x"] is not None]
    seeds = sorted({seed for row in shown for seed in row["seed_gaps"]})
    # Seed i of k shifted by (i − (k−1)/2) · 0.04 doublings: visible, and far from the next shape.
    shift = {seed: 2 ** ((i - (len(seeds) - 1) / 2) * 0.04) for i, seed in enumerate(seeds)}
    for seed in seeds:
        points = [(row["x"] * shift[seed], row["seed_gaps"][seed]) for row in shown if seed in row["seed_gaps"]]
        axes.plot(*zip(*points), color="0.6", linewidth=0.6, marker="o", markersize=3.5, zorder=2)
    for row in shown:
        if row["mean_difference"] is None:
            continue
        mean, low, high = row["mean_difference"], row["ci_low"], row["ci_high"]
        error = [[mean - low], [high - mean]] if low is not None else None
        axes.errorbar([row["x"]], [mean], yerr=error, fmt="o", color="C0", capsize=6, zorder=3)
    axes.axhline(0.0, color="black", linewidth=0.8, zorder=1)
    if shown:
        low, high = min(row["x"] for row in shown), max(row["x"] for row in shown)
        xs = [low * (high / low) ** (i / 49) for i in range(50)]
        for fit, (style, color, label) in TREND_STYLES.items():
            trend = trends[fit]
            if trend.slope is None:
                continue
            interval = "" if trend.ci_low is None else f", 95% CI [{trend.ci_low:+.3g}, {trend.ci_high:+.3g}]"
            axes.plot(xs, [fitted_value(fit, trend, x) for x in xs], linestyle=style, color=color, zorder=2,
                      label=label.format(trend.slope) + interval)
        if axes.get_legend_handles_labels()[0]:
            axes.legend()
    axes.set_xscale("log", base=2)
    if shown:
        axes.set_xticks([row["x"] for row in shown], [f"{_x_label(row['x'])}\n{row['shape']}" for row in shown])
        axes.xaxis.set_minor_locator(NullLocator())
    axes.set(xlabel=f"{x_name} (log2 scale)", ylabel=f"gap: {difference} (final valid loss)",
             title=f"{difference} by {x_name}: mean ± 95% t interval, seeds (grey)")
    return _save(figure, path)
