"""Running the planned tasks (a run's training, then its evaluations): each process gets the run
dir's lock (held to its end, whatever happens to the sweep); SIGTERM/SIGINT stop the sweep and make
the running runs checkpoint."""

from __future__ import annotations

import datetime
import os
import shlex
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Optional

from pretrain.job.environment import git_revision
from pretrain.research.sweep.spec import Run, SweepError
from pretrain.research.sweep.state import (
    Task,
    done_since_planned,
    evaluation_state,
    log_tail,
    loss_text,
    results_of,
    run_state,
    started_record,
)
from pretrain.run_files.lock import LOCK_ON_STDIN, RunDirBusy, RunDirLock
from pretrain.run_files.run_records import ExperimentRecord

POLL_S = 0.2

EXIT_ALL_FINISHED, EXIT_NOT_ALL_FINISHED = 0, 1


class DoneSincePlanned(Exception):
    """The step a task starts with was done by another job (a second sweep on the same sweep dir)
    between this invocation's plan and its turn: read under the run's lock, so it never runs twice."""


@dataclass
class TaskAttempt:
    """One start of a run's training or of one of its evaluations: its process, the lock it holds,
    where its part of sweep.log begins."""

    run: Run
    evaluation: Optional[str]  # None: the training
    record: ExperimentRecord
    process: subprocess.Popen
    lock: RunDirLock
    log_offset: int
    started: float
    task: Task  # the task whose first step this is (Task.after: what follows it)


def spawn(run: Run, command: list[str], env: dict[str, str], lock: RunDirLock) -> tuple[subprocess.Popen, int]:
    """Start `command` with its output appended to the run's sweep.log; returns the process and the
    log offset where its output begins. The lock goes to the process too (as its stdin): it stays
    held while the process lives, whatever happens to this sweep, so no other job starts in the run
    dir meanwhile."""
    with open(run.log, "a") as log:
        log.write(f"== {datetime.datetime.now().isoformat(timespec='seconds')} sweep starts: {shlex.join(command)}\n")
        log.flush()
        offset = log.tell()
        try:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=lock.fd,
                                       env={**env, LOCK_ON_STDIN: "1"})
        except OSError as e:  # e.g. no launch script on this checkout; a training's record says "running": retried
            lock.release()
            raise SweepError(f"cannot start {run.experiment_id}: {e}") from None
    lock.record_holder(process.pid, shlex.join(command))
    return process, offset


def start(task: Task, launch, env: dict[str, str], revision: str) -> TaskAttempt:
    """Take the run's lock and start the task's first step: the training (recorded as running first;
    launch(run) -> (command, env)) or its first evaluation (in `env`). RunDirBusy: another job runs in
    it; DoneSincePlanned: another job did that step since this invocation planned it."""
    run = task.run
    lock = run.run_dir.acquire_lock()
    done = done_since_planned(task)
    if done is not None:
        lock.release()
        raise DoneSincePlanned(done)
    if task.train:
        record = started_record(run, revision)
        run.run_dir.write_experiment(record)
        command, process_env = launch(run)
    else:
        record, command, process_env = run.run_dir.read_experiment(), run.evaluation_command(task.evaluations[0]), env
    process, offset = spawn(run, command, process_env, lock)
    evaluation = None if task.train else task.evaluations[0]
    return TaskAttempt(run, evaluation, record, process, lock, offset, time.time(), task)


def outcome(exit_code: int, preempted: Optional[bool], stopping: bool) -> str:
    """finished, failed or interrupted, from the exit code and summary.json's `preempted` (None: no summary)."""
    if exit_code == 0 and preempted is False:
        return "finished"
    if stopping or (exit_code == 0 and preempted):  # stopped by a signal: to be resumed
        return "interrupted"
    return "failed"


def finish(attempt: TaskAttempt, stopping: bool) -> str:
    """Record how the attempt ended (an interrupted training stays "running", an interrupted
    evaluation pending); returns its outcome."""
    if attempt.evaluation is not None:
        return finish_evaluation(attempt, stopping)
    run, record, code = attempt.run, attempt.record, attempt.process.returncode
    preempted = run.run_dir.read_summary().preempted if run.run_dir.summary.exists() else None
    state = outcome(code, preempted, stopping)
    if state == "finished":
        record.status, record.exit_code, record.results = "finished", 0, results_of(run.run_dir)
    elif state == "failed":
        record.status, record.exit_code, record.log_tail = "failed", code, log_tail(run.log, attempt.log_offset)
    if state != "interrupted":
        run.run_dir.write_experiment(record)
    attempt.lock.release()
    return state


