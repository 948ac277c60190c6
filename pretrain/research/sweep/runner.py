"""Running the planned runs: each run's process gets the run dir's lock (held to the run's end,
whatever happens to the sweep); SIGTERM/SIGINT stop the sweep and make the running runs checkpoint."""

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

from pretrain.research.sweep.spec import Run, SweepError
from pretrain.research.sweep.state import git_revision, log_tail, loss_text, results_of, run_state, started_record
from pretrain.run_dir import LOCK_ON_STDIN, ExperimentRecord, RunDirBusy, RunDirLock

POLL_S = 0.2

EXIT_ALL_FINISHED, EXIT_NOT_ALL_FINISHED = 0, 1


@dataclass
class Attempt:
    """One start of a run: its process, the lock it holds, where its part of sweep.log begins."""

    run: Run
    record: ExperimentRecord
    process: subprocess.Popen
    lock: RunDirLock
    log_offset: int
    started: float


def start(run: Run, command: list[str], env: dict[str, str], revision: str) -> Attempt:
    """Take the run's lock, record it as running and start its process (RunDirBusy: another job runs it)."""
    lock = run.run_dir.acquire_lock()
    record = started_record(run, revision)
    run.run_dir.write_experiment(record)
    with open(run.log, "a") as log:
        log.write(f"== {datetime.datetime.now().isoformat(timespec='seconds')} sweep starts: {shlex.join(command)}\n")
        log.flush()
        offset = log.tell()
        # The lock goes to the run's process too: it stays held while the run lives, whatever
        # happens to this sweep, so no other job starts in the run dir meanwhile.
        try:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=lock.fd,
                                       env={**env, LOCK_ON_STDIN: "1"})
        except OSError as e:  # e.g. no launch script on this checkout; the record says "running": retried
            lock.release()
            raise SweepError(f"cannot start {run.experiment_id}: {e}") from None
    lock.record_holder(process.pid, shlex.join(command))
    return Attempt(run, record, process, lock, offset, time.time())


def outcome(exit_code: int, preempted: Optional[bool], stopping: bool) -> str:
    """finished, failed or interrupted, from the exit code and summary.json's `preempted` (None: no summary)."""
    if exit_code == 0 and preempted is False:
        return "finished"
    if stopping or (exit_code == 0 and preempted):  # stopped by a signal: to be resumed
        return "interrupted"
    return "failed"


def finish(attempt: Attempt, stopping: bool) -> str:
    """Record how the attempt ended (an interrupted run stays "running"); returns its outcome."""
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


class StopSignals:
    """SIGTERM/SIGINT: remember the signal, send SIGTERM to the running runs (they checkpoint and exit)."""

    def __init__(self, attempts: list[Attempt]):
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


def describe_end(attempt: Attempt, state: str) -> str:
    seconds = time.time() - attempt.started
    if state == "finished":
        loss = attempt.record.results["final_val_loss"]
        return f"finished {attempt.run.experiment_id}: val loss {loss_text(loss)}, {seconds:.0f} s"
    if state == "failed":
        return (f"FAILED {attempt.run.experiment_id}: exit code {attempt.record.exit_code} after {seconds:.0f} s "
                f"(log: {attempt.run.log})")
    return f"interrupted {attempt.run.experiment_id} after {seconds:.0f} s: the next invocation resumes it"


def execute(runs: list[Run], jobs: int, launch) -> Optional[int]:
    """Start `runs` `jobs` at a time (launch(run) -> (command, env)); returns the stopping signal, if any."""
    queue, active, revision = deque(runs), [], git_revision()
    with StopSignals(active) as stop:
        while active or (queue and stop.signum is None):
            while queue and len(active) < jobs and stop.signum is None:
                run = queue.popleft()
                try:
                    attempt = start(run, *launch(run), revision)
                except RunDirBusy as e:
                    print(f"skipped {run.experiment_id}: {e}", flush=True)
                    continue
                active.append(attempt)
                print(f"started {run.experiment_id} (log: {run.log})", flush=True)
            time.sleep(POLL_S)
            for attempt in [a for a in active if a.process.poll() is not None]:
                active.remove(attempt)
                print(describe_end(attempt, finish(attempt, stopping=stop.signum is not None)), flush=True)
    return stop.signum


def exit_status(runs: list[Run], signum: Optional[int]) -> int:
    """128 + N when signal N stopped the sweep; otherwise 0 when every run is finished, 1 when some are not."""
    if signum is not None:
        return 128 + signum
    return EXIT_ALL_FINISHED if all(run_state(run) == "finished" for run in runs) else EXIT_NOT_ALL_FINISHED
