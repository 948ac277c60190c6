"""Model config → megatron-core TransformerConfig and layer spec.

The attention variant is chosen by swapping the `self_attention` submodule of megatron-core's
local GPT layer spec; everything else (norms, MLP, embeddings, output layer) is megatron-core's,
its linears run as torch's linear on a lone tensor-parallel rank (linear.py). The family
(families/) decides norm, activation, MLP gating and biases. The model itself is assembled from
these parts in stages.py.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_mlp_module_spec_for_backend
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from ora_megatron.attention import (
    RandomQKSelfAttention,
    RandomQKVLinear,
    SDPACoreAttention,
    SynthesizerAttention,
    SynthesizerSubmodules,
)
from ora_megatron.device_branches import cuda_available
from ora_megatron.families import activation_of, family_of
from ora_megatron.linear import ColumnLinear, RowLinear
from ora_megatron.model_config import ModelConfig, ParallelConfig


def padded_vocab_size(model: ModelConfig) -> int:
    """Vocab rounded up to make_vocab_size_divisible_by. Unlike Megatron-LM, not multiplied by the
    TP size: the model (and its checkpoints) stay the same for every TP size that divides it."""
    multiple = model.make_vocab_size_divisible_by
    return -(-model.vocab_size // multiple) * multiple


def whole_layer_cuda_graph_scope() -> dict:
    """The CUDA-graph scope setting as megatron-core's default means it, without its warning.

    megatron-core's default scope "full" (cuda_graph_scope in 0.16, cuda_graph_modules from 0.19) warns its
    own deprecation on every config built; the empty scope it maps "full" to is the same setting, unused
    here anyway (no CUDA graph is captured). Chosen by which field has that default, not by version."""
    for name in ("cuda_graph_modules", "cuda_graph_scope"):
        field = TransformerConfig.__dataclass_fields__.get(name)
        if field is not None and field.default == "full":
            return {name: []}
    return {}


def transformer_config(model: ModelConfig, parallel: ParallelConfig,
                       params_dtype: torch.dtype = torch.float32) -> TransformerConfig:
    family = family_of(model)
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.query_groups,
        kv_channels=model.head_dim,
        ffn_hidden_size=model.ffn_size,
        hidden_dropout=model.hidden_dropout,
        attention_dropout=model.attention_dropout,
        init_method_std=model.init_std,
        layernorm_epsilon=model.layernorm_epsilon,
        normalization=family.normalization,
        activation_func=activation_of(model),
        gated_linear_unit=family.gated_mlp,
        add_bias_linear=family.bias,
        tensor_model_parallel_size=parallel.tensor,
        # Pipeline stages are assembled and scheduled by DeepSpeed, not megatron-core.
        pipeline_model_parallel_size=1,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        # Master weights are drawn whole and sliced per rank: the same model for every TP size.
        use_cpu_initialization=True,
        perform_initialization=True,
        # megatron-core's jit-fused bias + dropout + residual add and gated SiLU (the same arithmetic
        # in one kernel) where there is a GPU. Its fused GELU is the tanh approximation, not the
        # exact GELU the gpt2 family computes (and its export declares): left unfused, and so is
        # model.activation gelu_tanh (never run fused on a GPU here). The other fusions need
        # Transformer Engine or apex.
        bias_activation_fusion=cuda_available() and family.gated_mlp and activation_of(model) is F.silu,
        bias_dropout_fusion=cuda_available(),
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        **whole_layer_cuda_graph_scope(),
    )


def attention_spec(model: ModelConfig) -> ModuleSpec:
    """The self_attention submodule for the configured variant."""
    att = model.attention
    if att.uses_qk:
        if att.custom_qkv:
            module = RandomQKSelfAttention
            linear_qkv = ModuleSpec(module=RandomQKVLinear, params={"attention": att, "seed": model.seed})
        else:
            module, linear_qkv = SelfAttention, ColumnLinear
        return ModuleSpec(
            module=module,
            params={"attn_mask_type": AttnMaskType.causal},
            submodules=SelfAttentionSubmodules(
                linear_qkv=linear_qkv,
                core_attention=SDPACoreAttention,
                linear_proj=RowLinear,
                q_layernorm=IdentityOp,
                k_layernorm=IdentityOp,
            ),
        )
    return ModuleSpec(
        module=SynthesizerAttention,
        params={"attention": att, "seed": model.seed, "max_seq_length": model.seq_length},
        submodules=SynthesizerSubmodules(linear_v=ColumnLinear, linear_proj=RowLinear),
    )


class LocalLinears(LocalSpecProvider):
    """megatron-core's local backend (the one get_gpt_layer_local_spec uses) with our linears."""

    def column_parallel_linear(self) -> type:
        return ColumnLinear

    def row_parallel_linear(self) -> type:
        return RowLinear


def layer_spec(model: ModelConfig) -> ModuleSpec:
    """megatron-core's local GPT layer with our attention submodule and linears swapped in."""
    base = get_gpt_layer_local_spec(normalization=family_of(model).normalization)
    mlp = get_mlp_module_spec_for_backend(backend=LocalLinears())
    submodules = dataclasses.replace(base.submodules, self_attention=attention_spec(model), mlp=mlp)
    return dataclasses.replace(base, submodules=submodules)


class HostRotaryEmbedding(RotaryEmbedding):
    """megatron-core's RoPE moves its frequencies to CUDA unconditionally; without a GPU keep them
    on the host (same non-interleaved layout as megatron's)."""

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        if torch.cuda.is_available():
            return super().get_emb(max_seq_len, offset)
        assert not self.rotary_interleaved
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
