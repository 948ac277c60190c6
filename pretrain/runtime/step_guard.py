"""Skip-step: an update whose loss or gradient norm spikes is not applied.

The rule is OLMo-core's SkipStepOptimizer's: once the window of the last `window` steps holds at least
half of them, a step whose loss or gradient norm exceeds the window's mean + sigma × its standard
deviation (sample std, the window before this step) is skipped. Every finite value enters the window,
a skipped spike's too, so that a lasting change of level (an LR restart) is learned within a few steps
instead of being skipped forever; non-finite values are DeepSpeed's to skip and never enter it.

The decision is taken inside the torch optimizer's `step()`: DeepSpeed calls it once it has computed
the step's global gradient norm (before clipping) and clipped, and calls it not at all for a step it
skips itself (non-finite gradients; under ZeRO-1/2 in bf16 it calls it, and the non-finite norm skips
the step below the guard: ds_internals.skip_nonfinite_steps_by_norm). Every rank decides from the
same numbers (the data-parallel mean of the loss, all-reduced before the step, and DeepSpeed's
all-reduced norm), so every rank decides the same. Skipping the torch step leaves weights and Adam
state (its step count too) untouched; DeepSpeed then clears the gradients as after any step. The window
is part of the checkpoint's train state, so a resumed run decides exactly as an uninterrupted one.

Its settings are the run config's `stability.spike_skip` (pretrain/config/stability.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch


@dataclass(frozen=True)
class Spike:
    """Why a step was skipped: which value, how large, above which bound."""

    reason: str  # "loss spike" | "grad-norm spike"
    value: float
    bound: float  # mean + sigma × std of the window


def _bound(values: list[float], sigma: float) -> float:
    mean = math.fsum(values) / len(values)
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1))
    return mean + sigma * std


class SpikeWindow:
    def __init__(self, window: int, sigma: float, state: Optional[dict] = None):
        self.window, self.sigma = window, sigma
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        if state:
            self.load_state_dict(state)

    @property
    def ready(self) -> bool:
        return len(self.losses) >= max(2, self.window // 2)

    def check(self, loss: float, grad_norm: Optional[float]) -> Optional[Spike]:
        """The spike that makes this step skipped, or None; then both values join the window."""
        spike = None
        if self.ready:
            bound = _bound(self.losses, self.sigma)
            if loss > bound:
                spike = Spike("loss spike", loss, bound)
        if spike is None and grad_norm is not None and len(self.grad_norms) >= max(2, self.window // 2):
            bound = _bound(self.grad_norms, self.sigma)
            if grad_norm > bound:
                spike = Spike("grad-norm spike", grad_norm, bound)
        self.losses = (self.losses + [loss])[-self.window:]
        if grad_norm is not None:
            self.grad_norms = (self.grad_norms + [grad_norm])[-self.window:]
        return spike

    def state_dict(self) -> dict:
        return {"losses": list(self.losses), "grad_norms": list(self.grad_norms)}

    def load_state_dict(self, state: dict) -> None:
        self.losses = [float(v) for v in state.get("losses", [])][-self.window:]
        self.grad_norms = [float(v) for v in state.get("grad_norms", [])][-self.window:]


class StepGuard:
    """Between the training loop and the torch optimizer: the loop `arm`s it with the step's loss before
    DeepSpeed's step, the optimizer asks `skip()` (once per parameter group under ZeRO: the first call
    decides for the step), and the loop `take`s the decision afterwards."""

    def __init__(self, window: SpikeWindow, grad_norm: Callable[[], Optional[float]]):
        self.window, self.grad_norm = window, grad_norm
        self._loss: Optional[float] = None
        self._decided = False
        self._spike: Optional[Spike] = None
        self.norm: Optional[float] = None  # the gradient norm the last decision read

    def arm(self, loss: float) -> None:
        self._loss, self._decided, self._spike, self.norm = loss, False, None, None

    def skip(self) -> bool:
        if self._loss is None:
            return False
        if not self._decided:
            self._decided = True
            norm = self.grad_norm()
            norm = self.norm = None if norm is None else float(norm)
            if math.isfinite(self._loss) and (norm is None or math.isfinite(norm)):
                self._spike = self.window.check(self._loss, norm)
        return self._spike is not None

    def take(self) -> Optional[Spike]:
        """The step's spike (None: applied, or skipped by DeepSpeed as non-finite); disarms."""
        spike, self._loss, self._decided, self._spike = self._spike, None, False, None
        return spike


def guard_steps(optimizer: torch.optim.Optimizer, skip: Callable[[], bool]) -> None:
    """Make `optimizer.step()` (this instance's, which DeepSpeed calls) do nothing when `skip()` says so
    (a StepGuard's, or ds_internals' non-finite norm). An instance attribute, so the class stays the one
    DeepSpeed knows (ZeRO checks optimizer types); guards stack, the last one added deciding first."""
    step = optimizer.step

    def guarded_step(closure=None):
        if skip():
            return None
        return step(closure)

    optimizer.step = guarded_step
