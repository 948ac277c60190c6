"""The sweep report's tables, the gaps' aside (gaps.py): the columns of each and how they render the values of
the rows build.py makes."""

from __future__ import annotations

from dataclasses import asdict
from typing import Optional, Sequence

from pretrain.research.report.latex import MARK_KEY
from pretrain.research.report.runs import RunMeasures
from pretrain.research.report.tables import Column, Table, count, fixed, mean_std, plain, significant


def _spread_column(header: str, field: str, render) -> Column:
    return Column(header, (f"{field}_mean", f"{field}_std"), render)


def _reached(value, reached: Optional[bool], render) -> str:
    return "not reached" if reached is False else render(value)


ARM = Column("arm", ("arm",), plain)
SEEDS = Column("seeds", ("seeds",), plain)


def arms_table(rows: list[dict]) -> Table:
    """`rows` carry the comparison's MARK_KEY, which marks the final loss in LaTeX."""
    return Table("arms", [ARM, SEEDS, Column("seed list", ("seed_list",), plain, latex=False),
                          Column("final valid loss", ("final_valid_loss_mean", "final_valid_loss_std"),
                                 mean_std(fixed(4)), mark=MARK_KEY),
                          _spread_column("final valid ppl", "final_valid_ppl", mean_std(fixed(2)))], rows)


def comparison_table(rows: list[dict]) -> Table:
    p = significant(4)
    return Table("comparison", [
        ARM, Column("pairs", ("pairs",), plain),
        Column("mean diff (arm − ref)", ("mean_difference",), fixed(4), mark=MARK_KEY),
        Column("t-test p", ("t_test_p",), p, latex=False), Column("t-test p (Holm)", ("t_test_p_holm",), p),
        Column("Wilcoxon p", ("wilcoxon_p",), p, latex=False),
        Column("Wilcoxon p (Holm)", ("wilcoxon_p_holm",), p),
        Column("Cohen's d_z", ("cohens_dz",), fixed(3)), Column("note", ("note",), plain, latex=False)], rows)


def evaluations_table(rows: list[dict]) -> Table:
    p = significant(4)
    return Table("evaluations", [
        Column("evaluation", ("evaluation",), plain), Column("metric", ("metric",), plain),
        Column("better", ("higher_is_better",), lambda higher: "higher" if higher else "lower"),
        ARM, SEEDS, Column("missing", ("missing", "missing_seeds"), lambda n, seeds: f"{n} ({seeds})" if n else "0"),
        Column("mean ± std", ("mean", "std"), mean_std(significant(4)), mark=MARK_KEY),
        Column("pairs", ("pairs",), plain, latex=False),
        Column("mean diff (arm − ref)", ("mean_difference",), significant(4)),
        Column("t-test p", ("t_test_p",), p, latex=False), Column("t-test p (Holm)", ("t_test_p_holm",), p),
        Column("Wilcoxon p", ("wilcoxon_p",), p, latex=False),
        Column("Wilcoxon p (Holm)", ("wilcoxon_p_holm",), p),
        Column("Cohen's d_z", ("cohens_dz",), fixed(3)), Column("note", ("note",), plain, latex=False)], rows)


def layers_table(rows: list[dict]) -> Table:
    """The numbers behind the per-layer plots (CSV and JSON only)."""
    return Table("evaluation_layers", [
        Column("evaluation", ("evaluation",), plain), Column("metric", ("metric",), plain), ARM,
        Column("layer", ("layer",), plain), SEEDS, Column("mean ± std", ("mean", "std"), mean_std(significant(4)))],
                 rows)


def convergence_table(rows: list[dict]) -> Table:
    return Table("convergence", [
        ARM, SEEDS, Column("reached target", ("reached_target",), plain),
        _spread_column("steps to target", "steps_to_target", mean_std(fixed(0))),
        _spread_column("train s to target", "seconds_to_target", mean_std(fixed(1))),
        _spread_column("AUCC (mean loss)", "aucc", mean_std(fixed(4))),
        _spread_column("last-k loss var", "last_k_variance", mean_std(significant(3))),
        _spread_column("grad norm median", "grad_norm_median", mean_std(fixed(3))),
        _spread_column("grad norm max", "grad_norm_max", mean_std(fixed(3))),
        _spread_column("clipped fraction", "clipped_fraction", mean_std(fixed(3))),
        _spread_column("skipped steps", "skipped_steps", mean_std(fixed(1)))], rows)


def cost_table(rows: list[dict]) -> Table:
    return Table("cost", [
        ARM, SEEDS, _spread_column("tokens/s (median)", "tokens_per_s_median", mean_std(fixed(0))),
        _spread_column("peak memory GiB", "peak_memory_gib", mean_std(fixed(3))),
        _spread_column("train s", "train_seconds", mean_std(fixed(1))),
        Column("trainable params", ("trainable_params_mean",), count),
        Column("frozen params", ("frozen_params_mean",), count)], rows)


def runs_table(measures: Sequence[RunMeasures]) -> Table:
    rows = [asdict(m) for m in measures]
    return Table("runs", [
        ARM, Column("seed", ("seed",), plain),
        Column("final valid loss", ("final_valid_loss",), fixed(4)),
        Column("final valid ppl", ("final_valid_ppl",), fixed(2)),
        Column("steps to target", ("steps_to_target", "target_reached"), lambda v, r: _reached(v, r, count)),
        Column("train s to target", ("seconds_to_target", "target_reached"), lambda v, r: _reached(v, r, fixed(1))),
        Column("AUCC", ("aucc",), fixed(4)), Column("last-k var", ("last_k_variance",), significant(3)),
        Column("grad norm median", ("grad_norm_median",), fixed(3)),
        Column("grad norm max", ("grad_norm_max",), fixed(3)),
        Column("clipped", ("clipped_fraction",), fixed(3)), Column("skipped", ("skipped_steps",), plain),
        Column("tokens/s", ("tokens_per_s_median",), fixed(0)),
        Column("peak GiB", ("peak_memory_gib",), fixed(3)), Column("train s", ("train_seconds",), fixed(1)),
        Column("trainable", ("trainable_params",), count), Column("frozen", ("frozen_params",), count)], rows)


def not_used_table(rows: list[dict]) -> Table:
    return Table("not_used", [
        ARM, Column("seed", ("seed",), plain), Column("status", ("status",), plain),
        Column("exit code", ("exit_code",), plain), Column("reason", ("reason",), plain),
        Column("log tail, first line", ("log_line",), lambda line: f"`{line}`" if line else ""),
        Column("run dir", ("run_dir",), plain)], rows)
