"""Kill-and-resume benchmark: is a job killed with SIGKILL resumed by the same command at once?

    python -m pretrain.research.benchmarks.kill_resume --out runs/kill_resume --kills 20 [--json kill_resume.json]

Trains the `tiny` preset through the training entry as the chaos benchmark runs it (mock data, 2 CPU
processes, ZeRO-1; chaos.entry_command), logging to wandb offline as the preset does: its service,
a process rank 0 starts, is alive at every kill. `--kills` times in a row: once the job has logged
`--steps-per-job` steps past what the run had logged before it started, its launcher's process group
gets SIGKILL (the OOM killer, `kill -9`: the workers die with their launcher) and, at once, the same
command starts again, as a requeuing scheduler or a person retrying would. A start that the run dir's
lock refuses (status 2, "is in use") is a refusal: the command is started again once the lock is free
(the seconds that took are recorded). Right after each kill, while the resumed job starts, the
processes that still hold the run dir's lock (the resumed job's launcher aside) are listed from /proc.
After the last kill the run trains to its end.

It reports the kills, the refusals, the kills after which a process still held the lock (and which),
whether the run finished, and the wall time. Results go to --out/kill_resume.json (or --json), a
markdown table to stdout, each job's output to --out/jobs/. The run dir (--out/run) starts afresh.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from pretrain.paths import REPO
from pretrain.research.benchmarks.chaos import entry_command, finished, run_overrides
from pretrain.research.benchmarks.outputs import publish, rerun_command
from pretrain.run_files.lock import flock_holders
from pretrain.run_files.run_dir import RunDir

SCHEMA = "ora-kill-resume/1"
REFUSAL = "is in use"  # run_dir.RunDir's refusal, which the entry prints and ends with status 2
FREE_TIMEOUT_S = 300.0


@dataclass
class Kill:
    step: int  # the last step logged before the kill
    held_after: list[str]  # the processes of the killed job that held the lock as the resume started


@dataclass
class Jobs:
    """The run's jobs: started, refused (and the seconds each refusal's lock took to come free), killed."""

    run_dir: RunDir
    command: list[str]
    logs: Path
    started: int = 0
    refusals: list[float] = field(default_factory=list)
    kills: list[Kill] = field(default_factory=list)

    def start(self) -> subprocess.Popen:
        self.started += 1
        with open(self.logs / f"{self.started:02d}.log", "w") as log:
            return subprocess.Popen(self.command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    def refused(self, job: subprocess.Popen) -> bool:
        return job.returncode == 2 and REFUSAL in (self.logs / f"{self.started:02d}.log").read_text()

    def train_to(self, job: subprocess.Popen, step: int) -> subprocess.Popen:
        """The job (or, after refusals, the one started in its place) once the run has logged `step`."""
        while not logged_past(self.run_dir, step, job):
            if not self.refused(job):
                raise RuntimeError(f"job {self.started} ended with status {job.returncode} before step {step}: "
                                   f"{self.logs / f'{self.started:02d}.log'}")
            waited = time.monotonic()
            while self.run_dir.lock_holder() is not None and time.monotonic() - waited < FREE_TIMEOUT_S:
                time.sleep(0.1)
            self.refusals.append(time.monotonic() - waited)
            job = self.start()
        return job

    def kill_and_resume(self, job: subprocess.Popen) -> subprocess.Popen:
        step = last_step(self.run_dir)
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
        resumed = self.start()
        held = [str(holder) for holder in flock_holders(self.run_dir.lock_file) if holder.pid != resumed.pid]
        self.kills.append(Kill(step, held))
        return resumed


def last_step(run_dir: RunDir) -> int:
    return max((r.step for r in run_dir.read_records("train")), default=0)


def logged_past(run_dir: RunDir, step: int, job: subprocess.Popen) -> bool:
    """Wait until the run has logged `step` (True) or the job has ended before it (False)."""
    while last_step(run_dir) < step:
        if job.poll() is not None:
            return last_step(run_dir) >= step
        time.sleep(0.05)
    return True


def table(result: dict) -> str:
    held = [kill for kill in result["kills"] if kill["held_after"]]
    holders = sorted({line.split(": ", 1)[1] for kill in held for line in kill["held_after"]})
    return "\n".join([
        f"| kill and resume ({result['steps']} steps, {result['nproc']} processes, wandb offline) | |",
        "|---|---|",
        f"| kills, refusals | {len(result['kills'])} kills, {len(result['refusals'])} refusals |",
        f"| kills after which a process of the killed job still held the lock | {len(held)} "
        f"({'; '.join(holders) or 'none'}) |",
        f"| jobs started | {result['jobs']} |",
        f"| finished | {result['finished']} |",
        f"| wall time | {result['wall_s']:.0f} s |",
    ])


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder of the run, its jobs' output and the results")
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--steps-per-job", type=int, default=3, help="steps a job logs past the run's before its kill")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--save-interval", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--json", help="default: OUT/kill_resume.json")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    run_dir, logs = RunDir(out / "run"), out / "jobs"
    shutil.rmtree(run_dir.path, ignore_errors=True)
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    overrides = [*run_overrides(args.steps, args.save_interval, "offline"), "checkpoint.keep_last=2",
                 "train.log_interval=1", f"train.eval_interval={args.steps}"]
    jobs = Jobs(run_dir, entry_command(run_dir.path, args.nproc, overrides), logs)
    started = time.monotonic()
    job = jobs.start()
    while len(jobs.kills) < args.kills:
        job = jobs.train_to(job, last_step(run_dir) + args.steps_per_job)
        job = jobs.kill_and_resume(job)
        print(f"[{datetime.datetime.now():%H:%M:%S}] kill {len(jobs.kills)} after step {jobs.kills[-1].step}, "
              f"{len(jobs.refusals)} refusals so far; held after it by {jobs.kills[-1].held_after}",
              file=sys.stderr, flush=True)
    job = jobs.train_to(job, args.steps)
    job.wait()
    result = {"schema": SCHEMA, "date": datetime.date.today().isoformat(),
              "command": rerun_command(__spec__.name, argv), "steps": args.steps, "nproc": args.nproc,
              "kills": [asdict(kill) for kill in jobs.kills], "refusals": jobs.refusals, "jobs": jobs.started,
              "finished": job.returncode == 0 and finished(run_dir, args.steps), "wall_s": time.monotonic() - started}
    publish(table(result), json.dumps(result, indent=1) + "\n", Path(args.json or out / "kill_resume.json"), None)
    return 0 if result["finished"] and not result["refusals"] else 1


if __name__ == "__main__":
    sys.exit(main())
