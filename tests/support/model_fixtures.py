"""Small model configs covering every attention variant, shared by the model tests."""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.models.gpt import GPTModel

from ora_megatron.builder import HostRotaryEmbedding, layer_spec, padded_vocab_size, transformer_config
from ora_megatron.families import family_of
from ora_megatron.model_config import AttentionConfig, ModelConfig, ParallelConfig
from ora_megatron.stages import StagedGPT, build_staged_gpt

VARIANTS = {
    "vanilla": AttentionConfig(type="vanilla"),
    "ora_qr": AttentionConfig(type="ora"),
    "ora_hadamard": AttentionConfig(type="ora", orthogonal_method="hadamard"),
    "ora_cayley_joint": AttentionConfig(type="ora", orthogonal_method="cayley", joint_heads=True),
    "ora_train_q": AttentionConfig(type="ora", train_q=True),
    "ora_train_k": AttentionConfig(type="ora", train_k=True),
    "frozen_gaussian": AttentionConfig(type="frozen_gaussian"),
    "frozen_uniform": AttentionConfig(type="frozen_uniform"),
    "synthesizer_random": AttentionConfig(type="synthesizer_random"),
    "synthesizer_random_fixed": AttentionConfig(type="synthesizer_random", synthesizer_trainable=False),
    "synthesizer_factorized": AttentionConfig(type="synthesizer_factorized", synthesizer_rank=4),
    "fixed_random_attention": AttentionConfig(type="fixed_random_attention"),
    "fixed_random_gaussian": AttentionConfig(type="fixed_random_attention", fixed_init="gaussian"),
}
# RoPE / RMSNorm / SwiGLU family, with grouped-query attention (4 query heads, 2 K/V groups).
LLAMA_VARIANTS = ("vanilla", "ora_qr", "ora_hadamard", "frozen_gaussian")

SEQ, BATCH = 16, 2


def tiny_model(variant: str, family: str = "gpt2") -> ModelConfig:
    return ModelConfig(
        family=family, num_layers=2, hidden_size=64, num_attention_heads=4,
        num_query_groups=2 if family == "llama" else None, ffn_hidden_size=128,
        seq_length=SEQ, vocab_size=100, make_vocab_size_divisible_by=8,
        hidden_dropout=0.0, attention_dropout=0.0, seed=7,
        attention=dataclasses.replace(VARIANTS[variant]),
    )


def all_cases() -> list[tuple[str, str]]:
    return [("gpt2", v) for v in VARIANTS] + [("llama", v) for v in LLAMA_VARIANTS]


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 100, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def build(variant: str, family: str = "gpt2", tensor: int = 1, **changes) -> StagedGPT:
    """The model as training assembles it (stage list, one module)."""
    return build_staged_gpt(dataclasses.replace(tiny_model(variant, family), **changes), ParallelConfig(tensor=tensor))


def megatron_gpt_model(model: ModelConfig) -> GPTModel:
    """megatron-core's own GPTModel for `model` (TP=1): the reference the stage list is checked against."""
    family = family_of(model)
    gpt = GPTModel(config=transformer_config(model, ParallelConfig()), transformer_layer_spec=layer_spec(model),
                   vocab_size=padded_vocab_size(model), max_sequence_length=model.seq_length,
                   share_embeddings_and_output_weights=family.tied_output,
                   position_embedding_type=family.position_embedding, rotary_base=model.rotary_base)
    if family.position_embedding == "rope":
        gpt.rotary_pos_emb = HostRotaryEmbedding(kv_channels=model.head_dim, rotary_percent=1.0,
                                                 rotary_base=model.rotary_base, use_cpu_initialization=True)
    return gpt
