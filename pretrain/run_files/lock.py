"""A run dir's lock (pretrain/run_files/run_dir.py says how a job takes, hands down and waits for it):
the held descriptor, and who holds it, read from /proc (Linux): the processes whose descriptor tables
have the locked open file, by pid and command line. flock cannot be queried; /proc/PID/fdinfo lists a
flock on the descriptors of the open file that holds it, and only there."""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import platform
import shlex
import weakref
from pathlib import Path
from typing import NamedTuple

LOCK_ON_STDIN = "ORA_RUN_DIR_LOCK_ON_STDIN"  # "1": this process's stdin is its run dir's lock


class RunDirBusy(Exception):
    """Another job holds the run dir's lock; the message names it."""


_LOCKS_HELD = weakref.WeakSet()  # every RunDirLock of this process, closed in its forked children


def _close_locks_in_forked_child() -> None:
    for lock in list(_LOCKS_HELD):
        lock.release()


os.register_at_fork(after_in_child=_close_locks_in_forked_child)


class RunDirLock:
    """A held run-dir lock: an open descriptor of run.lock with an exclusive flock on it.

    Closing the descriptor (or dropping the object) is the only release: flock(LOCK_UN) would
    also unlock it for the processes the lock was handed to, which share the open file description.
    The descriptor is close-on-exec, and a forked child closes it at once (os.register_at_fork):
    only a handing down (as_stdin) gives the lock to another process.
    """

    def __init__(self, fd: int):
        self.fd = fd
        _LOCKS_HELD.add(self)

    def __del__(self):
        self.release()

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def record_holder(self, pid: int, command: str) -> None:
        """Write who runs the job into the lock file, for the message that refuses a second one."""
        holder = {"pid": pid, "host": platform.node(), "command": command,
                  "start_time": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, (json.dumps(holder) + "\n").encode(), 0)

    @contextlib.contextmanager
    def as_stdin(self):
        """Hand the lock to the processes started meanwhile (torchrun's workers, started in this
        process): this process's stdin is the lock, and LOCK_ON_STDIN is set, until the block ends."""
        saved = os.dup(0)
        previous = os.environ.get(LOCK_ON_STDIN)
        os.dup2(self.fd, 0)
        os.environ[LOCK_ON_STDIN] = "1"
        try:
            yield
        finally:
            os.dup2(saved, 0)
            os.close(saved)
            if previous is None:
                del os.environ[LOCK_ON_STDIN]
            else:
                os.environ[LOCK_ON_STDIN] = previous


def try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


class LockHolder(NamedTuple):
    """A process of this host that holds a flock."""

    pid: int
    command: str  # its command line; [name] once its memory is gone (its threads exiting)

    def __str__(self) -> str:
        return f"pid {self.pid}: {self.command}"


def _process_state(proc: Path) -> str:
    """The state letter of /proc/PID/stat (R, S, D, Z, ...); "" when it cannot be read."""
    try:
        return proc.joinpath("stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def process_ended(pid: int) -> bool:
    """Gone, or a zombie waiting to be reaped (its descriptors closed). False where no /proc tells."""
    if not Path("/proc/self").is_dir():
        return False
    return _process_state(Path(f"/proc/{pid}")) in ("", "Z")


def _holds_flock(table: Path, path: Path, lock: os.stat_result) -> bool:
    """Whether the descriptor table of /proc/PID (or /proc/PID/task/TID) has the file `path` open with
    the exclusive flock on it: fdinfo lists a flock only on the descriptors of the locked open file."""
    try:
        descriptors = list(table.joinpath("fd").iterdir())
    except OSError:  # gone, or another user's
        return False
    for fd in descriptors:
        try:
            if path.name in os.readlink(fd) and os.path.samestat(os.stat(fd), lock):
                info = table.joinpath("fdinfo", fd.name).read_text().splitlines()
                if any(line.startswith("lock:") and "FLOCK" in line and "WRITE" in line for line in info):
                    return True
        except OSError:
            continue
    return False


def flock_holders(path: Path) -> list[LockHolder]:
    """Every process of this host that this user can read and that holds the exclusive flock on
    `path`, by pid (Linux; empty elsewhere). A process whose main thread has exited holds it through
    its other threads while they exit: their descriptor tables are read then."""
    try:
        lock = os.stat(path)
    except OSError:
        return []
    holders = []
    for proc in sorted(Path("/proc").glob("[0-9]*"), key=lambda p: int(p.name)):
        exiting = _process_state(proc) == "Z"
        tables = sorted(proc.glob("task/*")) if exiting else [proc]
        if not any(_holds_flock(table, path, lock) for table in tables):
            continue
        try:
            command = shlex.join(proc.joinpath("cmdline").read_bytes().decode(errors="replace").split("\0")[:-1])
            command = command or f"[{proc.joinpath('comm').read_text().strip()}]"
        except OSError:
            command = "[gone]"
        holders.append(LockHolder(int(proc.name), command + (" (exiting)" if exiting else "")))
    return holders
