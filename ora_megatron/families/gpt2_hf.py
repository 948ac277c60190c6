"""gpt2 family ↔ transformers' GPT2LMHeadModel.

GPT-2 keeps its linear layers as Conv1D ([in, out], the transpose of ours), fuses Q, K and V
into `c_attn` as [q | k | v] along the output dimension, ties `lm_head` to `wte`, and uses the
exact (erf) GELU under the name "gelu" ("gelu_new" is the tanh approximation megatron does not use).
"""

from __future__ import annotations

import torch

from ora_megatron.families.hf import rename, split_qkv, unpad_vocab
from ora_megatron.model_config import ModelConfig

ARCHITECTURE = "GPT2LMHeadModel"

# (ours under `layer{i}.layer.`, theirs under `transformer.h.{i-1}.`); Conv1D weights are transposed.
LAYER_TABLE = [
    ("input_layernorm.weight", "ln_1.weight"),
    ("input_layernorm.bias", "ln_1.bias"),
    ("self_attention.linear_proj.bias", "attn.c_proj.bias"),
    ("pre_mlp_layernorm.weight", "ln_2.weight"),
    ("pre_mlp_layernorm.bias", "ln_2.bias"),
    ("mlp.linear_fc1.bias", "mlp.c_fc.bias"),
    ("mlp.linear_fc2.bias", "mlp.c_proj.bias"),
]
CONV1D_TABLE = [
    ("self_attention.linear_proj.weight", "attn.c_proj.weight"),
    ("mlp.linear_fc1.weight", "mlp.c_fc.weight"),
    ("mlp.linear_fc2.weight", "mlp.c_proj.weight"),
]


def check_exportable(model: ModelConfig) -> None:
    if model.head_dim * model.num_attention_heads != model.hidden_size:
        raise ValueError(f"GPT2LMHeadModel needs heads·d_k = d_model; this model has "
                         f"{model.num_attention_heads}·{model.head_dim} != {model.hidden_size}")
    if model.query_groups != model.num_attention_heads:
        raise ValueError("GPT2LMHeadModel has no grouped-query attention (model.num_query_groups)")


def hf_config(model: ModelConfig) -> dict:
    return {
        "model_type": "gpt2", "architectures": [ARCHITECTURE],
        "vocab_size": model.vocab_size, "n_positions": model.seq_length, "n_embd": model.hidden_size,
        "n_layer": model.num_layers, "n_head": model.num_attention_heads, "n_inner": model.ffn_size,
        "activation_function": "gelu", "layer_norm_epsilon": model.layernorm_epsilon,
        "resid_pdrop": model.hidden_dropout, "embd_pdrop": model.hidden_dropout,
        "attn_pdrop": model.attention_dropout, "initializer_range": model.init_std,
        "scale_attn_weights": True, "tie_word_embeddings": True,
    }


def keep_frozen_snippet(model: ModelConfig) -> list[str]:
    """Python lines for the model card: keep the frozen Q/K frozen when fine-tuning the export."""
    width = 2 * model.hidden_size
    return [f"# GPT-2 fuses [q | k | v] in c_attn (columns 0:{width} are Q and K): zero their gradient",
            "# and keep c_attn out of weight decay (AdamW decays weights even with a zero gradient).",
            "for block in model.transformer.h:",
            f"    block.attn.c_attn.weight.register_hook(lambda g: g.index_fill(1, torch.arange({width}), 0.0))"]


def hf_state_dict(state: dict, model: ModelConfig) -> dict[str, torch.Tensor]:
    out = {
        "transformer.wte.weight": unpad_vocab(state["embedding.embedding.word_embeddings.weight"], model),
        "transformer.wpe.weight": state["embedding.embedding.position_embeddings.weight"],
        "transformer.ln_f.weight": state["final_norm.norm.weight"],
        "transformer.ln_f.bias": state["final_norm.norm.bias"],
    }
    for i in range(1, model.num_layers + 1):
        ours, theirs = f"layer{i}.layer.", f"transformer.h.{i - 1}."
        out.update(rename(state, LAYER_TABLE, ours, theirs))
        out.update({k: v.t() for k, v in rename(state, CONV1D_TABLE, ours, theirs).items()})
        qkv = split_qkv(state, f"{ours}self_attention", model)
        out[f"{theirs}attn.c_attn.weight"] = torch.cat([qkv.q, qkv.k, qkv.v]).t()
        biases = [b if b is not None else torch.zeros(w.size(0), dtype=w.dtype)
                  for b, w in ((qkv.q_bias, qkv.q), (qkv.k_bias, qkv.k), (qkv.v_bias, qkv.v))]
        out[f"{theirs}attn.c_attn.bias"] = torch.cat(biases)
    out["lm_head.weight"] = out["transformer.wte.weight"]
    return {k: v.contiguous() for k, v in out.items()}
