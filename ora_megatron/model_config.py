"""Typed model and parallelism config: the `model:` and `parallel:` sections of a run's YAML."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Optional

from ora_megatron.config_io import ConfigError, apply_overrides, check, from_dict, load_yaml

AttentionType = Literal[
    "vanilla",
    "ora",
    "frozen_gaussian",
    "frozen_uniform",
    "synthesizer_random",
    "synthesizer_factorized",
    "fixed_random_attention",
]
# Variants whose scores come from Q·K (the rest mix values with a learned or fixed N×N matrix).
QK_VARIANTS = ("vanilla", "ora", "frozen_gaussian", "frozen_uniform")
FROZEN_QK_INIT = {"ora": "orthogonal", "frozen_gaussian": "gaussian", "frozen_uniform": "uniform"}
# Random Q/K whose scale is a setting (orthogonal columns have norm 1 by construction).
SCALED_QK_VARIANTS = ("frozen_gaussian", "frozen_uniform")
# The MLP activations each family computes; the first is the family's own (model.activation: null).
ACTIVATIONS = {"gpt2": ("gelu", "gelu_tanh"), "llama": ("silu",)}


@dataclass
class AttentionConfig:
    type: AttentionType = "vanilla"
    """Attention variant: Q·K scores (vanilla, ora, frozen_*) or a learned/fixed N×N mixing matrix (the rest)."""
    orthogonal_method: Literal["qr", "svd", "householder", "cayley", "hadamard"] = "qr"
    """ora: how the orthogonal Q/K are drawn (ablation A7); hadamard heads are always jointly orthonormal."""
    joint_heads: bool = False
    """ora: all heads of a role jointly orthonormal (needs heads·d_k ≤ d_model) instead of per head."""
    train_q: bool = False
    """ora / frozen_*: train Q from its random init instead of freezing it (ablation A2)."""
    train_k: bool = False
    """ora / frozen_*: train K from its random init instead of freezing it (ablation A2)."""
    init_std: float = 0.02
    """frozen_gaussian: std of N(0, std²); frozen_uniform: bound of U(-std, std); synthesizers, gaussian R: std."""
    init_scale: Literal["fixed", "matched"] = "fixed"
    """frozen_gaussian/uniform Q/K: fixed = init_std; matched = variance 1/d_model, E‖column‖² = 1 as orthonormal."""
    synthesizer_trainable: bool = True
    """synthesizer_random: R trainable (true) or fixed at its random init (false)."""
    synthesizer_rank: int = 64
    """synthesizer_factorized: rank k of R = R1·R2ᵀ (≤ model.seq_length)."""
    fixed_init: Literal["orthogonal", "gaussian"] = "orthogonal"
    """fixed_random_attention: distribution of the fixed R."""

    @property
    def uses_qk(self) -> bool:
        return self.type in QK_VARIANTS

    @property
    def custom_qkv(self) -> bool:
        """True when Q/K come from our own projection (random init, frozen or not)."""
        return self.type in FROZEN_QK_INIT

    @property
    def hadamard_qk(self) -> bool:
        """ORA's Q/K drawn as randomized Hadamard transforms, applied as the fast transform when frozen."""
        return self.type == "ora" and self.orthogonal_method == "hadamard"

    def random_qk_scale(self, d_model: int) -> float:
        """frozen_gaussian's std, frozen_uniform's bound: init_std, or with init_scale matched the scale
        whose variance 1/d_model gives a d_model-long column the squared norm of an orthonormal one."""
        if self.init_scale == "fixed":
            return self.init_std
        return math.sqrt((3.0 if self.type == "frozen_uniform" else 1.0) / d_model)  # U(-b, b): variance b²/3

    def validate(self, key: str) -> None:
        if self.train_q or self.train_k:
            check(self.custom_qkv, f"{key}.train_q",
                  f"train_q/train_k apply to {sorted(FROZEN_QK_INIT)}, not to '{self.type}'")
        check(self.init_std > 0, f"{key}.init_std", "must be > 0")
        check(self.init_scale == "fixed" or self.type in SCALED_QK_VARIANTS, f"{key}.init_scale",
              f"matched applies to {list(SCALED_QK_VARIANTS)}, not to '{self.type}'")
        check(self.synthesizer_rank > 0, f"{key}.synthesizer_rank", "must be > 0")


