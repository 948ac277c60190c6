"""Stand-ins for SLURM's commands, for running launch/slurm/pretrain_ora.sbatch on this machine as
`bash pretrain_ora.sbatch ...` with the job's variables (SLURM_JOB_ID, SLURM_JOB_NODELIST,
SLURM_SUBMIT_DIR) set: srun starts one task (the job's one node) and passes SIGTERM on to it, as srun
forwards signals to its tasks; scontrol lists this machine and appends a requeue to the file $REQUEUED."""

from __future__ import annotations

import os
from pathlib import Path

SRUN = """\
while [[ $1 == -* ]]; do shift; done
env SLURM_NODEID=0 SLURM_PROCID=0 SLURM_LOCALID=0 SLURM_NTASKS=1 "$@" &
task=$!
trap 'kill -TERM "$task"' TERM
status=0
wait "$task" || status=$?
while kill -0 "$task" 2> /dev/null; do status=0; wait "$task" || status=$?; done
exit "$status"
"""
SCONTROL = """\
case "$1 $2" in
  "show hostnames") echo localhost ;;
  "requeue $SLURM_JOB_ID") echo "$*" >> "$REQUEUED" ;;
  *) exit 1 ;;
esac
"""


def stand_in(path: Path, script: str) -> None:
    """An executable bash script at `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/usr/bin/env bash\nset -euo pipefail\n" + script)
    path.chmod(0o755)


def one_node_job(tmp_path: Path, launch_script: str) -> dict[str, str]:
    """The variables of a one-node job (the stand-ins first on PATH) whose submit dir's
    launch/pretrain_ora.sh, what the job runs on its node, is `launch_script`."""
    bin_dir, submit_dir = tmp_path / "bin", tmp_path / "submitted"
    stand_in(bin_dir / "srun", SRUN)
    stand_in(bin_dir / "scontrol", SCONTROL)
    stand_in(submit_dir / "launch" / "pretrain_ora.sh", launch_script)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_SUBMIT_DIR": str(submit_dir), "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NODELIST": "localhost"}
