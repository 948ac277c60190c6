"""Attention submodules that plug into megatron-core's TransformerLayer through its ModuleSpec.

- `SDPACoreAttention`: causal softmax(QKᵀ/√d_k)V with torch SDPA (flash / memory-efficient kernels
  on GPU, plain math on CPU), GQA included. Replaces megatron's DotProductAttention, which needs CUDA.
  With document masking (`DocumentMask`) on a GPU without attention dropout, compiled FlexAttention with
  a block mask of the documents: a fused kernel that skips the blocks no query may see.
- `RandomQKVLinear`: the `linear_qkv` replacement for ora / frozen_gaussian / frozen_uniform. Q and K
  are random (orthogonal, Gaussian or uniform), a pure function of (seed, layer, role), frozen unless
  the A2 flags train them; V is an ordinary trainable projection. One fused GEMM forward (same cost
  as megatron's ColumnParallelLinear); the backward computes the input gradient through Q, K and V
  but weight gradients only for trainable parts, so frozen Q/K cost no weight-gradient GEMM.
  Frozen Hadamard Q/K (ora, orthogonal_method=hadamard) skip their GEMMs altogether: they are
  applied as two small Kronecker contractions (hadamard.HadamardRows), forward and input
  gradient, and written straight into megatron's interleaved layout beside V's GEMM; a compiled layer
  (train.compile) traces the same transforms as plain ops instead, their path settled before it runs.
- `RandomQKSelfAttention`: megatron's SelfAttention, telling its linear_qkv which layer it is in.
- `SynthesizerAttention`: softmax(R)·V with R per head (N×N, or R1·R2ᵀ of rank k), causal; covers
  synthesizer_random (trainable or fixed R), synthesizer_factorized and fixed_random_attention.

Every random tensor is drawn for all heads (or per head from its own generator) and sliced to this
tensor-parallel rank's heads, so every TP size sees the same model.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import (
    _initialize_affine_weight_cpu,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from ora_megatron.device_branches import on_cuda
from ora_megatron.hadamard import HadamardRows
from ora_megatron.model_config import FROZEN_QK_INIT, AttentionConfig
from ora_megatron.orthogonal import (
    frozen_projection,
    hadamard_transform_for,
    orthogonal_matrix,
    seeded_generator,
)
from ora_megatron.parallel import tp_rank_size


def _mark_head_sharded(*params) -> None:
    """Tell megatron/DeepSpeed (checkpoint resharding, grad-norm) these hold this rank's heads only."""
    for param in params:
        if param is not None:
            set_tensor_model_parallel_attributes(param, is_parallel=True, dim=0, stride=1)


@dataclass
class DocumentMask:
    """Document masking of packed samples (data.reset_attention_mask): token t of sample b attends to the
    tokens up to t of its own document.

    Built once per forward from the document ids [b, s] a batch carries, in the forms the layers use, and
    handed to every layer as its attention mask: `visible` ([b, 1, s, s], `visible_within_documents`) for
    SDPA and the synthesizers, `block_mask` for FlexAttention (`SDPACoreAttention.fuses_documents`).
    """

    visible: Optional[torch.Tensor] = None
    block_mask: Optional[BlockMask] = None


def visible_within_documents(ids: torch.Tensor) -> torch.Tensor:
    """[b, 1, s, s] from document ids [b, s], True where a query may attend (SDPA's convention): earlier
    tokens of its own document. Its negation is the mask megatron-core's GPTDataset makes with
    reset_attention_mask."""
    s = ids.size(1)
    causal = torch.ones(s, s, dtype=torch.bool, device=ids.device).tril()
    return (ids[:, None, :, None] == ids[:, None, None, :]) & causal


def document_block_mask(ids: torch.Tensor) -> BlockMask:
    """FlexAttention's block mask of `DocumentMask`: causal within each document, the same for every head
    (H=None broadcasts, so any tensor-parallel rank's share of the heads takes it)."""

    def same_document_causal(b, h, q, kv):
        return (q >= kv) & (ids[b, q] == ids[b, kv])

    batch, s = ids.shape
    return create_block_mask(same_document_causal, B=batch, H=None, Q_LEN=s, KV_LEN=s, device=ids.device)


@functools.cache
def _compiled_flex_attention():
    return torch.compile(flex_attention)


