"""Builds REPORT_DIR: report.md, one CSV per table, report.json (settings + every table), the main
tables as LaTeX (.tex), three PNGs and one per per-layer evaluation metric; with a spec that has
`gaps`, also the gap of each shape against x (gaps.py) as tables, LaTeX and gaps.png."""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Optional, Sequence

from pretrain.research.report import gaps as shape_gaps
from pretrain.research.report import plots
from pretrain.research.report.latex import MARK_KEY, escape, write_latex
from pretrain.research.report.runs import (
    Evaluation,
    ReportError,
    RunMeasures,
    SweepRun,
    discover_runs,
    exclusion_reason,
    measure_run,
    read_evaluations,
)
from pretrain.research.report.sources import sources_markdown, sources_table
from pretrain.research.report.stats import HOLM_TESTS, PairedComparison, add_holm, compare_paired, spread
from pretrain.research.report.sweep_tables import (
    arms_table,
    comparison_table,
    convergence_table,
    cost_table,
    evaluations_table,
    layers_table,
    not_used_table,
    runs_table,
)
from pretrain.research.report.tables import NA, Table
from pretrain.research.sweep.spec import SweepError, SweepSpec, load_spec, metric_key

# Measures averaged over an arm's seeds (mean and sample std of the per-seed values).
AVERAGED = ("final_valid_loss", "final_valid_ppl", "steps_to_target", "seconds_to_target", "aucc",
            "last_k_variance", "grad_norm_median", "grad_norm_max", "clipped_fraction", "skipped_steps",
            "tokens_per_s_median", "peak_memory_gib", "train_seconds", "trainable_params", "frozen_params")


@dataclass
class Settings:
    inputs: list[str]
    reference: str
    target_loss: Optional[float]
    target_source: str  # how the target was chosen
    last_k: int
    revisions: dict[str, int]  # git revision → runs in the statistics trained at it
    spec: Optional[str] = None  # the sweep spec given with --spec
    gaps: Optional[dict] = None  # its `gaps`


@dataclass
class Sweep:
    """The discovered runs, split into those the statistics use and those they cannot."""

    arms: list[str]  # the reference first, then the others by name
    found: int  # runs with an experiment record
    used: list[SweepRun]
    not_used: list[dict]  # arm, seed, status, exit_code, log_line, reason, run_dir


def first_line(text: str) -> str:
    return next((line.strip() for line in (text or "").splitlines() if line.strip()), "")


def sort_sweep(runs: Sequence[SweepRun], reference: str, spec_arms: Sequence[str] = ()) -> Sweep:
    """`spec_arms`: the spec's arms, listed (every seed missing) when they have no run at all."""
    arms = sorted({r.arm for r in runs} | set(spec_arms))
    if reference not in arms:
        raise ReportError(f"reference arm {reference!r} has no run; arms found: {', '.join(arms)}")
    arms = [reference] + [a for a in arms if a != reference]
    used, not_used = [], []
    for run in sorted(runs, key=lambda r: (arms.index(r.arm), r.seed)):
        reason = exclusion_reason(run)
        if reason is None:
            used.append(run)
        else:
            e = run.experiment
            not_used.append({"arm": run.arm, "seed": run.seed, "status": e.status, "exit_code": e.exit_code,
                             "log_line": first_line(e.log_tail), "reason": reason, "run_dir": str(run.run_dir.path)})
    return Sweep(arms, len(runs), used, not_used + missing_runs(runs, arms))


def revisions_of(runs: Sequence[SweepRun]) -> dict[str, int]:
    """How many of the runs each git revision trained, most runs first (from their experiment records)."""
    return dict(Counter(run.experiment.git_revision for run in runs).most_common())


def revisions_text(revisions: dict[str, int]) -> str:
    listed = ", ".join(f"`{revision[:12]}` × {n}" for revision, n in revisions.items())
    if len(revisions) > 1:
        return (f"Code: the runs span {len(revisions)} git revisions ({listed}); they compare as far as "
                "those revisions train alike.")
    return f"Code: every run at git revision {listed}." if revisions else "Code: no run in the statistics."