@dataclass
class ModelConfig:
    family: Literal["gpt2", "llama"] = "gpt2"
    """gpt2: learned positions, LayerNorm, GELU, biases, tied head (research plan); llama: RoPE, RMSNorm, SwiGLU."""
    num_layers: int = 2
    """Number of transformer layers."""
    hidden_size: int = 64
    """Model width d_model."""
    num_attention_heads: int = 4
    """Number of query heads."""
    num_query_groups: Optional[int] = None
    """K/V heads for grouped-query attention (divides num_attention_heads); null = one K/V head per query head."""
    kv_channels: Optional[int] = None
    """Per-head dimension d_k; null = hidden_size / num_attention_heads."""
    ffn_hidden_size: Optional[int] = None
    """MLP inner width (llama: of each SwiGLU branch); null = 4 · hidden_size."""
    seq_length: int = 128
    """Tokens per training sample; also the number of learned positions (gpt2) and the synthesizers' N."""
    vocab_size: int = 256
    """Tokenizer vocabulary size; the embedding is padded up to a multiple of make_vocab_size_divisible_by."""
    make_vocab_size_divisible_by: int = 128
    """Pad the embedding/output rows to a multiple of this (must be divisible by parallel.tensor)."""
    hidden_dropout: float = 0.1
    """Dropout probability on the embeddings and on the attention and MLP outputs, in [0, 1)."""
    attention_dropout: float = 0.1
    """Dropout probability on the attention weights, in [0, 1)."""
    init_std: float = 0.02
    """Std of the normal init of trainable weights (megatron-core's init_method_std)."""
    layernorm_epsilon: float = 1e-5
    """Epsilon of LayerNorm (gpt2) / RMSNorm (llama)."""
    rotary_base: int = 10000
    """RoPE base frequency (llama only)."""
    activation: Optional[Literal["gelu", "gelu_tanh", "silu"]] = None
    """MLP activation; null = the family's (gpt2: exact GELU, llama: SiLU gate); gpt2 also takes
    gelu_tanh, the tanh approximation of published GPT-2 checkpoints (transformers' gelu_new)."""
    seed: int = 42
    """Seed of every random init, frozen Q/K included: frozen Q/K are a function of (seed, layer, role)."""
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    """The attention variant and its options."""

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def activation_name(self) -> str:
        """The MLP activation the model computes: model.activation, or the family's own."""
        return self.activation or ACTIVATIONS[self.family][0]

    def validate(self, key: str) -> None:
        k = f"{key}." if key else ""
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size",
                     "make_vocab_size_divisible_by", "init_std", "layernorm_epsilon", "rotary_base"):
            check(getattr(self, name) > 0, k + name, "must be > 0")
        for name in ("num_query_groups", "kv_channels", "ffn_hidden_size"):  # null: derived from the others
            check(getattr(self, name) is None or getattr(self, name) > 0, k + name, "must be > 0 (or null)")
        if self.kv_channels is None:
            check(self.hidden_size % self.num_attention_heads == 0, k + "num_attention_heads",
                  f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                  f"{self.num_attention_heads} (or set kv_channels)")
        check(self.num_attention_heads % self.query_groups == 0, k + "num_query_groups",
              f"num_attention_heads {self.num_attention_heads} is not divisible by "
              f"num_query_groups {self.query_groups}")
        for name in ("hidden_dropout", "attention_dropout"):
            check(0.0 <= getattr(self, name) < 1.0, k + name, "must be in [0, 1)")
        check(self.activation is None or self.activation in ACTIVATIONS[self.family], k + "activation",
              f"the {self.family} family computes {' or '.join(ACTIVATIONS[self.family])}, not {self.activation}")
        att = self.attention
        if att.type == "ora":
            check(self.head_dim <= self.hidden_size, k + "kv_channels",
                  f"d_k {self.head_dim} > d_model {self.hidden_size}: a d_model×d_k matrix cannot "
                  "have orthonormal columns")
            if att.joint_heads or att.hadamard_qk:
                width = self.num_attention_heads * self.head_dim
                check(width <= self.hidden_size, k + "attention.joint_heads",
                      f"heads·d_k = {width} > d_model {self.hidden_size}: heads cannot be jointly "
                      "orthonormal (hadamard is always joint)")
        if att.type == "synthesizer_factorized":
            check(att.synthesizer_rank <= self.seq_length, k + "attention.synthesizer_rank",
                  f"rank {att.synthesizer_rank} > seq_length {self.seq_length}")


@dataclass
class ParallelConfig:
    tensor: int = 1
    """Tensor-parallel size (megatron-core layers; splits heads and the MLP)."""
    pipeline: int = 1
    """Pipeline-parallel size (DeepSpeed PipelineModule splits the layers); data parallel: the rest."""

    def validate(self, key: str) -> None:
        check(self.tensor >= 1, f"{key}.tensor", "must be >= 1")
        check(self.pipeline >= 1, f"{key}.pipeline", "must be >= 1")


def validate_model_parallel(model: ModelConfig, parallel: ParallelConfig) -> None:
    """Checks that need both sections: every rank must hold whole heads and whole layers."""
    tp = parallel.tensor
    check(model.num_attention_heads % tp == 0, "parallel.tensor",
          f"num_attention_heads {model.num_attention_heads} is not divisible by tensor-parallel size {tp}")
    check(model.query_groups % tp == 0, "parallel.tensor",
          f"num_query_groups {model.query_groups} is not divisible by tensor-parallel size {tp}")
    check(model.ffn_size % tp == 0, "parallel.tensor",
          f"ffn_hidden_size {model.ffn_size} is not divisible by tensor-parallel size {tp}")
    check(model.make_vocab_size_divisible_by % tp == 0, "model.make_vocab_size_divisible_by",
          f"{model.make_vocab_size_divisible_by} is not divisible by tensor-parallel size {tp} "
          "(each rank holds an equal slice of the padded vocabulary)")
    check(model.num_layers % parallel.pipeline == 0, "parallel.pipeline",
          f"num_layers {model.num_layers} is not divisible by pipeline-parallel size {parallel.pipeline}")


@dataclass
class ModelSection:
    """The part of a run config that the model builder reads; other sections belong to pretrain."""

    model: ModelConfig
    parallel: ParallelConfig


def load_model_section(path: str, overrides: list[str] = ()) -> ModelSection:
    data = apply_overrides(load_yaml(path), list(overrides))
    model = from_dict(ModelConfig, data.get("model"), "model")
    parallel = from_dict(ParallelConfig, data.get("parallel"), "parallel")
    validate_model_parallel(model, parallel)
    return ModelSection(model=model, parallel=parallel)


__all__ = [
    "AttentionConfig", "ModelConfig", "ParallelConfig", "ModelSection", "ConfigError",
    "load_model_section", "validate_model_parallel", "QK_VARIANTS", "FROZEN_QK_INIT",
]
