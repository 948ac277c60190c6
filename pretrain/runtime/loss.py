"""The language-model loss of a micro-batch (ora_megatron.cross_entropy) as training takes it, and its
mean over the data-parallel ranks.

A plain (not pipelined) engine gets the labels and returns the loss itself (`batch_loss`): at
tensor-parallel size 1 through the fused output projection and cross entropy, which never holds
the logits of all tokens. The pipeline's last stage sees logits only: its `loss_fn` is `lm_loss`.
"""

from __future__ import annotations

import torch
from deepspeed import DeepSpeedEngine
from megatron.core import parallel_state

from ora_megatron.cross_entropy import lm_loss

__all__ = ["batch_loss", "data_parallel_mean", "lm_loss"]


def batch_loss(ds_engine: DeepSpeedEngine, batch: dict) -> torch.Tensor:
    """Loss of one micro-batch through a plain (not pipelined) engine."""
    # DeepSpeed's plain engine does not move inputs (its pipeline engine does); batches are host tensors.
    tokens, labels, loss_mask = (batch[k].to(ds_engine.device, non_blocking=True)
                                 for k in ("tokens", "labels", "loss_mask"))
    documents = {k: batch[k].to(ds_engine.device, non_blocking=True)  # document masking (data.reset_*)
                 for k in ("position_ids", "document_ids") if k in batch}
    return ds_engine(tokens, (labels, loss_mask), **documents)


def data_parallel_mean(value: torch.Tensor) -> float:
    """Mean of a per-rank scalar over the data-parallel group (every rank gets it)."""
    size = parallel_state.get_data_parallel_world_size()
    if size > 1:  # over one rank the sum is the value itself: no collective
        torch.distributed.all_reduce(value, group=parallel_state.get_data_parallel_group())
    return value.item() / size