def flex_document_attention(q, k, v, block_mask: BlockMask, scale: Optional[float], enable_gqa: bool):
    """softmax(QKᵀ·scale + block mask)V, [b, heads, s, d]. On CUDA FlexAttention is fused only compiled:
    compiled here, or traced into the compiled layer (train.compile). Elsewhere it runs unfused (eager,
    forward only on CPU)."""
    fused = q.is_cuda and not torch.compiler.is_compiling()
    attend = _compiled_flex_attention() if fused else flex_attention
    return attend(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)


class SDPACoreAttention(MegatronModule):
    """Core attention on torch's scaled_dot_product_attention: causal, or causal within documents
    (a `DocumentMask`): FlexAttention where it can run fused, else SDPA with the dense mask."""

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type=None,
                 attention_type: str = "self", softmax_scale=None, cp_comm_type=None,
                 pg_collection=None, **_unused):
        super().__init__(config=config)
        self.softmax_scale = softmax_scale
        self.dropout_p = config.attention_dropout

    def fuses_documents(self, device: torch.device) -> bool:
        """Whether document masking runs on FlexAttention: on CUDA (on CPU FlexAttention has no backward,
        and SDPA's CPU kernel takes the dense mask), and without attention dropout, which FlexAttention
        does not have (SDPA's memory-efficient kernel takes the dense mask then)."""
        return on_cuda(device) and (self.dropout_p == 0.0 or not self.training)

    def forward(self, query, key, value, attention_mask: Optional[DocumentMask] = None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, **_newer_megatron_kwargs):
        # megatron layout [s, b, heads, d] -> SDPA layout [b, heads, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        gqa = q.size(1) != k.size(1)
        if attention_mask is not None and attention_mask.block_mask is not None and self.fuses_documents(q.device):
            out = flex_document_attention(q, k, v, attention_mask.block_mask, self.softmax_scale, gqa)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=attention_mask is None, scale=self.softmax_scale,
                attn_mask=None if attention_mask is None else attention_mask.visible,
                dropout_p=self.dropout_p if self.training else 0.0, enable_gqa=gqa,
            )
        s, b = query.size(0), query.size(1)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


