"""The typed description every model family fills in (see families/__init__.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal


@dataclass(frozen=True)
class Family:
    name: str
    normalization: Literal["LayerNorm", "RMSNorm"]
    activation: Callable  # of the MLP's first projection (the gate's, when gated)
    gated_mlp: bool  # SwiGLU-style: the first MLP projection is [gate | up], 3 matrices in all
    bias: bool  # biases on every linear layer (frozen Q/K never carry one)
    position_embedding: Literal["learned_absolute", "rope"]
    tied_output: bool  # the output head reuses the input word embedding

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.gated_mlp else 2
