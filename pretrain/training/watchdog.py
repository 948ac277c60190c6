"""A rank's hang watchdog: no finished step for `timeout_s` writes every thread's stack to the run dir
and ends the process with its own status, so that the job's supervisor restarts the job.

The loop `beat()`s after every step. The clock starts at the first beat of a segment, so start-up
(imports, rendezvous, building the engine, loading a checkpoint, the first step's compilation) never
counts; evaluation, checkpoint saves and loads and engine rebuilds run `paused()`. A hang there is
left to the collective timeout (supervision.collective_timeout_s, above the watchdog's by validation). The
watchdog is a Python thread: a rank blocked in a collective (a stopped or dead peer) releases the
interpreter lock there, so the thread runs; the stopped peer itself cannot, and the supervisor kills it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import platform
import sys
import threading
import time
from typing import Callable, Iterator, Optional

from pretrain.run_files.run_dir import RunDir


class Watchdog:
    def __init__(self, run_dir: RunDir, rank: int, timeout_s: float, exit_code: int,
                 exit: Callable[[int], None] = os._exit):
        self.run_dir, self.rank, self.timeout_s, self.exit_code, self._exit = run_dir, rank, timeout_s, exit_code, exit
        self.step = 0
        self.fired: Optional[str] = None  # the dump's path, once it fired
        self._last: Optional[float] = None  # monotonic time of the last beat; None until the first
        self._paused = 0
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="hang-watchdog")
        self._thread.start()

    def beat(self, step: int) -> None:
        """A step has finished."""
        with self._lock:
            self.step, self._last = step, time.monotonic()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time inside does not count; the clock restarts when it ends."""
        with self._lock:
            self._paused += 1
        try:
            yield
        finally:
            with self._lock:
                self._paused -= 1
                if self._last is not None:
                    self._last = time.monotonic()

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def _watch(self) -> None:
        period = min(max(self.timeout_s / 20, 0.05), 1.0)
        while not self._done.wait(period):
            with self._lock:
                late = (self._last is not None and not self._paused
                        and time.monotonic() - self._last > self.timeout_s)
                waited = 0.0 if self._last is None else time.monotonic() - self._last
            if late:
                self._fire(waited)
                return

    def _fire(self, waited: float) -> None:
        path = self.run_dir.hang_dump_file(self.rank, self.step)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            f.write(f"rank {self.rank} (pid {os.getpid()} on {platform.node()}) finished no step for {waited:.1f} s "
                    f"after step {self.step} (supervision.hang_timeout_s={self.timeout_s:g}); "
                    "every thread's stack:\n\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
            f.flush()
            os.fsync(f.fileno())
        self.fired = str(path)
        print(f"error: rank {self.rank} hung: no step finished for {waited:.0f} s after step {self.step}; "
              f"stacks in {path}; exiting with status {self.exit_code}", file=sys.stderr, flush=True)
        self._exit(self.exit_code)