def finish_evaluation(attempt: TaskAttempt, stopping: bool) -> str:
    """finished when it exited 0 and wrote its file; interrupted when the sweep stopped it (run
    again by the next invocation, nothing recorded); failed otherwise. The training's status stays."""
    run, name, code = attempt.run, attempt.evaluation, attempt.process.returncode
    written = run.run_dir.evaluation_file(name).exists()
    state = "finished" if code == 0 and written else "interrupted" if stopping else "failed"
    if state != "interrupted":
        entry = {"status": state, "exit_code": code, "seconds": round(time.time() - attempt.started, 1),
                 "log_tail": ""}
        if state == "failed":
            missing = "" if written else f"(no {run.run_dir.evaluation_file(name)} written)\n"
            entry["log_tail"] = missing + log_tail(run.log, attempt.log_offset)
        attempt.record.evaluations[name] = entry
        run.run_dir.write_experiment(attempt.record)
    attempt.lock.release()
    return state


class StopSignals:
    """SIGTERM/SIGINT: remember the signal, send SIGTERM to the running runs (they checkpoint and exit)."""

    def __init__(self, attempts: list[TaskAttempt]):
        self.attempts, self.signum = attempts, None

    def __enter__(self) -> "StopSignals":
        self.previous = {s: signal.signal(s, self._stop) for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def _stop(self, signum, frame) -> None:
        if self.signum is None:
            print(f"{signal.Signals(signum).name}: stopping; running runs checkpoint and exit", file=sys.stderr)
        self.signum = signum
        for attempt in self.attempts:
            if attempt.process.poll() is None:
                attempt.process.send_signal(signal.SIGTERM)


def run_env(jobs: int) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if jobs > 1 and "OMP_NUM_THREADS" not in env:  # N runs side by side share the cores
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // jobs))
    return env


def describe_end(attempt: TaskAttempt, state: str) -> str:
    seconds, run = time.time() - attempt.started, attempt.run
    if attempt.evaluation is not None:
        what = f"{run.experiment_id} evaluation {attempt.evaluation}"
        if state == "finished":
            return f"finished {what}: {run.run_dir.evaluation_file(attempt.evaluation)}, {seconds:.0f} s"
        if state == "failed":
            return (f"FAILED {what}: exit code {attempt.process.returncode} after {seconds:.0f} s "
                    f"(log: {run.log}); the training stays finished")
        return f"interrupted {what} after {seconds:.0f} s: the next invocation runs it again"
    if state == "finished":
        loss = attempt.record.results["final_val_loss"]
        return f"finished {run.experiment_id}: val loss {loss_text(loss)}, {seconds:.0f} s"
    if state == "failed":
        return (f"FAILED {run.experiment_id}: exit code {attempt.record.exit_code} after {seconds:.0f} s "
                f"(log: {run.log})")
    return f"interrupted {run.experiment_id} after {seconds:.0f} s: the next invocation resumes it"


def execute(tasks: list[Task], jobs: int, env: dict[str, str], launch) -> Optional[int]:
    """Do `tasks` `jobs` at a time (launch(run) -> (command, env) of a training; evaluations run in
    `env`); a task's evaluations start in its slot as its training ends. Returns the stopping signal, if any."""
    queue, active, revision = deque(tasks), [], git_revision()
    with StopSignals(active) as stop:
        while active or (queue and stop.signum is None):
            while queue and len(active) < jobs and stop.signum is None:
                task = queue.popleft()
                what = task.run.experiment_id + ("" if task.train else f" evaluation {task.evaluations[0]}")
                try:
                    attempt = start(task, launch, env, revision)
                except (RunDirBusy, DoneSincePlanned) as e:
                    print(f"skipped {what}: {e}", flush=True)
                    continue
                active.append(attempt)
                print(f"started {what} (log: {task.run.log})", flush=True)
            time.sleep(POLL_S)
            for attempt in [a for a in active if a.process.poll() is not None]:
                active.remove(attempt)
                state = finish(attempt, stopping=stop.signum is not None)
                print(describe_end(attempt, state), flush=True)
                following = attempt.task.after(state)
                if following is not None:
                    queue.appendleft(following)
    return stop.signum


def exit_status(runs: list[Run], signum: Optional[int]) -> int:
    """128 + N when signal N stopped the sweep; otherwise 0 when every run and every evaluation the
    spec lists is finished, 1 when some are not."""
    if signum is not None:
        return 128 + signum
    done = all(run_state(run) == "finished" and all(evaluation_state(run, name) == "finished"
                                                    for name in run.spec.body.evaluations) for run in runs)
    return EXIT_ALL_FINISHED if done else EXIT_NOT_ALL_FINISHED
