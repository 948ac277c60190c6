"""Per data source: each arm's final validation loss on every source of its manifest, and its difference
from the reference arm, from the run summaries' `final_valid_loss_by_source` (eval.per_source)."""

from __future__ import annotations

from typing import Optional, Sequence

from pretrain.research.report.runs import SweepRun
from pretrain.research.report.stats import spread
from pretrain.research.report.tables import Column, Table, fixed, mean_std, plain


def sources_table(arms: Sequence[str], runs: Sequence[SweepRun]) -> Optional[Table]:
    """One row per arm, two columns per source: its final validation loss there (mean ± std over the
    seeds) and the mean over paired seeds of arm − reference (arms[0]); None when no run has sources."""
    by_run = {(run.arm, run.seed): run.run_dir.read_summary().final_valid_loss_by_source or {} for run in runs}
    sources = sorted({source for losses in by_run.values() for source in losses})
    if not sources:
        return None
    rows, columns = [], [Column("arm", ("arm",), plain)]
    for source in sources:
        columns += [Column(source, (f"{source}_mean", f"{source}_std"), mean_std(fixed(4))),
                    Column(f"{source} − ref", (f"{source}_diff",), fixed(4))]
    for arm in arms:
        row = {"arm": arm}
        for source in sources:
            mine = {seed: losses[source] for (a, seed), losses in by_run.items() if a == arm and source in losses}
            ref = {seed: losses[source] for (a, seed), losses in by_run.items() if a == arms[0] and source in losses}
            summary = spread(list(mine.values()))
            paired = [mine[seed] - ref[seed] for seed in mine if seed in ref]
            row.update({f"{source}_mean": summary.mean, f"{source}_std": summary.std,
                        f"{source}_diff": sum(paired) / len(paired) if paired and arm != arms[0] else None})
        rows.append(row)
    return Table("sources", columns, rows)


def sources_markdown(table: Optional[Table]) -> str:
    """The report's section, placed before its per-run table; empty without sources."""
    if table is None:
        return ""
    return ("## Final validation loss per data source\n\n"
            "Each source's loss at the last validation (mean ± std over seeds) and the mean over paired seeds of "
            "arm − reference.\n\n" + table.markdown() + "\n\n")
