"""Weights in: a run's first start from a Hugging Face model or from another run (the `init_from:` section).

The source is a Hugging Face model directory (`config.json` with model_type gpt2 or llama, weights in
`*.safetensors`: this project's exports and what `transformers`' `save_pretrained` writes) or a run
dir of this project, or one checkpoint of one (`RUN/checkpoints/<tag>`; a run dir means its latest).
Only weights come in: the optimizer, the LR schedule and the step start afresh.

At a fresh start, in the process that resolves the run (pretrain/launch/start.py), before any worker,
pretrain/checkpoint/import_plan.py checks the source against the run's model, converts it, takes the
source's numerics over into the run's model config and writes RUN/init_from/weights.safetensors with
the record RUN/init_from.json. The workers load those weights right after the engine is built when
there is no checkpoint to resume (through reshard.load_weights: any TP, PP, ZeRO stage, the fp32
masters included). A resume never imports again: the settings its import took over come from the
record (pretrain/checkpoint/resume_check.py's `recorded_model`) and it continues from its checkpoint;
the source may be gone by then.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from ora_megatron.config_io import check


@dataclass
class InitFromConfig:
    path: Optional[str] = None
    """Start from these weights, not random ones: a Hugging Face model directory (gpt2/llama, safetensors) or
    a run dir / checkpoint of this project. Weights only (optimizer, LR schedule, step start afresh); read at
    the run's first start only."""
    qk: Optional[Literal["draw", "imported"]] = None
    """Required with path and random-Q/K attention (ora, frozen_*): draw Q/K as a fresh run does (from
    model.seed), or take the imported ones (frozen unless attention.train_q/train_k)."""

    def validate(self, key: str) -> None:
        if self.path is None:
            check(self.qk is None, f"{key}.qk", f"read only with {key}.path: leave it at null")
        else:
            check(bool(self.path.strip()), f"{key}.path", "an empty path; null starts from random weights")


class ImportRefused(ValueError):
    """The source cannot initialise this run; the message names the key, field or tensor at fault."""
