"""llama family ↔ transformers' LlamaForCausalLM.

megatron-core's RoPE (not interleaved) rotates halves like HF Llama, so Q/K need no permutation;
its SwiGLU `linear_fc1` is [gate; up] stacked along the output dimension; GQA maps to
num_key_value_heads; the output layer is untied.
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

ARCHITECTURE = "LlamaForCausalLM"

# (ours under `layer{i}.layer.`, theirs under `model.layers.{i-1}.`)
LAYER_TABLE = [
    ("input_layernorm.weight", "input_layernorm.weight"),
    ("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
    ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
    ("mlp.linear_fc2.weight", "mlp.down_proj.weight"),
]


# Saved by older transformers beside the weights: RoPE's frequencies, not weights.
IGNORED_HF_KEYS = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
SHAPE_HINTS = {"model.embed_tokens.weight": "model.vocab_size × model.hidden_size",
               "lm_head.weight": "model.vocab_size × model.hidden_size"}


def check_exportable(model: ModelConfig) -> None:
    """Every llama-family model maps (head_dim and GQA are LlamaConfig fields)."""


def hf_config(model: ModelConfig) -> dict:
    return {
        "model_type": "llama", "architectures": [ARCHITECTURE],
        "vocab_size": model.vocab_size, "hidden_size": model.hidden_size,
        "intermediate_size": model.ffn_size, "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads, "num_key_value_heads": model.query_groups,
        "head_dim": model.head_dim, "hidden_act": "silu", "max_position_embeddings": model.seq_length,
        "rms_norm_eps": model.layernorm_epsilon, "initializer_range": model.init_std,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(model.rotary_base)},
        "attention_bias": False, "mlp_bias": False, "attention_dropout": model.attention_dropout,
        "tie_word_embeddings": False,
    }


def keep_frozen_snippet(model: ModelConfig) -> list[str]:
    """Python lines for the model card: keep the frozen Q/K frozen when fine-tuning the export."""
    return ["for name, p in model.named_parameters():",
            "    if name.endswith(('self_attn.q_proj.weight', 'self_attn.k_proj.weight')):",
            "        p.requires_grad_(False)  # the frozen layers listed above"]


def hf_state_dict(state: dict, model: ModelConfig) -> dict[str, torch.Tensor]:
    out = {
        "model.embed_tokens.weight": unpad_vocab(state["embedding.embedding.word_embeddings.weight"], model),
        "model.norm.weight": state["final_norm.norm.weight"],
        "lm_head.weight": unpad_vocab(state["output.output_layer.weight"], model),
    }
    for i in range(1, model.num_layers + 1):
        ours, theirs = f"layer{i}.layer.", f"model.layers.{i - 1}."
        out.update(rename(state, LAYER_TABLE, ours, theirs))
        qkv = split_qkv(state, f"{ours}self_attention", model)
        out[f"{theirs}self_attn.q_proj.weight"] = qkv.q
        out[f"{theirs}self_attn.k_proj.weight"] = qkv.k
        out[f"{theirs}self_attn.v_proj.weight"] = qkv.v
        gate, up = state[f"{ours}mlp.linear_fc1.weight"].chunk(2, dim=0)
        out[f"{theirs}mlp.gate_proj.weight"] = gate
        out[f"{theirs}mlp.up_proj.weight"] = up
    return {k: v.contiguous() for k, v in out.items()}


def model_fields(config: dict, model: ModelConfig) -> dict:
    """The settings of a Llama config.json the run's model takes over (numerics: RMSNorm epsilon, RoPE
    base); raises HFConfigRefused naming a setting this family cannot compute (another activation,
    biases, RoPE scaling, a non-integral RoPE base) or a head count other than the model's."""
    require(config, "hidden_act", "silu", "silu", "the llama family's gate is SiLU")
    require(config, "attention_bias", False, False, "the llama family has no attention biases")
    require(config, "mlp_bias", False, False, "the llama family has no MLP biases")
    rope = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling")
    if scaling:  # transformers 4.x: rope_scaling beside rope_theta
        raise HFConfigRefused("rope_scaling", f"{scaling!r}: the model computes RoPE without scaling")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise HFConfigRefused("rope_parameters.rope_type", f"{rope_type!r}: the model computes the default RoPE")
    theta = float(rope.get("rope_theta", hf_value(config, "rope_theta", 10000.0)))
    if theta != int(theta):
        raise HFConfigRefused("rope_parameters.rope_theta", f"{theta}: model.rotary_base is a whole number")
    heads = hf_value(config, "num_attention_heads", 32)
    if heads != model.num_attention_heads:
        raise HFConfigRefused("num_attention_heads", f"{heads} heads, this run's model.num_attention_heads is "
                                                     f"{model.num_attention_heads}")
    groups = hf_value(config, "num_key_value_heads", heads)
    if groups != model.query_groups:
        raise HFConfigRefused("num_key_value_heads", f"{groups} K/V heads, this run's model.num_query_groups "
                                                     f"gives {model.query_groups}")
    return {"layernorm_epsilon": float(hf_value(config, "rms_norm_eps", 1e-6)), "rotary_base": int(theta)}


def tied(config: dict) -> bool:
    return bool(hf_value(config, "tie_word_embeddings", False))


def optional_hf_keys(config: dict) -> tuple[str, ...]:
    """With tie_word_embeddings the output head is the embedding, left out of the files."""
    return ("lm_head.weight",) if tied(config) else ()


def from_hf_state_dict(hf: dict, model: ModelConfig, config: dict) -> tuple[dict[str, torch.Tensor], dict[str, QKV]]:
    """`hf_state_dict`'s inverse: (every weight but the attention input projections, under our names,
    the vocabulary unpadded; each layer's Q, K, V by `layer{i}.layer.self_attention`). A tied model's
    output head is its embedding (the run trains the two apart)."""
    rest = {
        "embedding.embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
        "final_norm.norm.weight": hf["model.norm.weight"],
        "output.output_layer.weight": hf["model.embed_tokens.weight"] if tied(config) else hf["lm_head.weight"],
    }
    attention = {}
    for i in range(1, model.num_layers + 1):
        ours, theirs = f"layer{i}.layer.", f"model.layers.{i - 1}."
        rest.update(renamed_back(hf, LAYER_TABLE, ours, theirs))
        rest[f"{ours}mlp.linear_fc1.weight"] = torch.cat([hf[f"{theirs}mlp.gate_proj.weight"],
                                                         hf[f"{theirs}mlp.up_proj.weight"]])
        attention[f"{ours}self_attention"] = QKV(*(hf[f"{theirs}self_attn.{p}_proj.weight"] for p in "qkv"),
                                                 None, None, None)
    return {k: v.contiguous() for k, v in rest.items()}, attention
