"""Who holds a flock(2) lock, read from /proc (Linux): the processes whose descriptor tables have the
locked open file, by pid and command line. flock cannot be queried; /proc/PID/fdinfo lists a flock on
the descriptors of the open file that holds it, and only there."""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import NamedTuple


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
