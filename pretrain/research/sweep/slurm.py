"""A sweep as a SLURM array job: OUT/sweep.sbatch, whose task i runs run i (`--task i`) through
launch/pretrain_ora.sh, then its evaluations, with the same records, skips and locks as a local sweep."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from pretrain.paths import REPO
from pretrain.research.sweep.runner import execute, exit_status
from pretrain.research.sweep.spec import Run, SweepError
from pretrain.research.sweep.state import record_orphans_that_completed, run_state, tasks_of

LAUNCH_SCRIPT = REPO / "launch" / "pretrain_ora.sh"
SCRIPT_NAME = "sweep.sbatch"


def launch_command(run: Run) -> tuple[list[str], dict[str, str]]:
    """launch/pretrain_ora.sh and the environment it reads (a cluster task)."""
    env = {"RUN_DIR": str(run.run_dir.path), "NNODES": "1", "GPUS_PER_NODE": str(run.scale.processes_per_node)}
    return [str(LAUNCH_SCRIPT), str(run.spec.config_path), *run.set_flags()], env


def slurm_script(runs: list[Run], sweep_args: list[tuple[str, ...]], out: Path) -> str:
    """An array job, task i = run i through the sweep's --task mode (records, skips, locks).
    sweep_args: the task's command line in groups (an option and its value), one line each."""
    scale = runs[0].scale
    arguments = "".join(f"\n  {shlex.join(group)}" for group in sweep_args)
    return f"""#!/usr/bin/env bash
# Sweep {runs[0].spec.name}: {len(runs)} runs, task i runs run i (seed-major: {runs[0].experiment_id}, ...).
# Submit from an activated environment (sbatch passes it on): sbatch {shlex.quote(str(out / SCRIPT_NAME))}
#SBATCH --job-name=ora-{runs[0].spec.name}
#SBATCH --array=0-{len(runs) - 1}
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={scale.processes_per_node}
set -euo pipefail
out={shlex.quote(str(out))}
exec >>"$out/slurm-${{SLURM_ARRAY_JOB_ID}}_${{SLURM_ARRAY_TASK_ID}}.out" 2>&1
cd {shlex.quote(os.getcwd())}
# Literal arguments, quoted once and never expanded: shellcheck's hints about $ and commas in them do not apply.
# shellcheck disable=SC2016,SC2054
sweep_args=({arguments}
)
exec python -m pretrain.research.sweep "${{sweep_args[@]}}" --task "$SLURM_ARRAY_TASK_ID"
"""


def write_script(runs: list[Run], sweep_args: list[tuple[str, ...]], out: Path) -> Path:
    """OUT/sweep.sbatch (executable), whose tasks repeat `sweep_args` (see slurm_script)."""
    out.mkdir(parents=True, exist_ok=True)
    script = out / SCRIPT_NAME
    script.write_text(slurm_script(runs, sweep_args, out))
    script.chmod(0o755)
    return script


def run_task(runs: list[Run], task: int, retry_failed: bool) -> int:
    """Array task `task`: run that run through the launch script unless it is finished (or failed,
    without retry_failed) or running elsewhere, then its pending evaluations; returns the sweep's
    exit status for it."""
    if not 0 <= task < len(runs):
        raise SweepError(f"--task {task}: the sweep has runs 0..{len(runs) - 1}")
    run, signum = runs[task], None
    record_orphans_that_completed([run])
    tasks = tasks_of([run], retry_failed)
    if not tasks:
        print(f"{run.experiment_id}: {run_state(run)}, nothing to do")
    else:
        command, env = launch_command(run)
        signum = execute(tasks, 1, dict(os.environ), lambda _: (command, {**os.environ, **env}))
    return exit_status([run], signum)
