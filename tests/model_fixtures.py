"""Small model configs covering every attention variant, shared by the model tests."""

from __future__ import annotations

import dataclasses

import torch

from ora_megatron.model_config import AttentionConfig, ModelConfig

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


def position_ids() -> torch.Tensor:
    return torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
