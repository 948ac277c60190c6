"""The `freeze:` section: which layers' Q and K are frozen at which fraction of the run's steps.

Its readers: the trainer enters a stage at its step (`stage_at`), pretrain/runtime/freeze.py applies one
to the engine (the trainable set and the optimizer hand-over), consolidation and the memory model read
which weights a stage trains.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union

from ora_megatron.config_io import check

LayerSet = Union[Literal["all", "none", "first_half", "second_half"], list[int]]


@dataclass
class FreezeStage:
    """From `start` (fraction of train.steps) on, these layers' Q and/or K are frozen."""

    start: float = 0.0
    """Fraction of train.steps at which this stage begins, in [0, 1); before the first, attention.train_q/k apply."""
    frozen_q: LayerSet = "all"
    """Layers whose Q is frozen (1-based numbers, or a named set); the other layers' Q train."""
    frozen_k: LayerSet = "all"
    """Layers whose K is frozen (1-based numbers, or a named set); the other layers' K train."""

    def validate(self, key: str) -> None:
        check(0.0 <= self.start < 1.0, f"{key}.start", "must be in [0, 1)")


# The `partial_frozen` schedule of the research plan (docs/research.md): 50% of steps all Q/K frozen,
# 30% the first half of the layers frozen, the last 20% everything trainable.
PARTIAL_FROZEN = [
    FreezeStage(0.0, "all", "all"),
    FreezeStage(0.5, "first_half", "first_half"),
    FreezeStage(0.8, "none", "none"),
]


@dataclass
class FreezeConfig:
    schedule: Union[Literal["none", "partial_frozen"], list[FreezeStage]] = "none"
    """none, partial_frozen (50% of steps all Q/K frozen, 30% the first half, 20% none) or a list of stages."""

    @property
    def stages(self) -> list[FreezeStage]:
        if self.schedule == "none":
            return []
        if self.schedule == "partial_frozen":
            return PARTIAL_FROZEN
        return sorted(self.schedule, key=lambda s: s.start)

    def stage_at(self, step: int, steps: int) -> int:
        """Index of the stage in force at `step` of `steps` (0-based); -1 before the first stage or without one."""
        started = [i for i, stage in enumerate(self.stages) if stage.start <= step / steps]
        return started[-1] if started else -1
