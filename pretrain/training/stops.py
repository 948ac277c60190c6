"""Why a run stops before its last step, decided the same on every rank: a stop signal (`Preemption`), or
the wall-time limit and the time-based save interval (`WallClock`)."""

from __future__ import annotations

import signal
import time

import torch
import torch.distributed as dist

from pretrain.job.supervision import STOP_SIGNALS, job_start_time


class Preemption:
    """The job's stop signals (a scheduler's SIGTERM, an interrupt) ask the run to checkpoint and stop at
    the end of the current step."""

    def __init__(self):
        self.requested = False
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._request)

    def _request(self, _signum, _frame) -> None:
        self.requested = True

    def agreed(self, out_of_time: bool = False, save_due: bool = False) -> tuple[bool, bool, bool]:
        """(a stop was asked of any rank, any rank is out of time, any rank's save interval in seconds has
        passed): the same on every rank (one collective)."""
        if dist.get_world_size() == 1:
            return self.requested, out_of_time, save_due
        flags = torch.tensor([float(self.requested), float(out_of_time), float(save_due)])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return bool(flags[0].item()), bool(flags[1].item()), bool(flags[2].item())


class WallClock:
    """The training time of the run over its segments (a resumed run starts from its checkpoint's), and
    when a step and a save no longer fit before supervision.max_wall_time, counted from the job's start."""

    def __init__(self, time_before: float, max_wall_time: float, save_interval_s: float):
        self.time_before, self.max_wall_time, self.save_interval_s = time_before, max_wall_time, save_interval_s
        self.job_start, self.segment_start = job_start_time(), time.time()
        self.longest_step = self.longest_save = 0.0  # what the next step and save may take
        self.last_save = time.monotonic()

    def train_time_s(self) -> float:
        return self.time_before + time.time() - self.segment_start

    def step_took(self, seconds: float) -> None:
        self.longest_step = max(self.longest_step, seconds)

    def saved(self, seconds: float) -> None:
        self.longest_save, self.last_save = max(self.longest_save, seconds), time.monotonic()

    def out_of_time(self) -> bool:
        """The next step and save would pass the wall-time limit (0: no limit)."""
        return self.max_wall_time > 0 and (
            time.time() - self.job_start + self.longest_step + self.longest_save >= self.max_wall_time)

    def save_due(self) -> bool:
        """checkpoint.save_interval_s has passed since the last save (0: saves by steps only)."""
        return self.save_interval_s > 0 and time.monotonic() - self.last_save >= self.save_interval_s