def missing_runs(runs: Sequence[SweepRun], arms: Sequence[str]) -> list[dict]:
    """With no sweep spec at hand, a run is missing when another arm has its seed and this arm has no record."""
    seeds = sorted({r.seed for r in runs})
    present = {(r.arm, r.seed) for r in runs}
    return [{"arm": arm, "seed": seed, "status": "missing", "exit_code": None, "log_line": "",
             "reason": "no experiment record (another arm has this seed)", "run_dir": None}
            for arm in arms for seed in seeds if (arm, seed) not in present]


def choose_target(given: Optional[float], reference: str,
                  reference_final: dict[int, float]) -> tuple[Optional[float], str]:
    """The target loss and how it was chosen: given, or the reference arm's worst final validation loss
    over its used seeds (each reference seed reaches it by its last eval at the latest)."""
    if given is not None:
        return given, "given with --target-loss"
    if not reference_final:
        return None, f"none: {reference} has no finished seed and --target-loss was not given"
    worst = max(reference_final.values())
    return worst, f"default: the worst final validation loss of {reference} over its {len(reference_final)} seeds"


# ---------------------------------------------------------------------------- rows


def arm_row(arm: str, measures: Sequence[RunMeasures]) -> dict:
    row = {"arm": arm, "seeds": len(measures), "seed_list": ", ".join(str(m.seed) for m in measures),
           "reached_target": sum(bool(m.target_reached) for m in measures)}
    for field in AVERAGED:
        summary = spread([getattr(m, field) for m in measures])
        row[f"{field}_mean"], row[f"{field}_std"] = summary.mean, summary.std
    return row


def paired_rows(arms: Sequence[str], values: dict[str, dict[int, float]]) -> list[dict]:
    """Each non-reference arm against arms[0] on one measure (arm → seed → value), Holm across the
    arms per test."""
    rows = [{"arm": arm, **asdict(compare_paired(values[arm], values[arms[0]]))} for arm in arms[1:]]
    add_holm(rows)
    return rows


def comparison_rows(arms: Sequence[str], measures: Sequence[RunMeasures]) -> list[dict]:
    """Each non-reference arm against arms[0] on the final validation loss."""
    return paired_rows(arms, {arm: {m.seed: m.final_valid_loss for m in measures if m.arm == arm} for arm in arms})


def reference_comparison() -> dict:
    """The comparison columns of the reference arm's own row: n/a."""
    keys = [f.name for f in fields(PairedComparison)] + [f"{test}_holm" for test in HOLM_TESTS]
    return {**dict.fromkeys(keys), "note": "reference"}


# ---------------------------------------------------------------------------- evaluations

RunKey = tuple[str, int]  # (arm, seed)


def evaluation_metrics(runs: Sequence[SweepRun], evaluations: dict[RunKey, dict[str, Evaluation]]) -> dict:
    """(evaluation, summary metric) → higher_is_better, by evaluation name, metrics in the order the
    runs list them; a metric whose direction differs between runs is a ReportError."""
    metrics: dict[tuple[str, str], bool] = {}
    for run in runs:
        for name, evaluation in evaluations[(run.arm, run.seed)].items():
            for metric, higher in evaluation.higher_is_better.items():
                if metrics.setdefault((name, metric), higher) != higher:
                    raise ReportError(f"{run.run_dir.evaluation_file(name)}: higher_is_better.{metric} is {higher}, "
                                      f"another run's {name} evaluation says {not higher}")
    return dict(sorted(metrics.items(), key=lambda item: item[0][0]))


