"""The byte model of `python -m pretrain.research.memory_plan`: per-GPU memory of a run, term by term.

The parameters are the real model's (its stages built on the meta device: shapes, frozen flags and
tensor-parallel marks without allocating), cut the way the run cuts them: tensor-parallel weights
divided by TP, each pipeline stage holding its layers (DeepSpeed's `type:DecoderLayerStage` split)
and the tied embedding on both end stages, ZeRO partitions over the data-parallel size with
DeepSpeed's padding.

Model states are what DeepSpeed 0.19.8 allocates, read from its code and measured on CPU (gloo,
two ranks, exact to the byte: tests/test_memory_plan.py). e = bytes of the training dtype, P =
trainable and N = all parameters on the rank, dp = data-parallel size, G = the largest tensor the
optimizer steps at once (a param group's ZeRO partition, or a whole group under ZeRO-0):
  weights       e·N; ZeRO-3 e·Σ⌈n/dp⌉ (frozen Q/K partitioned too)
  masters       the fp32 copy the optimizer steps: ZeRO-0 fp32 none, ZeRO-0 mixed 4·P, ZeRO-1/2 4·Σ over
                param groups of (group padded to a multiple of 2·dp)/dp, also in fp32 training; ZeRO-3 4·Σ⌈n/dp⌉
  Adam moments  2 × the masters' elements, fp32 (ZeRO-0 fp32: 8·P)
  gradients     peak, at the step: ZeRO-0 e·P (+ 4·P fp32 copies in mixed precision); ZeRO-1/2/3 the
                gradient buffer (ZeRO-1/2: whole parameters overlapping the rank's partition; ZeRO-3:
                e·Σ⌈n/dp⌉) + e·G flattened + 4·G converted (mixed); ZeRO-1 with accumulation at least e·P
  buffers       Adam's √v temporary 4·G (torch's foreach AdamW); ZeRO-0 all-reduce bucket e·min(P, 5e8);
                ZeRO-1/2/3 reduce bucket e·reduce_bucket_size; ZeRO-3 parameters gathered from forward to
                backward e·min(N, stage3_max_reuse_distance/2): with the default 1e9 the whole stage stays
                gathered below 500M parameters, so ZeRO-3 saves no weight memory at these sizes
Activations: Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models"), per layer s·b·h·(34 + 5·a·s/h) bytes in 16-bit without recomputation, with our attention
on torch SDPA (flash / memory-efficient kernels): no a·s² buffers, the kernel keeps a fp32 log-sum-exp
(4·a·s·b bytes) instead. `layer_activation_bytes` and `head_activation_bytes` list the terms; what
they count is what autograd keeps, to the byte, on CPU (same test). The total adds every term,
transients included: an upper bound of the peak.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ora_megatron.attention import RandomQKVLinear
from ora_megatron.builder import padded_vocab_size
from ora_megatron.cross_entropy import chunk_tokens
from ora_megatron.families import family_of
from ora_megatron.model_config import ModelConfig, ParallelConfig
from ora_megatron.stages import DecoderLayerStage, StageSpec, build_staged_gpt, owner_names, stage_specs
from pretrain.config.freeze import FreezeConfig
from pretrain.config.run_config import RunConfig, for_world, validate_for_world
from pretrain.job.parallel_layout import ParallelLayout
from pretrain.runtime.ds_config import deepspeed_config, fp32_grad_accumulation
from pretrain.runtime.optimizer import param_groups

# DeepSpeed (and pretrain.runtime.engine / pretrain.runtime.freeze, which import it) is imported where it is used:
# importing it logs a line to stdout, which `--json` keeps for the plan (memory_plan.main imports it with
# stdout sent to stderr, so its log handler writes there).
if TYPE_CHECKING:
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
FP32 = 4
GIB = 2**30
# CUDA context, NCCL communicators and allocator fragmentation are outside the terms counted here:
# a plan "fits" when it leaves at least this share of the GPU free.
RESERVE_FRACTION = 0.10
# DeepSpeed's ZeRO-1/2 flat buffers start each rank's partition on a 4-byte boundary of 16-bit
# elements (stage_1_and_2.py, nccl_start_alignment_factor): groups are padded to 2·dp elements.
ZERO12_ALIGNMENT = 2


@dataclass(frozen=True)
class Layout:
    """How the run is laid out over the GPUs (the config after flags, checked for the world size)."""

    parallel: ParallelLayout
    zero_stage: int
    precision: str
    micro_batch_size: int
    grad_accum: int
    activation_checkpointing: bool
    fp32_grad_accumulation: bool = False  # ZeRO-2/3 gradient buffers in fp32 (ds_config.fp32_grad_accumulation)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.precision]

    @property
    def mixed(self) -> bool:
        return self.precision != "fp32"

    def to_json(self) -> dict:
        """The plan's record: the parallel sizes beside the rest, in one mapping."""
        fields = dataclasses.asdict(self)
        del fields["parallel"]
        return {**self.parallel.to_json(), **fields}


