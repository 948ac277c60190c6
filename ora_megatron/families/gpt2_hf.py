"""gpt2 family ↔ transformers' GPT2LMHeadModel.

GPT-2 keeps its linear layers as Conv1D ([in, out], the transpose of ours), fuses Q, K and V
into `c_attn` as [q | k | v] along the output dimension and ties `lm_head` to `wte`. The exact
(erf) GELU is "gelu" in transformers; the tanh approximation of published GPT-2 checkpoints is
"gelu_new" (model.activation: gelu_tanh, exported as "gelu_pytorch_tanh": torch's own, the same
function we compute).
"""

from __future__ import annotations

import re

import torch

from ora_megatron.families.hf import (
    QKV,
    HFConfigRefused,
    hf_value,
    rename,
    renamed_back,
    require,
    split_qkv,
    unpad_vocab,
)
from ora_megatron.model_config import ModelConfig

ARCHITECTURE = "GPT2LMHeadModel"
# model.activation → transformers' activation_function written by the export.
HF_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}
# transformers' activation_function → model.activation, for the import (gelu_new: published GPT-2's).
ACTIVATIONS_FROM_HF = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
# Saved by older transformers beside the weights: the causal-mask buffers, not weights.
IGNORED_HF_KEYS = re.compile(r"transformer\.h\.\d+\.attn\.(masked_)?bias")
# What a shape difference of these tensors means, for the import's refusal.
SHAPE_HINTS = {"transformer.wte.weight": "model.vocab_size × model.hidden_size",
               "transformer.wpe.weight": "model.seq_length must equal n_positions"}

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
        "activation_function": HF_ACTIVATIONS[model.activation_name],
        "layer_norm_epsilon": model.layernorm_epsilon,
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


def model_fields(config: dict, model: ModelConfig) -> dict:
    """The settings of a GPT-2 config.json the run's model takes over (numerics: activation, norm
    epsilon); raises HFConfigRefused naming a setting this family cannot compute, or a head count
    other than the model's (tensor shapes do not show it)."""
    activation = hf_value(config, "activation_function", "gelu_new")
    if activation not in ACTIVATIONS_FROM_HF:
        raise HFConfigRefused("activation_function", f"{activation!r}: the gpt2 family computes "
                                                     f"{', '.join(ACTIVATIONS_FROM_HF)}")
    require(config, "scale_attn_weights", True, True, "the model scales attention scores by 1/sqrt(d_k)")
    require(config, "scale_attn_by_inverse_layer_idx", False, False, "the model does not scale scores by layer")
    require(config, "add_cross_attention", False, False, "a decoder-only model has no cross attention")
    require(config, "tie_word_embeddings", True, True, "the gpt2 family ties its output head to wte")
    heads = hf_value(config, "n_head", 12)
    if heads != model.num_attention_heads:
        raise HFConfigRefused("n_head", f"{heads} heads, this run's model.num_attention_heads is "
                                        f"{model.num_attention_heads}")
    return {"activation": ACTIVATIONS_FROM_HF[activation],
            "layernorm_epsilon": float(hf_value(config, "layer_norm_epsilon", 1e-5))}


def normalised_hf_keys(hf: dict) -> dict:
    """Older GPT-2 checkpoints name their tensors without the `transformer.` prefix (`wte.weight`)."""
    if "transformer.wte.weight" not in hf and "wte.weight" in hf:
        return {key if key.startswith("lm_head.") else f"transformer.{key}": value for key, value in hf.items()}
    return hf


def optional_hf_keys(config: dict) -> tuple[str, ...]:
    """The tied output head: transformers leaves it out of the files (or holds wte's copy)."""
    return ("lm_head.weight",)


def from_hf_state_dict(hf: dict, model: ModelConfig, config: dict) -> tuple[dict[str, torch.Tensor], dict[str, QKV]]:
    """`hf_state_dict`'s inverse: (every weight but the attention input projections, under our names,
    the embedding unpadded; each layer's Q, K, V and biases by `layer{i}.layer.self_attention`)."""
    rest = {
        "embedding.embedding.word_embeddings.weight": hf["transformer.wte.weight"],
        "embedding.embedding.position_embeddings.weight": hf["transformer.wpe.weight"],
        "final_norm.norm.weight": hf["transformer.ln_f.weight"],
        "final_norm.norm.bias": hf["transformer.ln_f.bias"],
    }
    attention = {}
    d = model.hidden_size
    for i in range(1, model.num_layers + 1):
        ours, theirs = f"layer{i}.layer.", f"transformer.h.{i - 1}."
        rest.update(renamed_back(hf, LAYER_TABLE, ours, theirs))
        rest.update({k: v.t() for k, v in renamed_back(hf, CONV1D_TABLE, ours, theirs).items()})
        q, k, v = hf[f"{theirs}attn.c_attn.weight"].t().split(d)
        q_bias, k_bias, v_bias = hf[f"{theirs}attn.c_attn.bias"].split(d)
        attention[f"{ours}self_attention"] = QKV(q, k, v, q_bias, k_bias, v_bias)
    return {k: v.contiguous() for k, v in rest.items()}, attention
