"""Faults made on purpose, for the tests and the chaos benchmark (no real config has any): the run
config's `faults:` list, and `Faults`, the one hook the training loop calls.

Process faults happen after a step was trained, on one rank and attempt of the job: `kill` (SIGKILL),
`stop` (SIGSTOP: a hang), `crash` (an exception), `preempt` (SIGTERM to the job, as a scheduler sends
it). Loss faults act while one global batch of the data is trained: `spike` multiplies the loss (and
so the gradients) by `factor`, `nan` makes it non-finite. Batches, not steps, name where a loss fault
strikes, so a rewind that skips past them leaves them behind.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass
from typing import Literal, Optional

from ora_megatron.config_io import check
from pretrain.job.supervision import SUPERVISOR_VARIABLE

PROCESS_FAULTS = ("kill", "stop", "crash", "preempt")


@dataclass
class FaultInjection:
    """One fault made on purpose."""

    kind: Literal["kill", "stop", "crash", "preempt", "spike", "nan"] = "kill"
    """kill: SIGKILL the rank; stop: SIGSTOP it (a hang); crash: raise; preempt: SIGTERM the job;
    spike: scale the loss by `factor`; nan: make the loss non-finite."""
    step: Optional[int] = None
    """kill/stop/crash/preempt: after this (1-based) step has been trained."""
    batch: Optional[int] = None
    """spike/nan: while training on this (1-based) global batch of the data (the step, unless a rewind skipped some)."""
    rank: int = 0
    """kill/stop/crash/preempt: the rank it happens on."""
    attempt: Optional[int] = 0
    """kill/stop/crash/preempt: only in this attempt of the job (0: before any restart); null: in every attempt."""
    factor: float = 100.0
    """spike: the loss (and so the gradients) is multiplied by this."""

    @property
    def in_process(self) -> bool:
        return self.kind in PROCESS_FAULTS

    def validate(self, key: str) -> None:
        if self.in_process:
            check(self.step is not None and self.step >= 1 and self.batch is None, f"{key}.step",
                  f"a {self.kind} fault needs step >= 1 (and no batch)")
        else:
            check(self.batch is not None and self.batch >= 1 and self.step is None, f"{key}.batch",
                  f"a {self.kind} fault needs batch >= 1 (and no step)")
        check(self.rank >= 0, f"{key}.rank", "must be >= 0")


def check_faults_fit(faults: list[FaultInjection], world_size: int, pipeline: int) -> None:
    """Checks that need the process count and the pipeline size (ConfigError naming `faults`)."""
    ranks = [f.rank for f in faults if f.in_process]
    check(all(rank < world_size for rank in ranks), "faults",
          f"a fault names rank {max(ranks, default=0)}, the world size is {world_size}")
    check(pipeline == 1 or all(f.in_process for f in faults), "faults",
          "spike and nan faults are implemented for pipeline size 1 only")


class Faults:
    """The faults of one rank in one attempt of the job; the training loop asks `loss_factor` before a
    step and calls `after_step` after it."""

    def __init__(self, faults: list[FaultInjection], rank: int, attempt: int):
        self.rank, self.attempt = rank, attempt
        self.loss_faults = [f for f in faults if not f.in_process]
        self.process_faults = [f for f in faults if f.in_process and f.rank == rank and f.attempt in (None, attempt)]

    def loss_factor(self, batch: int) -> Optional[float]:
        """What this (1-based) global batch's loss is multiplied by; None: nothing happens to it."""
        factor = None
        for fault in self.loss_faults:
            if fault.batch == batch:
                factor = (factor or 1.0) * (float("nan") if fault.kind == "nan" else fault.factor)
        return factor

    def after_step(self, step: int) -> None:
        """The process faults of this rank and attempt that strike once `step` has been trained."""
        for fault in self.process_faults:
            if fault.step == step:
                print(f"injected fault: {fault.kind} on rank {self.rank} after step {step} (attempt {self.attempt})",
                      file=sys.stderr, flush=True)
                self._strike(fault.kind, step)

    @staticmethod
    def _strike(kind: str, step: int) -> None:
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif kind == "preempt":  # as a scheduler would: to the job, which passes it to every rank
            os.kill(int(os.environ.get(SUPERVISOR_VARIABLE) or os.getpid()), signal.SIGTERM)
        else:
            raise RuntimeError(f"injected crash after step {step}")
