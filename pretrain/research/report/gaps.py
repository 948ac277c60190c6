"""The gap of each shape's arm against its twin (a spec's `gaps`: `<shape>_<arm>` − `<shape>_<reference>`
final validation loss, paired by seed), per shape and as a trend over the quantity x the shapes vary.

x is read from each run, not from the spec, so one spec reads alike at every scale: the run's
config (config.yaml) for head_dim, seq_length and num_layers, its summary.json for parameters. A
shape's x is its reference twin's (for parameters: the twin with trainable Q/K and their biases),
or its arm's when the twin has no run in the statistics.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional, Sequence

from pretrain.config.run_config import read_run_config
from pretrain.research.report.latex import MARK_KEY
from pretrain.research.report.runs import Evaluation, RunMeasures, SweepRun
from pretrain.research.report.stats import FITS, Trend, add_holm, compare_paired, fitted_value
from pretrain.research.report.tables import Column, Table, count, fixed, interval, plain, significant
from pretrain.research.sweep.spec import GAP_QUANTITIES, GapPair, GapsSpec


def run_x(run: SweepRun, quantity: str) -> Optional[float]:
    """The run's value of `quantity` (one of GAP_QUANTITIES), for a run in the statistics."""
    if quantity == "parameters":
        summary = run.run_dir.read_summary()
        return summary.trainable_params + summary.frozen_params
    if not run.run_dir.config.exists():
        return None
    model = read_run_config(run.run_dir).model
    return {"head_dim": model.head_dim, "seq_length": model.seq_length, "num_layers": model.num_layers}[quantity]


def shape_x(pair: GapPair, x_of: dict[tuple[str, int], Optional[float]]) -> tuple[Optional[float], str]:
    """The shape's x (its reference twin's runs', else its arm's) and a note when those runs disagree."""
    for arm in (pair.reference, pair.arm):
        values = Counter(x for (name, _), x in x_of.items() if name == arm and x is not None)
        if values:
            note = "" if len(values) == 1 else f"x differs between the seeds of {arm}: {sorted(values)}"
            return values.most_common(1)[0][0], note
    return None, "no run of the shape in the statistics: x unknown"


def absence(not_used: dict[tuple[str, int], dict], arm: str, seed: int) -> str:
    """Why the arm's run of this seed is not in the statistics, in a few words."""
    entry = not_used[(arm, seed)]
    if entry["status"] == "failed":
        return f"{arm} failed (exit {entry['exit_code']})"
    if entry["status"] == "finished":
        return f"{arm} {entry['reason'].split(' (')[0]}"
    return f"{arm} {entry['status']}"


def loss_values(measures: Sequence[RunMeasures]) -> dict[str, dict[int, float]]:
    """Arm → seed → final validation loss."""
    values: dict[str, dict[int, float]] = {}
    for m in measures:
        values.setdefault(m.arm, {})[m.seed] = m.final_valid_loss
    return values


def metric_values(metric: tuple[str, str], evaluations: dict[tuple[str, int], dict[str, Evaluation]]
                  ) -> dict[str, dict[int, float]]:
    """Arm → seed → the summary metric (evaluation, metric) of each run that has it."""
    name, key = metric
    values: dict[str, dict[int, float]] = {}
    for (arm, seed), found in evaluations.items():
        evaluation = found.get(name)
        if evaluation is not None and evaluation.summary.get(key) is not None:
            values.setdefault(arm, {})[seed] = evaluation.summary[key]
    return values


def run_xs(gaps: GapsSpec, pairs: Sequence[GapPair], used: Sequence[SweepRun]
           ) -> dict[tuple[str, int], Optional[float]]:
    """(arm, seed) → x of every run of the pairs' arms in the statistics (read from the run once)."""
    names = {name for pair in pairs for name in (pair.arm, pair.reference)}
    return {(run.arm, run.seed): run_x(run, gaps.x) for run in used if run.arm in names}


