"""What every family's Hugging Face mapping shares: unpadding the vocabulary and splitting the
attention input projection into Q, K and V.

megatron-core's fused `linear_qkv` is laid out per query group: [ng, (np/ng + 2)·hn, d], i.e.
each group's query heads, then its key head, then its value head. The random-Q/K variants keep
Q, K and V as separate tensors (`q_weight`, `k_weight`, `v_weight`, `v_bias`) already.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

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


def join_qkv(qkv: QKV, prefix: str, model: ModelConfig, separate_qk: bool, bias: bool) -> dict[str, torch.Tensor]:
    """The inverse of `split_qkv`: the attention input projection at `prefix` in the model's layout.

    `separate_qk` (the random-Q/K variants): `q_weight`, `k_weight`, `v_weight` and, with `bias`,
    `v_bias`; Q and K carry no bias there, so theirs are left out (the caller decides whether that
    is allowed). Otherwise megatron's fused `linear_qkv.weight` (and `.bias`), interleaved per query
    group as `split_qkv` reads it; a missing bias is zeros."""
    if separate_qk:
        out = {f"{prefix}.linear_qkv.q_weight": qkv.q, f"{prefix}.linear_qkv.k_weight": qkv.k,
               f"{prefix}.linear_qkv.v_weight": qkv.v}
        if bias:
            v_bias = qkv.v_bias if qkv.v_bias is not None else qkv.v.new_zeros(qkv.v.size(0))
            out[f"{prefix}.linear_qkv.v_bias"] = v_bias
        return out
    groups = model.query_groups

    def interleave(q, k, v):
        parts = [t.reshape(groups, -1, *t.shape[1:]) for t in (q, k, v)]
        return torch.cat(parts, dim=1).reshape(-1, *q.shape[1:])

    out = {f"{prefix}.linear_qkv.weight": interleave(qkv.q, qkv.k, qkv.v)}
    if bias:
        biases = [b if b is not None else w.new_zeros(w.size(0))
                  for b, w in ((qkv.q_bias, qkv.q), (qkv.k_bias, qkv.k), (qkv.v_bias, qkv.v))]
        out[f"{prefix}.linear_qkv.bias"] = interleave(*biases)
    return out


class HFConfigRefused(ValueError):
    """A Hugging Face config holds a setting this project's model cannot compute; `field` names it."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


def renamed_back(hf: dict, table: list[tuple[str, str]], our_prefix: str, hf_prefix: str) -> dict:
    """`rename`'s inverse: `{hf_prefix}{theirs}` → `{our_prefix}{ours}` for every pair of the table."""
    return {our_prefix + ours: hf[hf_prefix + theirs] for ours, theirs in table}


def hf_value(config: dict, key: str, default: Any) -> Any:
    """A config.json value, or transformers' default where the file leaves it out (None counts as absent)."""
    value = config.get(key)
    return default if value is None else value


def require(config: dict, key: str, default: Any, wanted: Any, why: str) -> None:
    """Refuse a config.json setting other than `wanted` (transformers' `default` where absent)."""
    value = hf_value(config, key, default)
    if value != wanted:
        raise HFConfigRefused(key, f"{value!r}: {why}")