@dataclass(frozen=True)
class Shard:
    """One parameter as one tensor-parallel rank holds it."""

    numel: int
    trainable: bool
    group: str  # its optimizer param group (pretrain.runtime.optimizer.param_groups); "" when frozen


# ------------------------------------------------------------------ the parameters each stage holds
def _apply_most_trainable_freeze_stage(config: ModelConfig, freeze: FreezeConfig, model: torch.nn.Module) -> None:
    """With a freeze schedule, take the stage with the most trainable Q/K: the one holding the most."""
    from pretrain.runtime.freeze import trainability

    stages = freeze.stages
    if not stages:
        return
    indices = list(range(len(stages))) + ([-1] if stages[0].start > 0 else [])
    flags = max((trainability(config, freeze, i) for i in indices), key=lambda t: sum(t.values()))
    for linear in (m for m in model.modules() if isinstance(m, RandomQKVLinear)):
        for role in ("q", "k"):
            getattr(linear, f"{role}_weight").requires_grad_(flags[(linear.layer_number, role)])


def pipeline_stages(model: ModelConfig, parallel: ParallelConfig) -> list[list[StageSpec]]:
    """The stage list cut as DeepSpeed's partition_method="type:DecoderLayerStage" cuts it: layers
    balanced over the pipeline, the embedding on the first stage, final norm and output on the last."""
    from deepspeed.runtime.utils import partition_balanced

    specs = stage_specs(model, parallel)
    parts = partition_balanced([int(spec.cls is DecoderLayerStage) for spec in specs], parallel.pipeline)
    return [specs[first:last] for first, last in zip(parts[:-1], parts[1:])]


def stage_shards(cfg: RunConfig, stages: list[list[StageSpec]]) -> list[list[Shard]]:
    """Per pipeline stage, the parameter shards one of its ranks holds; a tied module (gpt2's
    embedding and output head) counts on every stage that holds it, once per stage.

    The model is built once at TP=1 on the meta device (megatron's parallel state must exist, TP=1);
    tensor-parallel parameters (megatron's `tensor_model_parallel` mark) are divided by TP.
    """
    tp = cfg.parallel.tensor
    with torch.device("meta"):
        model = build_staged_gpt(cfg.model, dataclasses.replace(cfg.parallel, tensor=1, pipeline=1))
    _apply_most_trainable_freeze_stage(cfg.model, cfg.freeze, model)
    group_of = {id(p): g["name"] for g in param_groups(model, cfg.optimizer.weight_decay) for p in g["params"]}
    owners = owner_names([spec for stage in stages for spec in stage])

    def shards(module_name: str) -> list[Shard]:
        return [Shard(p.numel() // tp if getattr(p, "tensor_model_parallel", False) else p.numel(),
                      p.requires_grad, group_of.get(id(p), ""))
                for p in getattr(model, module_name).parameters()]

    held = ([owners.get(spec.tied_key, spec.name) for spec in stage] for stage in stages)
    return [[shard for name in dict.fromkeys(names) for shard in shards(name)] for names in held]


# ------------------------------------------------------------------ model states under ZeRO
def _groups(shards: list[Shard]) -> dict[str, list[int]]:
    """Trainable elements per optimizer group, in parameter order (the order DeepSpeed flattens them)."""
    groups: dict[str, list[int]] = {}
    for shard in shards:
        if shard.trainable:
            groups.setdefault(shard.group, []).append(shard.numel)
    return groups