def gap_rows(pairs: Sequence[GapPair], x_of: dict[tuple[str, int], Optional[float]], used: Sequence[SweepRun],
             not_used: Sequence[dict], values: dict[str, dict[int, float]],
             higher_is_better: Optional[bool] = False) -> list[dict]:
    """One row per shape, by x (`x_of`: run_xs): the paired comparison of its arm against its twin on
    `values` (arm → seed → value: the final validation loss, or an evaluation's metric) (mean gap, 95%
    t interval, t-test, Wilcoxon, d_z), Holm across the shapes per test, the seeds where the arm is
    worse, and every seed of the sweep that is not a pair, with why. Each row keeps its per-seed gaps
    under "seed_gaps" (seed → gap) for the plot."""
    missing = {(entry["arm"], entry["seed"]): entry for entry in not_used}
    seeds = sorted({run.seed for run in used} | {entry["seed"] for entry in not_used})
    sign = -1 if higher_is_better else 1
    rows = []
    for pair in pairs:
        arm, reference = values.get(pair.arm, {}), values.get(pair.reference, {})
        comparison = compare_paired(arm, reference)
        paired = sorted(arm.keys() & reference.keys())
        seed_gaps = {seed: arm[seed] - reference[seed] for seed in paired}
        worse = [seed for seed in paired if sign * seed_gaps[seed] > 0]
        unpaired = [f"{seed}: " + ("; ".join(absence(missing, name, seed) for name in (pair.arm, pair.reference)
                                             if (name, seed) in missing) or "no value")
                    for seed in seeds if seed not in seed_gaps]
        x, x_note = shape_x(pair, x_of)
        rows.append({"shape": pair.shape, "arm": pair.arm, "reference": pair.reference, "x": x,
                     "pairs": comparison.pairs, "mean_difference": comparison.mean_difference,
                     "ci_low": comparison.ci_low, "ci_high": comparison.ci_high,
                     "t_test_p": comparison.t_test_p, "wilcoxon_p": comparison.wilcoxon_p,
                     "cohens_dz": comparison.cohens_dz, "worse": len(worse),
                     "worse_seeds": ", ".join(map(str, worse)), "unpaired": "; ".join(unpaired),
                     "note": "; ".join(note for note in (comparison.note, x_note) if note),
                     "seed_gaps": seed_gaps})
    add_holm(rows)
    rows.sort(key=lambda row: (row["x"] is None, row["x"] or 0))  # stable: shapes of one x in the spec's order
    return rows


FORMULAS = {"log2": "a + b · log2 x", "power": "a · x^b"}  # stats.FITS by name, as the table writes them


def trends_of(rows: Sequence[dict]) -> dict[str, Trend]:
    """Every fit of stats.FITS over the shapes with an x: each seed's gaps against the shapes' x."""
    points: dict[int, list[tuple[float, float]]] = {}
    for row in rows:
        if row["x"] is not None:
            for seed, gap in row["seed_gaps"].items():
                points.setdefault(seed, []).append((row["x"], gap))
    return {name: fit(points) for name, fit in FITS.items()}


def verdict(trend: Trend, gaps: GapsSpec, fit: str = "log2") -> str:
    """What one fit of the trend says in words, plainly when the seeds cannot tell one."""
    what = f"the gap ({gaps.arm} − {gaps.reference})"
    p = significant(3)
    b = f"slope {{:+.4g}} per doubling of {gaps.x}" if fit == "log2" else "exponent {:+.4g}"
    name = "slope" if fit == "log2" else "exponent"
    lead = "" if fit == "log2" else f"As a power law, gap = a · {gaps.x}^b: "
    if trend.slope is None:
        return f"{lead}no estimate: {trend.note}." if lead else f"No trend estimate: {trend.note}."
    if trend.ci_low is None:
        return (f"{lead}{b.format(trend.slope)} from {trend.seeds} seed(s), without an interval ({trend.note}): "
                f"no claim about a trend.")
    numbers = (f"{b.format(trend.slope)}, 95% CI [{trend.ci_low:+.4g}, {trend.ci_high:+.4g}], p = {p(trend.p)}, "
               f"{trend.seeds} seeds")
    if trend.ci_low <= 0 <= trend.ci_high:
        text = f"the {name}'s 95% interval includes 0: {trend.seeds} seeds cannot tell whether {what} moves with " \
               f"{gaps.x} ({numbers})."
    else:
        text = f"{what} {'rises' if trend.slope > 0 else 'falls'} with {gaps.x} ({numbers})."
    return lead + text if lead else text[0].upper() + text[1:]


def trend_rows(trends: dict[str, Trend], gaps: GapsSpec) -> list[dict]:
    """One row per fit; a is the fit at x = 1: the line's mean intercept, the power law's e^(mean ln a_s)."""
    return [{"fit": FORMULAS[fit], "x": gaps.x, "seeds": trend.seeds, "slope": trend.slope, "ci_low": trend.ci_low,
             "ci_high": trend.ci_high, "p": trend.p,
             "intercept": None if trend.slope is None else fitted_value(fit, trend, 1.0),
             "note": trend.note, "verdict": verdict(trend, gaps, fit)} for fit, trend in trends.items()]