def evaluation_rows(arms: Sequence[str], runs: Sequence[SweepRun],
                    evaluations: dict[RunKey, dict[str, Evaluation]]) -> list[dict]:
    """One row per evaluation, summary metric and arm: mean ± std over the arm's seeds with a value,
    its runs without one (no file, or no number: missing, never 0), and the paired comparison
    against arms[0] as for the final loss (Holm across the arms, per metric and test)."""
    rows = []
    for (name, metric), higher in evaluation_metrics(runs, evaluations).items():
        values: dict[str, dict[int, float]] = {arm: {} for arm in arms}
        missing: dict[str, list[int]] = {arm: [] for arm in arms}
        for run in runs:
            evaluation = evaluations[(run.arm, run.seed)].get(name)
            value = None if evaluation is None else evaluation.summary.get(metric)
            if value is None:
                missing[run.arm].append(run.seed)
            else:
                values[run.arm][run.seed] = value
        compared = {row["arm"]: row for row in paired_rows(arms, values)}
        for arm in arms:
            summary = spread(list(values[arm].values()))
            rows.append({"evaluation": name, "metric": metric, "higher_is_better": higher,
                         **compared.get(arm, reference_comparison()), "arm": arm, "seeds": summary.n,
                         "missing": len(missing[arm]), "missing_seeds": ", ".join(map(str, missing[arm])),
                         "mean": summary.mean, "std": summary.std})
    return rows


def per_layer_runs(arms: Sequence[str], runs: Sequence[SweepRun], evaluations: dict[RunKey, dict[str, Evaluation]]
                   ) -> dict[tuple[str, str], dict[str, list[list]]]:
    """(evaluation, per-layer metric) → arm → each of its runs' values by layer, by evaluation name."""
    by_metric: dict[tuple[str, str], dict[str, list[list]]] = defaultdict(lambda: {arm: [] for arm in arms})
    for run in runs:
        for name, evaluation in evaluations[(run.arm, run.seed)].items():
            for metric, values in evaluation.per_layer.items():
                by_metric[(name, metric)][run.arm].append(values)
    return dict(sorted(by_metric.items(), key=lambda item: item[0][0]))


def layer_rows(by_metric: dict[tuple[str, str], dict[str, list[list]]]) -> list[dict]:
    """One row per per-layer metric, arm and layer (1..L): mean ± std over the seeds with a value there."""
    rows = []
    for (name, metric), by_arm in by_metric.items():
        for arm, runs in by_arm.items():
            for layer in range(1, max((len(values) for values in runs), default=0) + 1):
                summary = spread([values[layer - 1] for values in runs if len(values) >= layer])
                rows.append({"evaluation": name, "metric": metric, "arm": arm, "layer": layer,
                             "seeds": summary.n, "mean": summary.mean, "std": summary.std})
    return rows


