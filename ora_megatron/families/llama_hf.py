"""llama family ↔ transformers' LlamaForCausalLM.

megatron-core's RoPE (not interleaved) rotates halves like HF Llama, so Q/K need no permutation;
its SwiGLU `linear_fc1` is [gate; up] stacked along the output dimension; GQA maps to
num_key_value_heads; the output layer is untied.
"""

from __future__ import annotations

import torch

from ora_megatron.families.hf import rename, split_qkv, unpad_vocab
from ora_megatron.model_config import ModelConfig

ARCHITECTURE = "LlamaForCausalLM"

# (ours under `layer{i}.layer.`, theirs under `model.layers.{i-1}.`)
LAYER_TABLE = [
    ("input_layernorm.weight", "input_layernorm.weight"),
    ("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
    ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
    ("mlp.linear_fc2.weight", "mlp.down_proj.weight"),
]


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