def seed_rows(rows: Sequence[dict], measures: Sequence[RunMeasures]) -> list[dict]:
    """The numbers behind the plot's dots: one row per shape and paired seed."""
    loss = {(m.arm, m.seed): m.final_valid_loss for m in measures}
    return [{"shape": row["shape"], "x": row["x"], "seed": seed, "arm_loss": loss[(row["arm"], seed)],
             "reference_loss": loss[(row["reference"], seed)], "gap": gap}
            for row in rows for seed, gap in row["seed_gaps"].items()]


# ---------------------------------------------------------------------------- tables


def metric_table_name(metric: str) -> str:
    """The table (and its CSV and LaTeX files) of a metric's gaps: gaps_<evaluation>_<metric>."""
    return "gaps_" + metric.replace(".", "_")


def gaps_table(rows: list[dict], gaps: GapsSpec, name: str = "gaps") -> Table:
    p = significant(4)
    return Table(name, [
        Column("shape", ("shape",), plain), Column(gaps.x, ("x",), count),
        Column("pairs", ("pairs",), plain),
        Column(f"mean gap ({gaps.arm} − {gaps.reference})", ("mean_difference",), fixed(4), mark=MARK_KEY),
        Column("95% CI", ("ci_low", "ci_high"), interval(fixed(4))),
        Column("t-test p", ("t_test_p",), p, latex=False), Column("t-test p (Holm)", ("t_test_p_holm",), p),
        Column("Wilcoxon p", ("wilcoxon_p",), p, latex=False),
        Column("Wilcoxon p (Holm)", ("wilcoxon_p_holm",), p),
        Column("Cohen's d_z", ("cohens_dz",), fixed(3), latex=False),
        Column(f"{gaps.arm} worse", ("worse", "pairs"), lambda worse, pairs: f"{worse} of {pairs}"),
        Column("seeds worse", ("worse_seeds",), plain, latex=False),
        Column("not paired", ("unpaired",), plain, latex=False),
        Column("note", ("note",), plain, latex=False)], rows)


def trend_table(rows: list[dict]) -> Table:
    return Table("gap_trend", [
        Column("fit", ("fit",), plain), Column("x", ("x",), plain), Column("seeds", ("seeds",), plain),
        Column("b", ("slope",), significant(4)),
        Column("95% CI", ("ci_low", "ci_high"), interval(significant(4))),
        Column("t-test p", ("p",), significant(4)),
        Column("a", ("intercept",), significant(4), latex=False),
        Column("note", ("note",), plain, latex=False),
        Column("verdict", ("verdict",), plain, latex=False, markdown=False)], rows)  # the section's text


def seeds_table(rows: list[dict]) -> Table:
    """The plot's dots (CSV and JSON only)."""
    return Table("gap_seeds", [
        Column("shape", ("shape",), plain), Column("x", ("x",), count), Column("seed", ("seed",), plain),
        Column("arm loss", ("arm_loss",), fixed(4)), Column("reference loss", ("reference_loss",), fixed(4)),
        Column("gap", ("gap",), fixed(4))], rows)


# ---------------------------------------------------------------------------- text


def captions(gaps: GapsSpec, escape, directions: dict[str, Optional[bool]]) -> dict[str, str]:
    """LaTeX captions of gaps.tex, gap_trend.tex and each metric's table (`escape`: latex.escape;
    `directions`: metric → higher is better)."""
    arm, reference, x = (rf"\texttt{{{escape(text)}}}" for text in ("<shape>_" + gaps.arm,
                                                                     "<shape>_" + gaps.reference, gaps.x))
    metrics = {metric_table_name(metric): (
        f"Gap per shape: {escape(metric)} of {arm} $-$ {reference}, paired by seed ({direction_text(higher)}); "
        f"mean and 95\\% $t$ interval over the pairs, paired $t$-test and Wilcoxon p-values Holm-corrected "
        f"across the shapes; {escape(gaps.arm)} worse: seeds where its value is worse. Marks: paired $t$-test, "
        f"Holm-corrected across shapes.") for metric, higher in directions.items()}
    return {**metrics,
        "gaps": (f"Gap per shape: final validation loss of {arm} $-$ {reference}, paired by seed; mean and 95\\% "
                 f"$t$ interval over the pairs, paired $t$-test and Wilcoxon p-values Holm-corrected across the "
                 f"shapes; {escape(gaps.arm)} worse: seeds whose gap is positive. Marks: paired $t$-test, "
                 f"Holm-corrected across shapes."),
        "gap_trend": (f"Trend of the gap over {x}: gap $= a + b \\log_2 x$ ($b$ per doubling of {x}) and gap "
                      f"$= a\\,x^b$ ($b$ the exponent; only where every gap is positive), each fitted to each "
                      f"seed's gaps by least squares (the power law on $\\ln$ gap); $b$: mean over seeds, 95\\% "
                      f"$t$ interval and one-sample $t$-test over the seeds' $b$."),
    }


