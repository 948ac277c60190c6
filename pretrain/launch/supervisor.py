"""A job that needs no one watching: launch the ranks, restart them all after a failure, stop on request.

The process that launches a job's ranks supervises it (`Supervisor`): the training entry for its own
torchrun spawn, the launch script around DeepSpeed's launcher (one per node in NODE_RANK mode). An
attempt is one launch of every rank; it ends when the launcher returns. Then:

- It succeeded (status 0, and the run says it ended: `ended()`): the job ends with 0.
- A stop was asked of the job (SIGTERM, SIGINT or SIGUSR1 to the supervisor): the supervisor passes
  SIGTERM to its workers, which save a checkpoint at the end of their step and exit; never restarted.
- It failed: `RestartPolicy` decides. Statuses in `final` (a refusal, a stop the run decided itself)
  are never retried. Other failures are restarted, all ranks at once from the latest intact
  checkpoint, after a backoff that doubles with each failure in a row; `max_restarts` failures in a
  row without a checkpoint newer than the one the attempt resumed from (the same step failing again,
  a crash loop) stop the job. Each failure is one line of the run dir's restarts.jsonl (RestartRecord:
  how every failed rank ended, the last output lines, the hang dumps, the step resumed from, the steps
  redone, the seconds lost), written here, never by the dead ranks.

A hang watchdog's report (a stack dump in the run dir's hangs/) makes the supervisor SIGKILL the
attempt's workers at once: a rank stopped or stuck in a collective cannot run its own watchdog, and
the launchers would give it 30 s to answer a SIGTERM it cannot receive. Before each restart every
process the attempt left is killed with SIGKILL (which also ends stopped ones) and reaped, so no old
rank writes the run dir beside the new ones. Workers are the supervisor's descendants whose environment
has LOCAL_RANK (both launchers set it for their workers, not for themselves; ranks that DeepSpeed's
SLURM or OpenMPI backend starts through srun or mpirun get theirs later, so only the launcher reaches
them).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import datetime
import os
import platform
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

from pretrain.job.exit_status import FINAL, STATUS_NAMES
from pretrain.job.supervision import (
    ATTEMPT_VARIABLE,
    JOB_START_VARIABLE,
    STOP_SIGNALS,
    SUPERVISOR_VARIABLE,
    SupervisionConfig,
)
from pretrain.run_files.run_dir import RunDir, step_of_tag
from pretrain.run_files.run_records import RestartRecord

TAIL_LINES = 30
MAX_BACKOFF_S = 300.0
PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>


class StopJob(Exception):
    """The job cannot be restarted (its resume check refused, or the run has ended); carries the exit status."""

    def __init__(self, exit_code: int, message: str):
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class Attempt:
    """How one launch of every rank ended."""

    exit_code: int  # the launcher's status
    ranks: dict[int, int] = field(default_factory=dict)  # failed rank -> status (negative: the signal that ended it)
    stop_requested: bool = False  # the launcher itself stopped on a stop signal


def describe_status(code: int, names: dict[int, str]) -> str:
    """"exit 4 (hung)", "SIGKILL", ... for a process status (negative: the signal that ended it)."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return signal.Signals(-code).name
        return f"signal {-code}"
    name = names.get(code)
    return f"exit {code}" + (f" ({name})" if name else "")


class RestartPolicy:
    """Whether a failed attempt is restarted, and after how long.

    `final`: statuses that are never retried (status -> what it means). Any other failure restarts
    the job unless it is the (max_restarts + 1)-th failure in a row without progress, progress being a
    checkpoint newer than the one the failed attempt started from.
    """

    def __init__(self, max_restarts: int, backoff_s: float, final: dict[int, str]):
        self.max_restarts, self.backoff_s, self.final = max_restarts, backoff_s, final
        self.streak = 0  # failures in a row, the last of them included, without progress before them

    def decide(self, exit_code: int, progressed: bool) -> Optional[str]:
        """None to restart; else why the job stops."""
        if exit_code in self.final:
            return f"{describe_status(exit_code, self.final)} is never retried"
        self.streak = 1 if progressed else self.streak + 1
        if self.streak > self.max_restarts:
            if self.max_restarts == 0:
                return "supervision.max_restarts is 0"
            return (f"{self.streak} failures in a row without a newer checkpoint "
                    f"(supervision.max_restarts={self.max_restarts}): the same step fails again")
        return None

    def backoff(self) -> float:
        """Seconds before the restart just decided: backoff_s, doubled for each earlier failure in the streak."""
        return min(self.backoff_s * 2 ** max(self.streak - 1, 0), MAX_BACKOFF_S)