def zero12_partition(group_numel: int, dp: int) -> int:
    """Elements of one rank's ZeRO-1/2 partition of a param group (flat buffer padded to 2·dp)."""
    alignment = ZERO12_ALIGNMENT * dp
    return math.ceil(group_numel / alignment) * alignment // dp


def zero12_overlap(groups: dict[str, list[int]], dp: int) -> int:
    """The most elements any rank's ZeRO-1/2 gradient buffer holds: DeepSpeed copies the gradients
    of every parameter overlapping the rank's partition whole (`grads_in_partition`)."""
    held = [0] * dp
    for numels in groups.values():
        size = zero12_partition(sum(numels), dp)
        start = 0
        for numel in numels:
            for rank in range(dp):
                if start < (rank + 1) * size and start + numel > rank * size:
                    held[rank] += numel
            start += numel
    return max(held)


def zero3_partition(numels: list[int], dp: int) -> int:
    return sum(math.ceil(n / dp) for n in numels)


def optimizer_elements(shards: list[Shard], layout: Layout) -> int:
    """Elements the torch optimizer steps on this rank (fp32, padding included)."""
    trainable = [s.numel for s in shards if s.trainable]
    if layout.zero_stage == 0:
        return sum(trainable)
    if layout.zero_stage == 3:
        return zero3_partition(trainable, layout.parallel.data)
    return sum(zero12_partition(sum(numels), layout.parallel.data) for numels in _groups(shards).values())


def largest_stepped_group(shards: list[Shard], layout: Layout, zero: DeepSpeedZeroConfig) -> int:
    """Elements of the largest tensor the optimizer steps at once on this rank: a param group's
    partition (ZeRO-1/2), a sub-group's (ZeRO-3), or a whole group (ZeRO-0: torch's foreach AdamW)."""
    groups = _groups(shards).values()
    if layout.zero_stage == 0:
        return max((sum(n) for n in groups), default=0)
    if layout.zero_stage == 3:
        return max((min(zero3_partition(n, layout.parallel.data), zero.sub_group_size) for n in groups), default=0)
    return max((zero12_partition(sum(n), layout.parallel.data) for n in groups), default=0)


def gradient_bytes(shards: list[Shard], layout: Layout, zero: DeepSpeedZeroConfig) -> int:
    """Peak gradient storage of one rank, at the optimizer step (DeepSpeed 0.19.8's code, measured).

    ZeRO-0: the gradients, plus (mixed precision) FP16_UnfusedOptimizer's fp32 copies of them.
    ZeRO-1/2/3: the gradient buffer (ZeRO-1/2: every parameter overlapping the rank's partition, whole;
    ZeRO-3: the partitions), and while it is alive the step flattens a group's partition (training
    dtype) and converts it to fp32 (mixed precision). ZeRO-1 with gradient accumulation holds the
    full gradients between boundaries (it reduces only at the boundary). bf16 ZeRO-2/3 with gradient
    accumulation keep their buffer in fp32.
    """
    e, dp, trainable = layout.dtype_bytes, layout.parallel.data, sum(s.numel for s in shards if s.trainable)
    if layout.zero_stage == 0:
        return e * trainable + (FP32 * trainable if layout.mixed else 0)
    if layout.zero_stage == 3:
        held = zero3_partition([s.numel for s in shards if s.trainable], dp)
    else:
        held = zero12_overlap(_groups(shards), dp)
    group = largest_stepped_group(shards, layout, zero)
    at_step = (FP32 if layout.fp32_grad_accumulation else e) * held + e * group + (FP32 * group if layout.mixed else 0)
    if layout.zero_stage == 1 and layout.grad_accum > 1:
        return max(e * trainable, at_step)
    return at_step