class _FusedQKV(torch.autograd.Function):
    """Y = X·[Q|K|V]ᵀ (+ V bias) in megatron's interleaved per-group layout, one GEMM.

    Backward: dX = dY·W always; dW only for the weights that require grad, each from its own
    slice of dY. Frozen Q/K thus skip their weight-gradient GEMMs (2·d² of ~6·d² per token).
    The parameters are saved, not W: W is interleaved again in backward rather than kept alive
    from forward (3·d² per layer, more than the copy costs).
    """

    @staticmethod
    def forward(ctx, x, q_weight, k_weight, v_weight, v_bias, groups: int):
        bias = None
        if v_bias is not None:
            zeros_qk = v_bias.new_zeros(groups, (q_weight.size(0) + k_weight.size(0)) // groups)
            bias = torch.cat([zeros_qk, v_bias.view(groups, -1)], dim=1).view(-1)
        ctx.save_for_backward(x, q_weight, k_weight, v_weight)
        ctx.shapes = (groups, q_weight.size(0) // groups, k_weight.size(0) // groups)
        return F.linear(x, _interleave(q_weight, k_weight, v_weight, groups), bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, q_weight, k_weight, v_weight = ctx.saved_tensors
        groups, q_rows, kv_rows = ctx.shapes
        grad_x = grad_out.matmul(_interleave(q_weight, k_weight, v_weight, groups))
        g = grad_out.reshape(-1, groups, q_rows + 2 * kv_rows)
        x2d = x.reshape(-1, x.size(-1))

        def weight_grad(lo, hi):
            return g[:, :, lo:hi].reshape(g.size(0), -1).t().matmul(x2d)

        need = ctx.needs_input_grad
        grad_q = weight_grad(0, q_rows) if need[1] else None
        grad_k = weight_grad(q_rows, q_rows + kv_rows) if need[2] else None
        grad_v = weight_grad(q_rows + kv_rows, q_rows + 2 * kv_rows) if need[3] else None
        grad_b = g[:, :, q_rows + kv_rows:].sum(0).reshape(-1) if need[4] else None
        return grad_x, grad_q, grad_k, grad_v, grad_b, None


def _interleave(q_weight, k_weight, v_weight, groups: int) -> torch.Tensor:
    """[q-heads of group | k | v] per query group: the row order megatron's SelfAttention splits."""
    h = q_weight.size(-1)
    parts = [w.view(groups, -1, h) for w in (q_weight, k_weight, v_weight)]
    return torch.cat(parts, dim=1).view(-1, h)


class _HadamardQKV(torch.autograd.Function):
    """Frozen Hadamard Q and K plus a V GEMM, written into megatron's interleaved layout.

    Forward (HadamardRows.columns, a chunk of tokens at a time): the rows of [x·D_q·H | x·D_k·H] (two
    small contractions), then one gather writes each group's Q and K columns (their permutations
    and this rank's heads are in `qk_block`/`qk_offset`) straight into the output; V's GEMM result
    is copied beside them. Backward (HadamardRows.columns_transposed): one gather pulls the Q/K slots
    of the output gradient back into row order (`row_index`; `row_mask` zeroes the positions no
    column of this rank came from), the transposed contractions give their input gradient, and V
    adds dX += dV·W_V plus its weight and bias gradients. Q/K have no weights here: nothing to
    differentiate.
    """

    @staticmethod
    def forward(ctx, x, v_weight, v_bias, kernel: HadamardRows, qk_block, qk_offset, row_index, row_mask):
        x2d = x.reshape(-1, x.size(-1))
        t = x2d.size(0)
        groups, qk_width = qk_block.shape
        out = x.new_empty(t, groups, qk_width + v_weight.size(0) // groups)
        kernel.columns(x2d, qk_block, qk_offset, out=out[:, :, :qk_width])
        out[:, :, qk_width:] = F.linear(x2d, v_weight, v_bias).view(t, groups, -1)
        ctx.kernel, ctx.x_shape, ctx.layout = kernel, x.shape, (groups, qk_width)
        ctx.save_for_backward(x2d, v_weight, row_index, row_mask)
        return out.view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad_out):
        x2d, v_weight, row_index, row_mask = ctx.saved_tensors
        kernel, (groups, qk_width) = ctx.kernel, ctx.layout
        t = x2d.size(0)
        g = grad_out.reshape(t, -1).contiguous()
        grad_v = g.view(t, groups, -1)[:, :, qk_width:].reshape(t, -1)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = grad_w = grad_b = None
        if need_x:
            grad_x = kernel.columns_transposed(g, row_index, row_mask, out=x2d.new_empty(x2d.shape))
            # out= rather than addmm_: the same BLAS call, and FlopCounterMode counts it.
            grad_x = torch.addmm(grad_x, grad_v, v_weight, out=grad_x).view(ctx.x_shape)
        if need_w:
            grad_w = grad_v.t().matmul(x2d)
        if need_b:
            grad_b = grad_v.sum(0)
        return grad_x, grad_w, grad_b, None, None, None, None, None


class RandomQKVLinear(torch.nn.Module):
    """linear_qkv for random-Q/K variants; same call contract as megatron's ColumnParallelLinear.

    Q/K weights are generated by `generate_qk(layer_number)` (called by RandomQKSelfAttention once
    the layer number is known). They are Parameters with requires_grad=False when frozen, so a
    freeze schedule can later flip them trainable; optimizers are built from trainable params only.
    """

    def __init__(self, input_size: int, output_size: int, *, config: TransformerConfig,
                 init_method, bias: bool, attention: AttentionConfig, seed: int,
                 tp_group=None, gather_output: bool = False, skip_bias_add: bool = False,
                 is_expert: bool = False, tp_comm_buffer_name=None, **_unused):
        super().__init__()
        assert not gather_output and not is_expert
        self.config, self.attention, self.seed, self.tp_group = config, attention, seed, tp_group
        self.skip_bias_add = skip_bias_add
        rank, size = tp_rank_size(tp_group)
        self.heads = config.num_attention_heads // size
        self.groups = config.num_query_groups // size
        self.head_dim = config.kv_channels
        d = config.hidden_size
        self.v_weight = torch.nn.Parameter(torch.empty(self.groups * self.head_dim, d))
        _initialize_affine_weight_cpu(
            self.v_weight, config.num_query_groups * self.head_dim, d, self.v_weight.size(0), 0,
            init_method, rank=rank, world_size=size, params_dtype=config.params_dtype)
        # ORA's frozen Q/K carry no bias (the research plan, docs/research.md); V keeps its bias.
        self.v_bias = torch.nn.Parameter(torch.zeros(self.v_weight.size(0))) if bias else None
        self.q_weight = torch.nn.Parameter(torch.empty(self.heads * self.head_dim, d), requires_grad=False)
        self.k_weight = torch.nn.Parameter(torch.empty(self.groups * self.head_dim, d), requires_grad=False)
        _mark_head_sharded(self.q_weight, self.k_weight, self.v_bias)
        self.hadamard = None  # HadamardRows of Q and K, set by generate_qk for ora/hadamard
        self._hadamard_weights_checked = False
        # Role → the full (all heads) Q or K a run imported instead of drawing (init_from.qk:
        # imported); the reference its frozen copies are checked against, as the draw is otherwise.
        self.imported_qk: dict[str, torch.Tensor] = {}

    def generate_qk(self, layer_number: int) -> None:
        """Fill Q/K from (seed, layer, role), take this rank's heads, set trainability (A2).

        On the meta device (a model of shapes only: pretrain.research.memory_model) there is nothing to
        fill and no transform to build; the trainability is set all the same."""
        self.layer_number = layer_number
        for role, param, trainable in (("q", self.q_weight, self.attention.train_q),
                                       ("k", self.k_weight, self.attention.train_k)):
            if not param.is_meta:
                with torch.no_grad():
                    param.copy_(self.local_weight(role))
            param.requires_grad_(trainable)
        if self.attention.hadamard_qk and not self.q_weight.is_meta:
            self._build_hadamard(layer_number)

    def _build_hadamard(self, layer_number: int) -> None:
        """The Q and K transforms of this layer and where this rank's columns sit in their rows.

        Built whatever the trainability: a freeze schedule may freeze Q/K later (forward decides).
        Under tensor parallelism every rank applies the whole (cheap) transform and gathers only
        its own heads' columns, rows [rank·width, (rank + 1)·width) of the dense weight.
        """
        d, hd = self.config.hidden_size, self.head_dim
        transforms = [hadamard_transform_for(self.seed, layer_number, role, d) for role in ("q", "k")]
        kernel = HadamardRows([t.signs for t in transforms])
        rank, _ = tp_rank_size(self.tp_group)
        blocks, offsets = [], []
        for role, (transform, width) in enumerate(zip(transforms, (self.heads * hd, self.groups * hd))):
            columns = torch.arange(rank * width, (rank + 1) * width)
            block, offset = kernel.position(role, transform.perm[columns])
            blocks.append(block.view(self.groups, -1))
            offsets.append(offset.view(self.groups, -1))
        # [groups, q rows of a group + k rows], megatron's order
        qk_block, qk_offset = torch.cat(blocks, dim=1), torch.cat(offsets, dim=1)
        # For the backward: where each column's gradient sits in an output row.
        slots = torch.arange(self.groups)[:, None] * (qk_block.size(1) + hd) + torch.arange(qk_block.size(1))
        row_index, row_mask = kernel.gather_map(qk_block, qk_offset, slots)
        self.hadamard = kernel
        # Non-persistent: regenerated from the seed like the transforms, moved with the module.
        self.register_buffer("qk_block", qk_block, persistent=False)
        self.register_buffer("qk_offset", qk_offset, persistent=False)
        self.register_buffer("row_index", row_index, persistent=False)
        self.register_buffer("row_mask", row_mask, persistent=False)

    def local_weight(self, role: str) -> torch.Tensor:
        """This rank's heads of this layer's reference Q or K: the imported one, if the run imported
        it, else the one regenerated from the seed."""
        if role in self.imported_qk:
            rows = (self.heads if role == "q" else self.groups) * self.head_dim
            rank, _ = tp_rank_size(self.tp_group)
            return self.imported_qk[role][rank * rows:(rank + 1) * rows].to(self.config.params_dtype)
        return self.drawn_weight(role)

    def drawn_weight(self, role: str) -> torch.Tensor:
        """This rank's heads of the Q or K weight of this layer regenerated from (seed, layer, role)."""
        heads = self.config.num_attention_heads if role == "q" else self.config.num_query_groups
        rows = (self.heads if role == "q" else self.groups) * self.head_dim
        rank, _ = tp_rank_size(self.tp_group)
        return self.expected_weight(role, self.layer_number, heads)[rank * rows:(rank + 1) * rows]

    def expected_weight(self, role: str, layer_number: int, heads: int) -> torch.Tensor:
        """The full (all heads, all ranks) random Q or K weight of this layer, regenerated."""
        att = self.attention
        return frozen_projection(
            FROZEN_QK_INIT[att.type], att.orthogonal_method, self.config.hidden_size, heads,
            self.head_dim, seed=self.seed, layer=layer_number, role=role,
            joint_heads=att.joint_heads, std=att.random_qk_scale(self.config.hidden_size),
        ).to(self.config.params_dtype)

    def forward(self, x):
        x = copy_to_tensor_model_parallel_region(x, group=self.tp_group)
        if not self._hadamard_applies():
            out = _FusedQKV.apply(x, self.q_weight, self.k_weight, self.v_weight, self.v_bias, self.groups)
        elif torch.compiler.is_compiling():
            out = self._traced_hadamard_qkv(x)
        else:
            out = _HadamardQKV.apply(x, self.v_weight, self.v_bias, self.hadamard, self.qk_block,
                                     self.qk_offset, self.row_index, self.row_mask)
        return out, None

    def _traced_hadamard_qkv(self, x):
        """_HadamardQKV's output as plain differentiable ops, for a compiled layer (train.compile): its
        hand-written kernels write into strided `out=` views, which dynamo cannot trace."""
        x2d = x.reshape(-1, x.size(-1))
        qk = self.hadamard.differentiable_columns(x2d, self.qk_block, self.qk_offset)  # [t, groups, q + k rows]
        v = F.linear(x2d, self.v_weight, self.v_bias).view(x2d.size(0), self.groups, -1)
        return torch.cat([qk, v], dim=2).view(*x.shape[:-1], -1)

    def _hadamard_applies(self) -> bool:
        """Whether Q and K are frozen Hadamard weights that the fast transforms reproduce.

        A freeze schedule can train them (then the weights are the model, and the dense path takes
        their gradients) and could freeze them again at trained values: the first forward of every
        frozen spell checks the weights against the regenerated ones once.
        """
        if self.hadamard is None:
            return False
        if self.q_weight.requires_grad or self.k_weight.requires_grad:
            self._hadamard_weights_checked = False
            return False
        if not self._hadamard_weights_checked:  # the transforms compute the drawn Q/K, nothing else
            self._hadamard_weights_match = all(
                torch.equal(w, self.drawn_weight(role).to(w.device, w.dtype))
                for role, w in (("q", self.q_weight), ("k", self.k_weight)))
            self._hadamard_weights_checked = True
        return self._hadamard_weights_match


def settle_hadamard_paths_eagerly(model: torch.nn.Module) -> None:
    """Before each forward of `model`, decide outside any compiled region which frozen Hadamard Q/K take
    the fast transforms (`RandomQKVLinear._hadamard_applies`).

    The decision compares the weights with a seeded redraw once per frozen spell: values and a hash,
    which a compiled layer (train.compile) cannot trace. Settled here, the layer reads only the Python
    flags it left, which dynamo guards on (a freeze schedule's change recompiles, it does not break).
    """
    linears = [m for m in model.modules() if isinstance(m, RandomQKVLinear) and m.hadamard is not None]
    if not linears:
        return

    def settle(module, args):
        for linear in linears:
            linear._hadamard_applies()

    model.register_forward_pre_hook(settle)


def use_imported_qk(module: torch.nn.Module, tensors: dict[tuple[int, str], torch.Tensor]) -> int:
    """Make the imported Q/K, `(layer, role)` → full tensor, the reference of every random-Q/K layer
    of `module` (regenerating and checking frozen Q/K then restores these). Returns how many were set."""
    count = 0
    for linear in (m for m in module.modules() if isinstance(m, RandomQKVLinear)):
        for role in ("q", "k"):
            if (linear.layer_number, role) in tensors:
                linear.imported_qk[role] = tensors[(linear.layer_number, role)].detach().cpu()
                count += 1
    return count


class RandomQKSelfAttention(SelfAttention):
    """megatron SelfAttention whose linear_qkv draws Q/K for this (global) layer number."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.linear_qkv.generate_qk(self.layer_number)


@dataclass
class SynthesizerSubmodules:
    linear_v: Union[ModuleSpec, type]
    linear_proj: Union[ModuleSpec, type]


class SynthesizerAttention(MegatronModule):
    """softmax(R + causal mask)·V per head; R is N×N (random) or R1·R2ᵀ (factorized).

    Replaces megatron's SelfAttention in the layer spec (there is no Q/K to project).
    """

    def __init__(self, config: TransformerConfig, submodules: SynthesizerSubmodules,
                 layer_number: int, attention: AttentionConfig, seed: int, max_seq_length: int,
                 attn_mask_type=None, cp_comm_type=None, pg_collection=None, **_unused):
        super().__init__(config=config)
        self.layer_number = layer_number
        tp_group = pg_collection.tp if pg_collection is not None else None
        rank, size = tp_rank_size(tp_group)
        heads = config.num_attention_heads // size
        self.heads, self.head_dim = heads, config.kv_channels
        width = config.num_attention_heads * config.kv_channels
        self.linear_v = build_module(
            submodules.linear_v, config.hidden_size, width, config=config,
            init_method=config.init_method, gather_output=False,
            bias=config.add_bias_linear, skip_bias_add=False, is_expert=False, tp_group=tp_group)
        self.linear_proj = build_module(
            submodules.linear_proj, width, config.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=config.add_bias_linear,
            input_is_parallel=True, skip_bias_add=True, is_expert=False, tp_group=tp_group)
        self.dropout = torch.nn.Dropout(config.attention_dropout)

        # Per-head generators: each rank draws only its own heads, identical for any TP size.
        my_heads = range(rank * heads, (rank + 1) * heads)
        n = max_seq_length
        if attention.type == "synthesizer_factorized":
            k = attention.synthesizer_rank
            def draw_factor(g):
                return torch.randn(n, k, generator=g) * attention.init_std

            self.r1 = torch.nn.Parameter(self._per_head(my_heads, "synth_r1", seed, draw_factor))
            self.r2 = torch.nn.Parameter(self._per_head(my_heads, "synth_r2", seed, draw_factor))
        else:
            if attention.type == "fixed_random_attention" and attention.fixed_init == "orthogonal":
                draw = lambda g: orthogonal_matrix("qr", n, n, g)  # noqa: E731
            else:
                draw = lambda g: torch.randn(n, n, generator=g) * attention.init_std  # noqa: E731
            trainable = attention.type == "synthesizer_random" and attention.synthesizer_trainable
            self.r = torch.nn.Parameter(self._per_head(my_heads, "synth_r", seed, draw), requires_grad=trainable)
        _mark_head_sharded(*(getattr(self, n) for n in ("r", "r1", "r2") if hasattr(self, n)))

    def _per_head(self, heads, role, seed, draw) -> torch.Tensor:
        return torch.stack([draw(seeded_generator(seed, self.layer_number, f"{role}/{h}")) for h in heads])

    def mixing_logits(self, s: int) -> torch.Tensor:
        """[heads, s, s] pre-softmax attention logits for sequence length s."""
        if hasattr(self, "r1"):
            return self.r1[:, :s].matmul(self.r2[:, :s].transpose(1, 2))
        return self.r[:, :s, :s]

    def forward(self, hidden_states, attention_mask: Optional[DocumentMask] = None, **_unused):
        s, b = hidden_states.shape[:2]
        value, _ = self.linear_v(hidden_states)  # [s, b, heads·d]
        value = value.view(s, b, self.heads, self.head_dim).permute(1, 2, 0, 3)  # [b, h, s, d]
        # Causal alone, or with document masking the dense [b, 1, s, s] mask: R is a dense [h, s, s] matrix
        # already, there is no kernel to keep it off.
        if attention_mask is None:
            causal = torch.ones(s, s, dtype=torch.bool, device=value.device).triu(1)
            logits = self.mixing_logits(s).masked_fill(causal, float("-inf"))  # [h, s, s]
        else:
            mixing = self.mixing_logits(s)
            logits = torch.where(attention_mask.visible, mixing, mixing.new_tensor(float("-inf")))  # [b, h, s, s]
        probs = self.dropout(torch.softmax(logits.float(), dim=-1).to(value.dtype))
        context = (probs if probs.dim() == 4 else probs.unsqueeze(0)).matmul(value)  # [b, h, s, d]
        context = context.permute(2, 0, 1, 3).reshape(s, b, -1)
        return self.linear_proj(context)