def direction_text(higher: Optional[bool]) -> str:
    return {True: "higher is better", False: "lower is better", None: "no run in the statistics has it"}[higher]


def metric_sections(gaps: GapsSpec, tables: dict[str, Table], directions: dict[str, Optional[bool]]) -> str:
    arm, reference = f"`<shape>_{gaps.arm}`", f"`<shape>_{gaps.reference}`"
    return "".join(f"""\
### {metric}: {arm} − {reference}

Gap: `{metric}` of {arm} − {reference}, paired by seed ({direction_text(higher)}; "{gaps.arm} worse": \
seeds where its value is worse). Holm across the shapes.

{tables[metric_table_name(metric)].markdown()}

""" for metric, higher in directions.items())


def section(gaps: GapsSpec, tables: dict[str, Table], trends: list[dict], plot: str,
            directions: dict[str, Optional[bool]]) -> str:
    x_text = GAP_QUANTITIES[gaps.x]
    arm, reference = f"`<shape>_{gaps.arm}`", f"`<shape>_{gaps.reference}`"
    return f"""\
## Gap by shape: {arm} − {reference} against {gaps.x}

Gap: final validation loss of {arm} − {reference}, paired by seed (positive: {gaps.arm}'s loss is \
higher). x = {gaps.x}: {x_text}. Holm across the shapes; "not paired": seeds of the sweep without a \
finished run of both arms, and why.

{tables["gaps"].markdown()}

**Trend.** {" ".join(row["verdict"] for row in trends)}

{tables["gap_trend"].markdown()}

![gap against {gaps.x}]({plot})

{metric_sections(gaps, tables, directions)}"""


def definitions(gaps: GapsSpec) -> str:
    return f"""\
- Gap by shape (the spec's `gaps: {{arm: {gaps.arm}, reference: {gaps.reference}, x: {gaps.x}}}`): every shape
  with both arms `<shape>_{gaps.arm}` and `<shape>_{gaps.reference}`; gap d_s = final validation loss of the
  first − the second for each seed s both have in the statistics. Mean gap d̄ over the n pairs; 95% t
  interval d̄ ± t_(0.975, n−1) · s_d / √n (s_d: sample std of the gaps, ddof=1; n/a below two pairs or with
  zero spread); t-test, Wilcoxon and d_z as in the paired comparison above; Holm across the shapes, per
  test. Per shape, x = {gaps.x}:
  {GAP_QUANTITIES[gaps.x]}. A shape's x is its `{gaps.reference}` twin's (its `{gaps.arm}` arm's when the
  twin has no run in the statistics), read from the runs, never from the spec.
- Trend: for each seed, least squares of its gaps on log2 x over the shapes it has (at least two distinct
  x): d = a_s + b_s · log2 x. Slope b̄ = mean of the b_s over the k seeds with one (the change of the gap
  per doubling of x), 95% t interval b̄ ± t_(0.975, k−1) · s_b / √k, p from the one-sample t-test of the
  b_s against 0. The seeds, not the points, are the samples: one seed's gaps share its data order and
  inits. The line first, because the gap may change sign or be 0 along x, where a power law (one sign)
  breaks down. Beside it the power law d = a · x^b, as scaling laws state it, fitted the same way on
  ln d = ln a_s + b_s · ln x (b̄ the exponent, a = e^(mean ln a_s)), only when every seed's gap at
  every shape is positive; otherwise the table names the first gap ≤ 0 and gives no exponent (dropping
  those seeds would bias it). An interval that includes 0 means the seeds cannot tell a trend; the
  report says so.
- `gaps.png`: per shape, the mean gap with its 95% t interval as error bars, each seed's gap as a grey
  dot (a seed's dots joined by a thin line; dots shifted sideways by seed), the trend line a + b̄ · log2 x
  with ā the mean of the a_s, the power law a · x^b̄ where it is defined, and a line at 0; x on a log2
  axis, ticks at the shapes' x. Its numbers: `gap_seeds.csv`. LaTeX: `gaps.tex`, `gap_trend.tex`.
""" + ("" if not gaps.metrics else f"""\
- Metric gaps (the spec's `gaps.metrics`: {", ".join(f"`{metric}`" for metric in gaps.metrics)}): the same paired
  gap per shape on an evaluation's summary metric (`evaluations/<evaluation>.json`) instead of the loss,
  over the seeds where both runs have it; "worse" follows the evaluation's `higher_is_better`. No trend
  fit. Tables `gaps_<evaluation>_<metric>` (CSV, JSON, LaTeX).
""")
