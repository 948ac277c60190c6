"""The processes of a training job as /proc shows them: its workers, whether they live, and a kill
as the OOM killer or a machine failure would deliver it."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from pretrain_runs import records


def wait_for_step(run_dir, step: int, proc, timeout: float = 240.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if any(r.step >= step for r in records(run_dir)):
            return
        assert proc.poll() is None, "run ended before it could be interrupted"
        time.sleep(0.02)
    raise TimeoutError(f"step {step} not reached")


def workers_of(proc) -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _parent(int(p.name)) == proc.pid]


def kill_job(proc) -> None:
    """SIGKILL the launcher, as the OOM killer or a machine failure would. Its workers, which torchrun
    starts in their own sessions, must die with it (pretrain_ora.die_with_launcher) rather than
    train on beside the job that resumes the run."""
    workers = workers_of(proc)
    assert workers, "no workers to kill"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 10  # the kernel signals them as the launcher exits
    while any(_alive(pid) for pid in workers) and time.time() < deadline:
        time.sleep(0.05)
    survivors = [pid for pid in workers if _alive(pid)]
    for pid in survivors:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not survivors, "workers outlived their SIGKILLed launcher"


def _alive(pid: int) -> bool:
    """Running, not gone or a zombie waiting to be reaped."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _parent(pid: int) -> int:
    try:
        return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1