def model_state_bytes(shards: list[Shard], layout: Layout, zero: DeepSpeedZeroConfig) -> dict[str, int]:
    e, dp = layout.dtype_bytes, layout.parallel.data
    numels = [s.numel for s in shards]
    weights = e * (zero3_partition(numels, dp) if layout.zero_stage == 3 else sum(numels))
    stepped = optimizer_elements(shards, layout)
    # ZeRO-0 in fp32 steps the weights themselves; every other layout steps an fp32 copy.
    masters = 0 if layout.zero_stage == 0 and not layout.mixed else FP32 * stepped
    return {"weights": weights, "gradients": gradient_bytes(shards, layout, zero),
            "master_weights": masters, "adam_moments": 2 * FP32 * stepped}


def deepspeed_buffer_bytes(shards: list[Shard], layout: Layout, zero: DeepSpeedZeroConfig) -> dict[str, int]:
    """DeepSpeed's buffers and the optimizer's step temporary on one rank (sizes from the run's
    ds_configs, DeepSpeed's defaults for the rest)."""
    from deepspeed.runtime.engine import MEMORY_OPT_ALLREDUCE_SIZE

    e = layout.dtype_bytes
    trainable = sum(s.numel for s in shards if s.trainable)
    # torch's foreach AdamW (the default on CUDA) makes √v for a whole stepped tensor list at once.
    out = {"adam_sqrt_v_temporary": FP32 * largest_stepped_group(shards, layout, zero)}
    if layout.zero_stage == 0:
        # The engine all-reduces gradients through flat buckets of up to 5e8 elements.
        if layout.parallel.data > 1:
            out["allreduce_bucket"] = e * min(trainable, MEMORY_OPT_ALLREDUCE_SIZE)
        return out
    if zero.contiguous_gradients:
        out["reduce_bucket"] = (2 if zero.overlap_comm and layout.zero_stage < 3 else 1) * e * zero.reduce_bucket_size
    if layout.zero_stage == 3:
        # Parameters gathered in forward are released only when their next use (in backward) is
        # more than stage3_max_reuse_distance elements of parameters away.
        everything = sum(s.numel for s in shards)
        out["zero3_gathered_parameters"] = e * min(everything, zero.max_reuse_distance // 2)
    return out


# ------------------------------------------------------------------ activations
def layer_activation_bytes(model: ModelConfig, tokens: int, layout: Layout, device: str = "cuda") -> int:
    """Bytes one decoder layer keeps for backward for `tokens` = s·b tokens (no recomputation).

    Korthikanti et al.'s 34·s·b·h (16-bit) is, per token, 16·h elements of the training dtype
    (inputs of both norms, of the QKV and first MLP projections: 4h, replicated over TP; Q, K, V: 3h;
    attention output = output-projection input: h; MLP activation input and output: 8h) plus two
    1-byte dropout masks. Here the widths are the model's (GQA, FFN size, SwiGLU's 3 MLP tensors),
    TP divides the split ones (no sequence parallelism), and SDPA replaces the a·s² terms with its
    fp32 log-sum-exp. Also counted: norm statistics (mean and 1/σ per token, fp32 on CUDA) and
    RoPE's rotated Q/K (llama).
    On CPU (the tests) dropout keeps a mask of the training dtype and norm statistics are in it too.
    """
    e, tp, h = layout.dtype_bytes, layout.parallel.tensor, model.hidden_size
    q_width, kv_width = model.num_attention_heads * model.head_dim, model.query_groups * model.head_dim
    family = family_of(model)
    split = q_width + 2 * kv_width + q_width + family.mlp_matrices * model.ffn_size  # Q, K, V, out, MLP
    if family.position_embedding == "rope":
        split += q_width + kv_width
    per_token = e * (4 * h + split // tp)
    norm_stats = 2 if family.normalization == "LayerNorm" else 1
    per_token += 2 * norm_stats * (FP32 if device == "cuda" else e)
    if model.hidden_dropout > 0:
        per_token += 2 * h * (1 if device == "cuda" else e)
    per_token += FP32 * model.num_attention_heads // tp  # SDPA's log-sum-exp
    return tokens * per_token


def head_activation_bytes(model: ModelConfig, tokens: int, layout: Layout, first: bool, last: bool,
                          device: str = "cuda") -> int:
    """What the embedding (first stage) and the final norm, output layer and loss (last stage) keep
    for backward, one micro-batch: token ids and the embedding's dropout mask; the final norm's input,
    output and statistics; the loss's fp32 softmax (4·s·b·V/tp: megatron's vocab-parallel cross
    entropy works in place on our fp32 logits), its targets, the loss mask and normaliser. The fused
    loss (`fused_loss`) keeps its gradients w.r.t. the hidden states and the output weight instead
    of the softmax."""
    e, h = layout.dtype_bytes, model.hidden_size
    out = 0
    if first:
        out += tokens * 8 + model.seq_length * 8  # token and position ids (int64)
        out += tokens * h * (1 if device == "cuda" else e) if model.hidden_dropout > 0 else 0
    if last:
        norm_stats = 2 if family_of(model).normalization == "LayerNorm" else 1
        out += tokens * (e * h + norm_stats * (FP32 if device == "cuda" else e))  # the final norm's input
        if fused_loss(layout):
            out += (tokens + padded_vocab_size(model)) * h * e
        else:
            out += tokens * e * h  # the norm's output: the output layer's input
            out += tokens * padded_vocab_size(model) // layout.parallel.tensor * FP32
            out += tokens * (1 + 8 + FP32) + FP32  # cross entropy's target mask and targets, loss mask, normaliser
    return out


def fused_loss(layout: Layout) -> bool:
    """The plain model at TP 1 fuses the output projection with the loss (ora_megatron.cross_entropy)."""
    return layout.parallel.pipeline == 1 and layout.parallel.tensor == 1


def logits_transient_bytes(model: ModelConfig, tokens: int, layout: Layout, device: str = "cuda") -> int:
    """The logits in the training dtype, alive beside the fp32 softmax while the loss is computed
    (and their gradient beside it at the start of backward): e·s·b·V/tp on the last stage. The fused
    loss holds one chunk of logits, overwritten by their gradient, and the fp32 sum of the weight
    gradient; on CPU (its eager chunks) an fp32 copy of the chunk beside the logits, on a GPU (its
    compiled chunks) none."""
    vocab = padded_vocab_size(model)
    if not fused_loss(layout):
        return tokens * vocab // layout.parallel.tensor * layout.dtype_bytes
    e = layout.dtype_bytes
    held = e if device == "cuda" else FP32 + e
    chunk = min(tokens, chunk_tokens(vocab, e if device == "cuda" else FP32))
    return chunk * vocab * held + vocab * model.hidden_size * FP32


def activation_bytes(model: ModelConfig, layout: Layout, layers: int, first: bool, last: bool,
                     in_flight: int, checkpointing: bool, device: str = "cuda") -> int:
    """Peak activations of one pipeline stage, `in_flight` micro-batches between forward and backward.

    With checkpointing every layer keeps only its input (e·s·b·h) and one layer's activations are
    recomputed at a time (Korthikanti et al.'s full recomputation, 2·s·b·h·L in 16-bit).
    """
    tokens = layout.micro_batch_size * model.seq_length
    per_layer = layer_activation_bytes(model, tokens, layout, device)
    head = head_activation_bytes(model, tokens, layout, first, last, device)
    transient = logits_transient_bytes(model, tokens, layout, device) if last else 0
    if not checkpointing:
        return in_flight * (layers * per_layer + head) + transient
    return in_flight * (layers * layout.dtype_bytes * tokens * model.hidden_size + head) + per_layer + transient


ACTIVATION_FORMULA = (
    "Korthikanti et al. 2022 without the a·s² terms (torch SDPA): per layer s·b·(16·h·e + 2·h) bytes "
    "(MHA, FFN 4h, TP 1) + fp32 log-sum-exp 4·a·s·b; last stage + fp32 softmax 4·s·b·V and the logits e·s·b·V "
    "(at TP 1 without a pipeline, the fused loss: e·(s·b + V)·h and one chunk of logits, on a GPU in e bytes); "
    "checkpointing: e·s·b·h per layer + one layer recomputed")


def activation_caveats(model: ModelConfig) -> list[str]:
    """Where the activation terms were not checked against what autograd keeps (tests/test_memory_plan.py
    checks gpt2 with dense Q·K attention)."""
    notes = []
    if not model.attention.uses_qk:
        notes.append(f"{model.attention.type}: its N×N mixing is not modelled (the terms assume Q·K attention)")
    if model.attention.hadamard_qk:
        notes.append("hadamard Q/K: the fast transform's saved tensors are not modelled")
    if model.family == "llama":
        notes.append("llama: RMSNorm, SwiGLU and RoPE terms are counted as fused kernels keep them, not checked")
    return notes


def in_flight_micro_batches(stage: int, layout: Layout) -> int:
    """DeepSpeed's 1F1B schedule keeps min(stages − stage, micro-batches) forwards in flight (TrainSchedule)."""
    return 1 if layout.parallel.pipeline == 1 else min(layout.parallel.pipeline - stage, layout.grad_accum)


# ------------------------------------------------------------------ the plan
def layout_of(cfg: RunConfig, world_size: int) -> Layout:
    """The run's layout; config errors (naming the key) when the world size does not fit it."""
    grad_accum = validate_for_world(cfg, world_size)
    cfg = for_world(cfg, world_size)
    return Layout(parallel=ParallelLayout.of(cfg.parallel, world_size),
                  zero_stage=cfg.deepspeed.zero_stage, precision=cfg.deepspeed.precision,
                  micro_batch_size=cfg.train.micro_batch_size, grad_accum=grad_accum,
                  activation_checkpointing=cfg.speed.activation_checkpointing,
                  fp32_grad_accumulation=fp32_grad_accumulation(cfg.deepspeed, grad_accum))


def zero_config(cfg: RunConfig, layout: Layout) -> DeepSpeedZeroConfig:
    """The run's `zero_optimization` section with DeepSpeed's defaults filled in."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    return DeepSpeedZeroConfig(**deepspeed_config(cfg, layout.grad_accum)["zero_optimization"])


def stage_plan(model: ModelConfig, layout: Layout, zero: DeepSpeedZeroConfig, stage: int, specs: list[StageSpec],
               shards: list[Shard], gpu_memory_bytes: int) -> dict:
    layers = sum(spec.cls is DecoderLayerStage for spec in specs)
    first, last = stage == 0, stage == layout.parallel.pipeline - 1
    in_flight = in_flight_micro_batches(stage, layout)
    activations = {checkpointing: activation_bytes(model, layout, layers, first, last, in_flight, checkpointing)
                   for checkpointing in (False, True)}
    buffers = deepspeed_buffer_bytes(shards, layout, zero)
    terms = {**model_state_bytes(shards, layout, zero), "deepspeed_buffers": sum(buffers.values()),
             "activations": activations[layout.activation_checkpointing]}
    total = sum(terms.values())
    headroom = gpu_memory_bytes - total
    return {
        "pipeline_stage": stage,
        "layers": layers,
        "in_flight_micro_batches": in_flight,
        "trainable_params": sum(s.numel for s in shards if s.trainable),
        "frozen_params": sum(s.numel for s in shards if not s.trainable),
        "bytes": {**terms, "total": total},
        "deepspeed_buffers": buffers,
        "activations_without_checkpointing": activations[False],
        "activations_with_checkpointing": activations[True],
        "gpu_memory_bytes": gpu_memory_bytes,
        "headroom_bytes": headroom,
        "verdict": "fits" if headroom >= RESERVE_FRACTION * gpu_memory_bytes else "does not fit",
    }


def plan(cfg: RunConfig, world_size: int, gpu_memory_gb: float = 80.0) -> dict:
    """The memory plan of the rank holding the most (the pipeline stage with the largest total).

    Builds the model on the meta device: megatron's parallel state must be initialised (TP=1).
    """
    layout = layout_of(cfg, world_size)
    zero = zero_config(cfg, layout)
    gpu_memory = int(gpu_memory_gb * GIB)
    stages = pipeline_stages(cfg.model, cfg.parallel)
    plans = [stage_plan(cfg.model, layout, zero, k, specs, shards, gpu_memory)
             for k, (specs, shards) in enumerate(zip(stages, stage_shards(cfg, stages)))]
    return {"layout": layout.to_json(), **max(plans, key=lambda p: p["bytes"]["total"]),
            "activation_formula": ACTIVATION_FORMULA, "caveats": activation_caveats(cfg.model)}