# ---------------------------------------------------------------------- processes
def _stat_fields(pid: int) -> Optional[list[str]]:
    """/proc/PID/stat after the command name: state, ppid, ... (None when gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def descendants(root: int) -> list[int]:
    """Every live process under `root` (zombies left out), parents before their children."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None and fields[0] != "Z":
                children[int(fields[1])].append(int(entry.name))
    found, queue = [], list(children.get(root, []))
    while queue:
        pid = queue.pop(0)
        found.append(pid)
        queue.extend(children.get(pid, []))
    return found


def _environ_names(pid: int) -> set[str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return {item.split(b"=", 1)[0].decode(errors="replace") for item in f.read().split(b"\0") if item}
    except OSError:
        return set()


def workers(root: int) -> list[int]:
    """The training ranks under `root`: descendants that a launcher gave LOCAL_RANK, not their own children."""
    found: list[int] = []
    for pid in descendants(root):
        fields = _stat_fields(pid)
        if fields is not None and "LOCAL_RANK" in _environ_names(pid) and int(fields[1]) not in found:
            found.append(pid)
    return found


def signal_processes(pids: list[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)


def become_subreaper() -> None:
    """Processes orphaned under this one (workers whose launcher died) become its children, so that
    the supervisor still finds, kills and reaps them (Linux; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1)


def reap_children() -> None:
    """Collect the exit status of every child already gone (orphans reparented here included)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def kill_all_under(root: int, timeout: float = 30.0) -> None:
    """SIGKILL every process under `root` (stopped ones end too) and wait until none is left."""
    deadline = time.monotonic() + timeout
    while True:
        left = descendants(root)
        if not left or time.monotonic() > deadline:
            break
        signal_processes(left, signal.SIGKILL)
        time.sleep(0.05)
        reap_children()
    reap_children()


# ---------------------------------------------------------------------- output
class OutputTail:
    """While active, this process's stdout and stderr (and so those of the processes it starts, which
    inherit them) pass through pipes: copied unchanged to where they went before, the last lines kept
    (a progress bar's carriage-return updates count as one line, its latest state)."""

    def __init__(self, lines: int = TAIL_LINES):
        self._lines: collections.deque[str] = collections.deque(maxlen=lines)
        self._lock = threading.Lock()
        self._saved: dict[int, int] = {}
        self._threads: list[threading.Thread] = []

    def lines(self) -> list[str]:
        with self._lock:
            return list(self._lines)

    def __enter__(self) -> "OutputTail":
        sys.stdout.flush()
        sys.stderr.flush()
        for fd in (1, 2):
            read_end, write_end = os.pipe()
            self._saved[fd] = os.dup(fd)
            os.dup2(write_end, fd)
            os.close(write_end)
            thread = threading.Thread(target=self._copy, args=(read_end, self._saved[fd]), daemon=True,
                                      name=f"output-tail-{fd}")
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *exc) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, saved in self._saved.items():
            os.dup2(saved, fd)  # closes this process's write end of the pipe: its reader sees the end
        for thread in self._threads:
            thread.join(timeout=5)  # a process that still holds the pipe would keep it open
        for saved in self._saved.values():
            os.close(saved)

    def _copy(self, read_end: int, target: int) -> None:
        pending = b""
        with os.fdopen(read_end, "rb", buffering=0) as source:
            while chunk := source.read(65536):
                with contextlib.suppress(OSError):
                    os.write(target, chunk)
                pending = self._keep(pending + chunk)
        self._keep(pending + b"\n")

    def _keep(self, data: bytes) -> bytes:
        *complete, rest = data.split(b"\n")
        if complete:
            with self._lock:
                for line in complete:
                    text = line.decode(errors="replace").rsplit("\r", 1)[-1].rstrip()
                    if text.strip():
                        self._lines.append(text)
        return rest[-65536:]


# ---------------------------------------------------------------------- the supervisor
class Supervisor:
    """Runs `launch(attempt)` until the job ends (see the module docstring).

    launch: one attempt; its workers inherit this process's environment (ATTEMPT_VARIABLE,
        JOB_START_VARIABLE, SUPERVISOR_VARIABLE are set for them).
    ended: whether the run says it has ended (finished, stopped early or stopped on request).
    prepare_restart: before a restart, settles the checkpoint to resume from and returns its tag (None:
        none yet), or raises StopJob.
    status_names: what statuses mean, for the records ("hung", "refused", ...).
    """

    def __init__(self, run_dir: RunDir, policy: RestartPolicy, launch: Callable[[int], Attempt],
                 ended: Callable[[], bool], prepare_restart: Optional[Callable[[], Optional[str]]] = None,
                 status_names: Optional[dict[int, str]] = None, node_rank: Optional[int] = None,
                 hang_grace_s: float = 1.0):
        self.run_dir, self.policy, self.launch, self.ended = run_dir, policy, launch, ended
        self.prepare_restart = prepare_restart or (lambda: run_dir.latest_checkpoint())
        self.status_names = status_names or {}
        self.node_rank, self.hang_grace_s = node_rank, hang_grace_s
        self.stop_signal: Optional[int] = None
        self._interrupts = 0

    # ------------------------------------------------------------------ signals
    def _on_stop_signal(self, signum, _frame) -> None:
        """Ask the workers to save and stop (SIGTERM); a second SIGINT kills them."""
        self.stop_signal = signum
        if signum == signal.SIGINT:
            self._interrupts += 1
        pids = workers(os.getpid())
        if self._interrupts > 1:
            print("second interrupt: killing the job's processes", file=sys.stderr, flush=True)
            signal_processes(descendants(os.getpid()), signal.SIGKILL)
        elif pids:
            signal_processes(pids, signal.SIGTERM)

    def _install_handlers(self) -> None:
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._on_stop_signal)

    # ------------------------------------------------------------------ the loop
    def run(self) -> int:
        os.environ.setdefault(JOB_START_VARIABLE, repr(time.time()))
        os.environ[SUPERVISOR_VARIABLE] = str(os.getpid())
        self._install_handlers()
        attempt = 0
        while self.stop_signal is None:
            resumed = self._latest_step()
            os.environ[ATTEMPT_VARIABLE] = str(attempt)
            started = time.time()
            with OutputTail() as tail, self._hang_watch(started):
                result = self.launch(attempt)
                stopped = result.stop_requested or self.stop_signal is not None
                succeeded = result.exit_code == 0 and self.ended()
                if not (stopped or succeeded):  # nothing of the failed attempt may live on beside the next
                    kill_all_under(os.getpid())
            self._install_handlers()  # an in-process launcher (torchrun) may have replaced them
            if stopped:
                return 0 if result.exit_code == 0 or self.ended() else result.exit_code
            if succeeded:
                return 0
            # A rank's own decision (a refusal, a stop the run chose) is the job's, whatever the launcher says.
            chosen = [status for status in result.ranks.values() if status in self.policy.final]
            code = chosen[0] if chosen else result.exit_code or 1  # 0: the run did not end, so it failed
            why_not = self.policy.decide(code, progressed=self._latest_step() != resumed)
            record = self._record(attempt, started, result, tail.lines())
            if why_not is None:
                try:
                    tag = self.prepare_restart()
                except StopJob as e:
                    why_not, code = str(e), e.exit_code
                else:
                    record.resumed_from_step = step_of_tag(tag) if tag else 0
                    record.steps_redone = (None if record.failed_at_step is None
                                           else max(record.failed_at_step - record.resumed_from_step, 0))
                    record.backoff_s = self.policy.backoff()
                    record.seconds_lost = round(time.time() + record.backoff_s - self._saved_at(tag, started), 3)
            if why_not is not None:
                record.action = "stop"
                self.run_dir.log_restart(record)
                self._report_stop(why_not, code)
                return code
            self.run_dir.log_restart(record)
            print(f"restart {attempt + 1} in {record.backoff_s:g} s: {record.cause}; resuming from step "
                  f"{record.resumed_from_step} (restarts.jsonl in {self.run_dir.path})", file=sys.stderr, flush=True)
            if self._sleep(record.backoff_s):
                return code
            attempt += 1
        return 0  # a stop was asked before anything was launched

    def _sleep(self, seconds: float) -> bool:
        """Wait; True when a stop was asked meanwhile."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and self.stop_signal is None:
            time.sleep(min(0.1, max(deadline - time.monotonic(), 0)))
        return self.stop_signal is not None

    # ------------------------------------------------------------------ hangs
    @contextlib.contextmanager
    def _hang_watch(self, since: float) -> Iterator[None]:
        """While an attempt runs: once a hang dump newer than `since` appears, SIGKILL its workers."""
        done = threading.Event()

        def watch() -> None:
            while not done.wait(0.5):
                if self._dumps_since(since):
                    if done.wait(self.hang_grace_s):  # the reporting rank exits with its own status meanwhile
                        return
                    print("a rank reported a hang: stopping the job's ranks", file=sys.stderr, flush=True)
                    signal_processes(workers(os.getpid()), signal.SIGKILL)
                    return

        thread = threading.Thread(target=watch, daemon=True, name="hang-watch")
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    def _dumps_since(self, since: float) -> list[Path]:
        found = []
        for path in self.run_dir.hang_dumps():
            with contextlib.suppress(OSError):
                if path.stat().st_mtime >= since - 1:
                    found.append(path)
        return found

    # ------------------------------------------------------------------ records
    def _latest_step(self) -> Optional[int]:
        tag = self.run_dir.latest_checkpoint()
        try:
            return step_of_tag(tag) if tag else None
        except ValueError:
            return None

    def _saved_at(self, tag: Optional[str], started: float) -> float:
        """When the checkpoint `tag` was completed (its integrity record), or the attempt's start without one."""
        if tag:
            with contextlib.suppress(OSError):
                return self.run_dir.integrity_record_file(tag).stat().st_mtime
        return started

    def _last_logged_step(self) -> Optional[int]:
        try:
            steps = [r.step for r in self.run_dir.read_records("train")]
        except (OSError, ValueError):
            return None
        return max(steps) if steps else None

    def _record(self, attempt: int, started: float, result: Attempt, tail: list[str]) -> RestartRecord:
        ranks = {str(rank): describe_status(code, self.status_names) for rank, code in sorted(result.ranks.items())}
        dumps = self._dumps_since(started)
        if ranks:
            cause = ", ".join(f"rank {rank}: {how}" for rank, how in ranks.items())
        else:
            cause = f"launcher {describe_status(result.exit_code, self.status_names)}"
            if result.exit_code == 0:
                cause += " although the run did not end"
        if dumps:
            cause += f"; hang reported in {', '.join(p.name for p in dumps)}"
        return RestartRecord(
            time=datetime.datetime.now().astimezone().isoformat(timespec="seconds"), action="restart",
            host=platform.node(), node_rank=self.node_rank, attempt=attempt, exit_code=result.exit_code, ranks=ranks,
            cause=cause, hang_dumps=[p.name for p in dumps], log_tail=tail, failed_at_step=self._last_logged_step(),
            resumed_from_step=None, steps_redone=None, seconds_lost=round(time.time() - started, 3), backoff_s=0.0)

    def _report_stop(self, why: str, code: int) -> None:
        mine = [r for r in self.run_dir.read_restarts() if r.node_rank == self.node_rank]
        failures = mine[-max(self.policy.streak, 1):]  # the streak that ends the job
        lead = "error: the job stops" if code else "the job ends"
        lines = [f"{lead}: {why}. Its failures (restarts.jsonl in {self.run_dir.path}):"]
        lines += [f"  attempt {r.attempt} at step {r.failed_at_step}: {r.cause}" for r in failures]
        print("\n".join(lines), file=sys.stderr, flush=True)


def run_ended(run_dir: RunDir) -> bool:
    """Whether the run's workers ended it deliberately: its summary is that of its latest checkpoint
    (finished, stopped early or on request, at supervision.max_wall_time, or nothing left to train)."""
    tag = run_dir.latest_checkpoint()
    if tag is None or not run_dir.summary.exists():
        return False
    try:
        return run_dir.read_summary().steps == step_of_tag(tag)
    except (OSError, ValueError, TypeError):
        return False


def supervise(run_dir: RunDir, config: SupervisionConfig, launch: Callable[[int], Attempt],
              prepare_restart: Optional[Callable[[], Optional[str]]] = None, node_rank: Optional[int] = None) -> int:
    """Run the job's attempts under a Supervisor until it ends (the entry's torchrun spawn and the launch
    script around DeepSpeed's launcher both supervise through here); the job's exit status."""
    become_subreaper()
    policy = RestartPolicy(config.max_restarts, config.restart_backoff_s, FINAL)
    supervisor = Supervisor(run_dir, policy, launch, ended=lambda: run_ended(run_dir), prepare_restart=prepare_restart,
                            status_names=STATUS_NAMES, node_rank=node_rank)
    return supervisor.run()
