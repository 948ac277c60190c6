"""What a rank knows of its supervised job: which attempt it belongs to, when the job started, the job's
restarts so far, the signals that stop it, and the `supervision:` section (restarts, the hang watchdog,
collective timeouts, the wall-time limit), which the ranks and the supervisor both read.

The supervisor (pretrain/launch/supervisor.py) sets the variables below for the workers of every
attempt; a rank reads them here and never imports the supervisor.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from dataclasses import dataclass

from ora_megatron.config_io import check
from pretrain.run_files.run_dir import RunDir
from pretrain.run_files.run_records import RestartRecord

# Set for the workers of every attempt.
ATTEMPT_VARIABLE = "ORA_ATTEMPT"  # 0 for the job's first launch, 1 after the first restart, ...
JOB_START_VARIABLE = "ORA_JOB_START"  # when the job started, seconds since the epoch (supervision.max_wall_time)
LAUNCHER_VARIABLE = "ORA_LAUNCHER_PID"  # the process that started this worker, where it says so (die_with_launcher)
SUPERVISOR_VARIABLE = "ORA_SUPERVISOR_PID"  # the process a preemption goes to (fault injection)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@dataclass
class SupervisionConfig:
    """An unattended job: restarts of failed ranks, the hang watchdog, collective timeouts, a wall-time limit."""

    max_restarts: int = 0
    """Restarts of a failed job (a dead, killed or hung rank): all ranks start again from the latest intact
    checkpoint. Counted over failures in a row without a newer checkpoint; statuses 2, 3 and 75 are never
    retried. 0: a failure ends the job."""
    restart_backoff_s: float = 10.0
    """Seconds before a restart, doubled for each further failure in a row without a newer checkpoint."""
    hang_timeout_s: float = 0.0
    """A rank that finishes no step for this long (evaluation, checkpoints and start-up not counted) writes
    every thread's stack to the run dir's hangs/ and exits with status 4. 0: no watchdog; else below
    collective_timeout_s."""
    collective_timeout_s: int = 600
    """A collective that waits longer than this (seconds) fails, so ranks exit when a peer has died."""
    max_wall_time: float = 0.0
    """Seconds from the job's start: the run saves a checkpoint and stops (status 75) before its next step
    and save would pass it. 0: no limit."""

    def validate(self, key: str) -> None:
        check(self.collective_timeout_s > 0, f"{key}.collective_timeout_s", "must be > 0")
        check(self.max_restarts >= 0, f"{key}.max_restarts", "must be >= 0")
        for name in ("restart_backoff_s", "hang_timeout_s", "max_wall_time"):
            check(getattr(self, name) >= 0, f"{key}.{name}", "must be >= 0")
        # The watchdog, which writes the stacks, must fire before a collective with a hung peer times out.
        check(self.hang_timeout_s < self.collective_timeout_s, f"{key}.hang_timeout_s",
              f"{self.hang_timeout_s:g} must be below collective_timeout_s ({self.collective_timeout_s}), so that "
              "the watchdog (which writes every thread's stack) fires before a collective times out")


_PROCESS_START = time.monotonic()


def job_start_time() -> float:
    """In a worker: when its job started (its supervisor's start), else when this process did."""
    value = os.environ.get(JOB_START_VARIABLE)
    return float(value) if value else time.time() - time.monotonic() + _PROCESS_START


def attempt_number() -> int:
    """In a worker: which launch of the job it belongs to: 0 for the first, 1 after the first restart."""
    return int(os.environ.get(ATTEMPT_VARIABLE) or os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)


def job_restarts(run_dir: RunDir) -> list[RestartRecord]:
    """The restarts of the run's jobs, as the only supervisor, or node 0's, recorded them (one per failure)."""
    return [r for r in run_dir.read_restarts() if r.action == "restart" and r.node_rank in (None, 0)]


def die_with_launcher() -> None:
    """In a worker: have the kernel SIGKILL this process when its launcher dies.

    torchrun starts workers in their own sessions, so a launcher killed hard (the OOM killer, a
    `kill -9`) would leave them training beside whatever job replaces it, both writing the run dir.
    PR_SET_PDEATHSIG fires when the thread that started us exits: torch elastic's agent and
    DeepSpeed's launch.py start workers from their main thread, which lives until the workers end.
    A launcher that stops its workers itself (SIGTERM, a failed rank) still does so first.

    A launcher that died earlier, while this worker was still importing, is caught where it named
    itself (LAUNCHER_VARIABLE: the entry's own spawn, whose torchrun agent runs in its process).
    """
    if not sys.platform.startswith("linux"):
        return
    parent = int(os.environ.get(LAUNCHER_VARIABLE, os.getppid()))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the launcher died before the setting took
        os.kill(os.getpid(), signal.SIGKILL)
