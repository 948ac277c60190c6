"""What every family's Hugging Face mapping shares: unpadding the vocabulary and splitting the
attention input projection into Q, K and V.

megatron-core's fused `linear_qkv` is laid out per query group: [ng, (np/ng + 2)·hn, d], i.e.
each group's query heads, then its key head, then its value head. The random-Q/K variants keep
Q, K and V as separate tensors (`q_weight`, `k_weight`, `v_weight`, `v_bias`) already.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ora_megatron.model_config import ModelConfig


class QKV(NamedTuple):
    q: torch.Tensor  # [np·hn, d]
    k: torch.Tensor  # [ng·hn, d]
    v: torch.Tensor  # [ng·hn, d]
    q_bias: Optional[torch.Tensor]  # None where the model has none (frozen Q/K never do)
    k_bias: Optional[torch.Tensor]
    v_bias: Optional[torch.Tensor]


def split_qkv(state: dict, prefix: str, model: ModelConfig) -> QKV:
    """Q, K, V weights (and biases) of the attention at `prefix` (`layer3.layer.self_attention`)."""
    if f"{prefix}.linear_qkv.q_weight" in state:
        get = state.get
        return QKV(state[f"{prefix}.linear_qkv.q_weight"], state[f"{prefix}.linear_qkv.k_weight"],
                   state[f"{prefix}.linear_qkv.v_weight"], None, None, get(f"{prefix}.linear_qkv.v_bias"))
    groups, per_group, hn = model.query_groups, model.num_attention_heads // model.query_groups, model.head_dim

    def split(fused: torch.Tensor) -> list[torch.Tensor]:
        grouped = fused.reshape(groups, (per_group + 2) * hn, -1)
        parts = grouped.split([per_group * hn, hn, hn], dim=1)
        return [p.reshape(-1, *fused.shape[1:]) for p in parts]

    q, k, v = split(state[f"{prefix}.linear_qkv.weight"])
    bias = state.get(f"{prefix}.linear_qkv.bias")
    q_bias, k_bias, v_bias = split(bias.unsqueeze(-1)) if bias is not None else (None, None, None)
    squeeze = [b.squeeze(-1) if b is not None else None for b in (q_bias, k_bias, v_bias)]
    return QKV(q, k, v, *squeeze)


def unpad_vocab(weight: torch.Tensor, model: ModelConfig) -> torch.Tensor:
    """Embedding / output rows of the real vocabulary (the model pads it for TP divisibility)."""
    return weight[: model.vocab_size]


def rename(state: dict, table: list[tuple[str, str]], source_prefix: str, target_prefix: str) -> dict:
    """One-to-one renames `{source_prefix}{ours}` → `{target_prefix}{theirs}` from a (ours, theirs) table."""
    return {target_prefix + theirs: state[source_prefix + ours] for ours, theirs in table
            if source_prefix + ours in state}
