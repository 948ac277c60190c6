"""The statistical report of one or more sweep output directories (`python -m pretrain.research.sweep`'s
--out: one run in each <arm>/seed<seed>/): report.md with per-arm final losses (mean ± std), paired
tests against the reference arm (t-test and Wilcoxon, Holm-corrected; Cohen's d_z), convergence,
stability, speed and memory, the runs' post-training evaluations (RUN/evaluations/*.json) compared
the same way, the tables as CSV and JSON, the main ones as LaTeX, and plots. With --spec, the sweep's
spec gives the reference arm, lists its arms that have no run, and its `gaps` add the gap of each
shape's arm against its twin, per shape and as a trend against x."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional, Sequence

from pretrain.research.report.build import build_report
from pretrain.research.report.runs import ReportError


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pretrain.research.report", description=__doc__)
    parser.add_argument("dirs", nargs="+", type=Path, help="sweep output folders (runs in <arm>/seed<seed>/)")
    parser.add_argument("--out", required=True, type=Path, help="folder for report.md, tables and plots")
    parser.add_argument("--spec", type=Path, default=None,
                        help="the sweep's spec (pretrain/experiments/*.yaml): its reference, arms and gaps")
    parser.add_argument("--reference", default=None,
                        help="the arm every other arm is compared with (default: the spec's, else vanilla)")
    parser.add_argument("--target-loss", type=float, default=None,
                        help="validation loss for steps/time to target (default: the reference's worst final)")
    parser.add_argument("--last-k", type=int, default=5, help="validation evals in the final-loss variance")
    args = parser.parse_args(argv)
    try:
        report = build_report(args.dirs, args.out, args.reference, args.target_loss, args.last_k, args.spec)
    except ReportError as e:
        parser.error(str(e))
    print(f"report: {report}")


if __name__ == "__main__":
    main()
