"""`python -m pretrain.research.sweep`: the command line (the package docstring is its reference)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from pretrain.research import sweep
from pretrain.research.sweep.runner import EXIT_ALL_FINISHED, execute, exit_status, run_env
from pretrain.research.sweep.slurm import run_task, write_script
from pretrain.research.sweep.spec import Run, SweepError, expand, load_spec
from pretrain.research.sweep.state import plan, plan_text, record_orphans_that_completed, status_table

EXIT_SPEC_ERROR = 2


def parse_seeds(text: str) -> list[int]:
    """--seeds 42,2024: distinct integers (a usage error, exit 2, otherwise)."""
    try:
        seeds = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"expected distinct integers, got {text!r}")
    return seeds


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pretrain.research.sweep",
                                     description=sweep.__doc__.split("\n\n")[0])
    parser.add_argument("--spec", required=True, type=Path, help="experiment spec YAML (pretrain/experiments/)")
    parser.add_argument("--out", required=True, type=Path, help="sweep directory: OUT/<arm>/seed<seed>")
    parser.add_argument("--scale", default="cpu", help="one of the spec's scales (default: cpu)")
    parser.add_argument("--seeds", type=parse_seeds, help="comma-separated seeds (default: the spec's)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override for every run, e.g. data.manifest=... (repeatable)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (local)")
    parser.add_argument("--retry-failed", action="store_true", help="start failed runs again")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--dry-run", action="store_true", help="print what would run and exit")
    what.add_argument("--emit", choices=["commands", "slurm"],
                      help="print the runs' commands, or write OUT/sweep.sbatch (a SLURM array job)")
    what.add_argument("--task", type=int, help="run only run TASK through launch/pretrain_ora.sh (SLURM array task)")
    return parser.parse_args(argv)


def sweep_arguments(args: argparse.Namespace, spec_path: Path, out: Path) -> list[tuple[str, ...]]:
    """The command line a SLURM task repeats (same spec, out, scale, seeds, overrides, retry flag), grouped."""
    groups = [("--spec", str(spec_path)), ("--out", str(out)), ("--scale", args.scale)]
    if args.seeds:
        groups.append(("--seeds", ",".join(map(str, args.seeds))))
    groups += [("--set", item) for item in args.set]
    return groups + ([("--retry-failed",)] if args.retry_failed else [])


def emit(args: argparse.Namespace, runs: list[Run], spec_path: Path, out: Path) -> int:
    if args.emit == "commands":  # each run's training, then its evaluations
        print("\n".join(shlex.join(command) for run in runs for command in
                        [run.local_command(), *(run.evaluation_command(name) for name in run.spec.body.evaluations)]))
        return EXIT_ALL_FINISHED
    script = write_script(runs, sweep_arguments(args, spec_path, out), out)
    print(f"wrote {script} ({len(runs)} array tasks): sbatch {shlex.quote(str(script))}")
    return EXIT_ALL_FINISHED


def run_locally(args: argparse.Namespace, runs: list[Run]) -> int:
    tasks, signum = plan(runs, args.retry_failed), None
    if args.dry_run:
        print(plan_text(runs, tasks))
        return EXIT_ALL_FINISHED
    record_orphans_that_completed(runs)
    if not tasks:
        print(f"nothing to start: none of the {len(runs)} runs is pending or interrupted, no evaluation is pending"
              f"{'' if args.retry_failed else ' (failed runs and evaluations start again with --retry-failed)'}")
    else:
        trainings = sum(task.train for task in tasks)
        evaluations = sum(len(task.evaluations) for task in tasks)
        print(f"starting {trainings} of {len(runs)} runs and {evaluations} evaluations, {args.jobs} at a time",
              flush=True)
        env = run_env(args.jobs)
        signum = execute(tasks, args.jobs, env, lambda run: (run.local_command(), env))
    print(status_table(runs))
    return exit_status(runs, signum)


def main(argv=None) -> int:
    args = parse_args(argv)
    spec_path, out = args.spec.resolve(), args.out.resolve()
    try:
        if args.jobs < 1:
            raise SweepError(f"--jobs must be >= 1, got {args.jobs}")
        runs = expand(load_spec(spec_path), args.scale, args.seeds, args.set, out)
        if args.emit:
            return emit(args, runs, spec_path, out)
        if args.task is not None:
            return run_task(runs, args.task, args.retry_failed)
        return run_locally(args, runs)
    except SweepError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_SPEC_ERROR


if __name__ == "__main__":
    sys.exit(main())