def layer_plot_name(evaluation: str, metric: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", f"evaluation_{evaluation}_{metric}_by_layer") + ".png"


# ---------------------------------------------------------------------------- the report


def latex_captions(reference: str) -> dict[str, str]:
    """The tables written as LaTeX, with their captions."""
    ref = rf"\texttt{{{escape(reference)}}}"
    per_arm = r"mean $\pm$ sample std over seeds"
    marks = f"Marks: paired t-test against {ref}, Holm-corrected across arms"
    return {
        "arms": f"Final validation loss and perplexity per arm, {per_arm}. {marks}.",
        "comparison": (f"Paired comparison against {ref} on the final validation loss (difference: arm $-$ "
                       f"reference over the seeds both have; p-values Holm-corrected across arms). {marks}."),
        "convergence": f"Convergence and stability per arm, {per_arm}.",
        "cost": f"Speed, memory and parameters per arm, {per_arm}.",
        "evaluations": (f"Post-training evaluations per arm, {per_arm} with a value (missing: runs without "
                        f"one). {marks}, per metric."),
    }


def definitions(settings: Settings) -> str:
    k = settings.last_k
    return f"""\
- Arms and seeds: a run is an `experiment.yaml` found under the inputs (arm = its `method`). It enters
  the statistics when its status is `finished`, it has a summary, was not preempted and has a finite final
  validation loss; every other run, and every seed another arm has but this arm has no record of, is
  listed under "Runs not in the statistics".
- Per arm: mean ± sample standard deviation (ddof=1) of the per-seed values over the arm's seeds in
  the statistics; "± n/a" with one seed, "n/a" with none. Perplexity is exp(final validation loss) per
  seed, then averaged. Final validation loss is the run summary's (the last validation eval).
- Paired comparison: difference = arm − reference final validation loss, over the seeds both arms have
  in the statistics (positive: the arm's loss is higher). t-test: `scipy.stats.ttest_rel`, two-sided.
  Wilcoxon signed-rank: `scipy.stats.wilcoxon`, two-sided, `zero_method="wilcox"` (zero differences
  discarded), `method="auto"` (exact null distribution up to 50 differences without ties or zeros;
  with them, exhaustive sign permutations up to 13, normal approximation above). With n pairs the
  smallest exact two-sided Wilcoxon p is 2/2^n (0.0625 at 5 pairs). Cohen's d_z = mean of the
  differences / their sample std (ddof=1). Holm: step-down over the non-reference arms with a p-value,
  separately for the t-test and the Wilcoxon p-values, made monotone. With fewer than two pairs the
  p-values and d_z are n/a; when all differences are equal (zero variance) the t-test and d_z are n/a;
  when all are zero the Wilcoxon test is n/a too.
- Target loss: {NA if settings.target_loss is None else f"{settings.target_loss:.4f}"}, {settings.target_source}.
  Steps to target: the step of the first validation eval at or below it; "not reached" when none is
  (per arm: mean ± std over the seeds that reached it, and how many did).
- Train seconds (to target, and in all): the training steps' own time, Σ step_time_s × steps each logged
  record stands for (a record logged at step s covers the steps since the previous record; exact with
  log_interval 1). Evaluation, checkpointing and start-up are not counted.
- AUCC: the area under the validation loss curve (trapezoids over steps, first to last eval) divided
  by its step span, i.e. the curve's mean loss; n/a below two evals. Lower is faster convergence.
- Validation evals with a non-finite loss are left out of the curve measures (target, AUCC, variance).
- Last-k loss var: sample variance (ddof=1) of the last {k} validation losses; n/a below {k} evals.
- Gradient norm: median and maximum of the logged global norm (DeepSpeed's, before clipping) over
  logged steps with a finite norm; clipped fraction: the share of those above `optimizer.clip_grad` from
  the run's config (n/a without a config or with clipping off). Logged steps are every log_interval-th.
- Tokens/s: median over logged steps of global tokens per step / step time. Peak memory: the largest
  `peak_mem_bytes` logged by rank 0 (GPU: allocator peak; CPU: process max RSS), in GiB (2^30 bytes).
- Plots: `{plots.VALID_CURVES}` mean validation loss over the seeds evaluated at each step, band
  min–max over those seeds; `{plots.FINAL_LOSS}` each seed (grey) and mean ± sample std;
  `{plots.SPEED_MEMORY}` bars at the mean over seeds with ± sample std error bars.
- Post-training evaluations: each run's `evaluations/<name>.json` (`summary` metrics with
  `higher_is_better`, optional `per_layer` lists). Per arm and metric: mean ± sample std over the
  seeds with a number; a run in the statistics without the file, the metric or a finite number is
  counted under "missing" with its seed, never as 0. Paired comparison against the reference as for
  the final loss (difference = arm − reference: positive is better where higher is better), Holm
  across the non-reference arms separately for each metric and test. Per-layer plots: mean over the
  seeds with a value at each layer, band min–max; their numbers are in `evaluation_layers.csv`.
- Tables as data: `<table>.csv` (n/a written as `n/a`) and `report.json` (settings and every table;
  n/a is null), full precision; the Markdown rounds.
- LaTeX: `arms.tex`, `comparison.tex`, `convergence.tex`, `cost.tex`, `evaluations.tex` (booktabs;
  mean ± std as in the Markdown). A value marked `*` has a Holm-adjusted paired t-test p < 0.05 against
  the reference, `**` p < 0.01 (the Wilcoxon test cannot reach 0.05 with 5 pairs).
"""


def evaluations_markdown(sweep: Sweep, evaluations: dict[RunKey, dict[str, Evaluation]], table: Table,
                         layer_plots: dict[tuple[str, str], str]) -> str:
    names = sorted({name for found in evaluations.values() for name in found})
    if not names:
        return f"None: no run in the statistics has an `evaluations/<name>.json` file ({len(sweep.used)} runs)."
    counts = ", ".join(f"`{name}` {sum(name in evaluations[(r.arm, r.seed)] for r in sweep.used)} of "
                       f"{len(sweep.used)}" for name in names)
    plots_text = "".join(f"\n\n![{name}: {metric} by layer]({file})" for (name, metric), file in layer_plots.items())
    return (f"Runs in the statistics with each evaluation file: {counts}. Per arm and metric: mean ± std over "
            f"the seeds with a value; missing: runs without one (their seeds).\n\n{table.markdown()}{plots_text}")


def markdown(settings: Settings, sweep: Sweep, tables: dict[str, Table], evaluations_text: str,
             gaps_text: str = "", gaps_definitions: str = "") -> str:
    inputs = ", ".join(f"`{p}`" for p in settings.inputs)
    target = NA if settings.target_loss is None else f"{settings.target_loss:.4f}"
    not_used = tables["not_used"].markdown() if tables["not_used"].rows else "None."
    spec = f"Spec: `{settings.spec}`.\n" if settings.spec else ""
    return f"""\
# Sweep report

Inputs: {inputs}. Runs found: {sweep.found}, in the statistics: {len(sweep.used)}; \
listed as not in the statistics: {len(sweep.not_used)} (missing seeds included).
{spec}Reference arm: `{settings.reference}`. Target validation loss: {target} ({settings.target_source}). \
Last k: {settings.last_k}.
{revisions_text(settings.revisions)}

## Final validation loss per arm

{tables["arms"].markdown()}

{gaps_text}## Paired comparison against `{settings.reference}` (final validation loss)

{tables["comparison"].markdown()}

## Convergence and stability

{tables["convergence"].markdown()}

## Speed, memory and parameters

{tables["cost"].markdown()}

## Post-training evaluations

{evaluations_text}

## Runs not in the statistics

{not_used}

## Plots

![validation loss curves]({plots.VALID_CURVES})

![final validation loss]({plots.FINAL_LOSS})

![speed and memory]({plots.SPEED_MEMORY})

## Per run

{tables["runs"].markdown()}

## Definitions

{definitions(settings)}{gaps_definitions}"""


def read_spec(path: Path) -> SweepSpec:
    """The sweep spec given with --spec; an invalid one is a ReportError naming its file and key."""
    try:
        return load_spec(path).body
    except SweepError as e:
        raise ReportError(f"--spec {e}") from None


def gaps_part(spec: SweepSpec, sweep: Sweep, measures: Sequence[RunMeasures],
              evaluations: dict[RunKey, dict[str, Evaluation]], out: Path) -> tuple[dict[str, Table], str, str]:
    """The spec's gaps: their tables (CSV, JSON, LaTeX and gaps.png written here), the report's
    section and its definitions."""
    gaps = spec.gaps
    pairs = gaps.pairs(spec.arms)
    x_of = shape_gaps.run_xs(gaps, pairs, sweep.used)
    rows = shape_gaps.gap_rows(pairs, x_of, sweep.used, sweep.not_used, shape_gaps.loss_values(measures))
    trends = shape_gaps.trends_of(rows)
    trend_rows = shape_gaps.trend_rows(trends, gaps)
    tables = {t.name: t for t in (shape_gaps.gaps_table(rows, gaps), shape_gaps.trend_table(trend_rows),
                                  shape_gaps.seeds_table(shape_gaps.seed_rows(rows, measures)))}
    higher_is_better = evaluation_metrics(sweep.used, evaluations)
    directions = {}
    for metric in gaps.metrics:
        key = metric_key(metric)
        directions[metric] = higher_is_better.get(key)
        metric_rows = shape_gaps.gap_rows(pairs, x_of, sweep.used, sweep.not_used,
                                          shape_gaps.metric_values(key, evaluations), directions[metric])
        name = shape_gaps.metric_table_name(metric)
        tables[name] = shape_gaps.gaps_table(metric_rows, gaps, name)
    for name, caption in shape_gaps.captions(gaps, escape, directions).items():
        write_latex(tables[name], out, caption)
    plots.plot_gaps(rows, trends, gaps.x, f"{gaps.arm} − {gaps.reference}", out / plots.GAPS)
    return (tables, shape_gaps.section(gaps, tables, trend_rows, plots.GAPS, directions),
            shape_gaps.definitions(gaps))


def build_report(inputs: Sequence[Path], out: Path, reference: Optional[str] = None,
                 target_loss: Optional[float] = None, last_k: int = 5, spec: Optional[Path] = None) -> Path:
    """Write the report of the sweeps under `inputs` into `out`; returns report.md's path. `spec`: the
    sweep's spec, whose reference is the default one and whose `gaps` adds the gap by shape; without
    it (and without `reference`) the reference is `vanilla`."""
    if last_k < 2:
        raise ReportError(f"--last-k must be at least 2 (a variance), got {last_k}")
    if out.exists() and not out.is_dir():
        raise ReportError(f"--out {out} is a file: give a directory for the report")
    body = read_spec(spec) if spec is not None else None
    reference = reference or (body.reference if body else "vanilla")
    runs = discover_runs(inputs)
    sweep = sort_sweep(runs, reference, list(body.arms) if body else ())
    reference_final = {r.seed: r.run_dir.read_summary().final_valid_loss for r in sweep.used if r.arm == reference}
    target, source = choose_target(target_loss, reference, reference_final)
    settings = Settings([str(p) for p in inputs], reference, target, source, last_k, revisions_of(sweep.used),
                        str(spec) if spec else None, asdict(body.gaps) if body and body.gaps else None)
    measures = [measure_run(run, target, last_k) for run in sweep.used]
    evaluations = {(run.arm, run.seed): read_evaluations(run.run_dir) for run in sweep.used}
    by_layer = per_layer_runs(sweep.arms, sweep.used, evaluations)
    arm_rows = [arm_row(arm, [m for m in measures if m.arm == arm]) for arm in sweep.arms]
    comparison = comparison_rows(sweep.arms, measures)
    marks = {row["arm"]: row[MARK_KEY] for row in comparison}
    for row in arm_rows:
        row[MARK_KEY] = marks.get(row["arm"])
    tables = {t.name: t for t in (arms_table(arm_rows), comparison_table(comparison),
                                  convergence_table(arm_rows), cost_table(arm_rows),
                                  evaluations_table(evaluation_rows(sweep.arms, sweep.used, evaluations)),
                                  layers_table(layer_rows(by_layer)), runs_table(measures),
                                  not_used_table(sweep.not_used))}
    out.mkdir(parents=True, exist_ok=True)
    gaps_text = gaps_definitions = ""
    if body is not None and body.gaps is not None:
        gap_tables, gaps_text, gaps_definitions = gaps_part(body, sweep, measures, evaluations, out)
        tables.update(gap_tables)
    for table in tables.values():
        table.write_csv(out)
    for name, caption in latex_captions(reference).items():
        write_latex(tables[name], out, caption)
    document = {"settings": asdict(settings), "tables": {name: t.records() for name, t in tables.items()}}
    (out / "report.json").write_text(json.dumps(document, indent=1, allow_nan=False) + "\n")
    plots.plot_valid_curves(sweep.arms, measures, out / plots.VALID_CURVES)
    plots.plot_final_loss(sweep.arms, measures, out / plots.FINAL_LOSS)
    plots.plot_speed_memory(sweep.arms, measures, out / plots.SPEED_MEMORY)
    layer_plots = {key: layer_plot_name(*key) for key in by_layer}
    for (name, metric), by_arm in by_layer.items():
        plots.plot_by_layer(sweep.arms, by_arm, f"{name} {metric}", out / layer_plots[(name, metric)])
    report = out / "report.md"
    text = markdown(settings, sweep, tables,
                    evaluations_markdown(sweep, evaluations, tables["evaluations"], layer_plots),
                    gaps_text, gaps_definitions)
    per_source = sources_table(sweep.arms, sweep.used)
    if per_source is not None:  # a manifest of several sources: sources.csv, report.json, a section
        per_source.write_csv(out)
        document["tables"]["sources"] = per_source.records()
        (out / "report.json").write_text(json.dumps(document, indent=1, allow_nan=False) + "\n")
        text = text.replace("## Per run\n", sources_markdown(per_source) + "## Per run\n", 1)
    report.write_text(text)
    return report
