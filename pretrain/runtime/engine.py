"""DeepSpeed engine for a run: model assembly, optimizer groups, DeepSpeed JSON, LR schedule.

The model is the stage list of ora_megatron.stages, assembled as a plain module (pipeline size 1)
or as `PipelinedGPT` (pipeline size > 1); both name parameters `{stage name}.{parameter}`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Iterator, Optional

import deepspeed
import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from megatron.core import parallel_state
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy, vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.utils import VocabUtility

from ora_megatron.stages import DecoderLayerStage, StagedGPT, StageSpec, owner_names, stage_specs
from pretrain.config import DS_CONFIG_DIR, RunConfig
from pretrain.runtime.ds_internals import keep_fp32_clip_norm, undo_initial_zero_step


class MegatronMPU:
    """megatron-core's parallel state under the names DeepSpeed's `mpu` argument expects.

    DeepSpeed's "model parallel" is Megatron's tensor parallel (pipeline stages are handled by
    DeepSpeed's own topology when pipeline parallelism is on).
    """

    get_model_parallel_group = staticmethod(parallel_state.get_tensor_model_parallel_group)
    get_model_parallel_rank = staticmethod(parallel_state.get_tensor_model_parallel_rank)
    get_model_parallel_world_size = staticmethod(parallel_state.get_tensor_model_parallel_world_size)
    get_tensor_model_parallel_group = staticmethod(parallel_state.get_tensor_model_parallel_group)
    get_tensor_model_parallel_rank = staticmethod(parallel_state.get_tensor_model_parallel_rank)
    get_tensor_model_parallel_world_size = staticmethod(parallel_state.get_tensor_model_parallel_world_size)
    get_tensor_model_parallel_src_rank = staticmethod(parallel_state.get_tensor_model_parallel_src_rank)
    get_data_parallel_group = staticmethod(parallel_state.get_data_parallel_group)
    get_data_parallel_rank = staticmethod(parallel_state.get_data_parallel_rank)
    get_data_parallel_world_size = staticmethod(parallel_state.get_data_parallel_world_size)


class _OneRankCrossEntropy(torch.autograd.Function):
    """megatron-core's vocab-parallel cross entropy (`_VocabParallelCrossEntropy`, no label smoothing)
    for a tensor-parallel group of one rank: the same `VocabParallelCrossEntropy` steps, without its
    three all-reduces (a max and two sums over one rank leave every value as it is). On CPU each of
    them is a round trip through gloo's worker thread, which waits for a core behind the OpenMP
    threads' spin-wait (~0.2 ms each on two cores)."""

    @staticmethod
    def forward(ctx, vocab_logits, target):
        vocab_logits, logits_max = VocabParallelCrossEntropy.calculate_logits_max(vocab_logits)
        start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(vocab_logits.size(-1), 0, 1)
        target_mask, masked_target_1d, predicted_logits, sum_exp_logits, exp_logits = (
            VocabParallelCrossEntropy.calculate_predicted_logits(vocab_logits, target, logits_max, start, end))
        softmax, loss = VocabParallelCrossEntropy.calculate_cross_entropy_loss(
            exp_logits, predicted_logits, sum_exp_logits)
        ctx.save_for_backward(softmax, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        grad_2d, arange_1d, softmax_update, grad_input = (
            VocabParallelCrossEntropy.prepare_gradient_calculation_operands(softmax, target_mask))
        return VocabParallelCrossEntropy.calculate_gradients(
            grad_2d, arange_1d, masked_target_1d, softmax_update, grad_input, grad_output), None


def lm_loss(logits: torch.Tensor, labels_and_mask) -> torch.Tensor:
    """Mean next-token cross entropy over unmasked positions; logits are vocab-parallel [b, s, V/tp]."""
    labels, loss_mask = labels_and_mask
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        losses = _OneRankCrossEntropy.apply(logits.float(), labels)
    else:
        losses = vocab_parallel_cross_entropy(logits.float(), labels)
    mask = loss_mask.float()
    return (losses * mask).sum() / mask.sum().clamp(min=1.0)


def batch_loss(engine, batch: dict) -> torch.Tensor:
    """Loss of one micro-batch through a plain (not pipelined) engine."""
    # DeepSpeed's plain engine does not move inputs (its pipeline engine does); batches are host tensors.
    tokens, labels, loss_mask = (batch[k].to(engine.device, non_blocking=True)
                                 for k in ("tokens", "labels", "loss_mask"))
    return lm_loss(engine(tokens), (labels, loss_mask))


def data_parallel_mean(value: torch.Tensor) -> float:
    """Mean of a per-rank scalar over the data-parallel group (every rank gets it)."""
    size = parallel_state.get_data_parallel_world_size()
    if size > 1:  # over one rank the sum is the value itself: no collective
        torch.distributed.all_reduce(value, group=parallel_state.get_data_parallel_group())
    return value.item() / size


def _no_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    return param.ndim < 2 or "embedding" in name or "norm" in name


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups of the trainable parameters only; frozen ones never reach the optimizer.

    Groups are (decay or not) × cohort: weights unfrozen by a freeze schedule carry an
    `optimizer_cohort` so that their Adam step count is their own. `wd_mult` is read by megatron's
    OptimizerParamScheduler when it sets each group's decay. No group is empty (DeepSpeed
    ZeRO-1/2 crash on empty groups, upstream #4055/#5071).
    """
    groups: dict[str, dict] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        decay = not _no_weight_decay(name, param)
        key = f"{'decay' if decay else 'no_decay'}/{getattr(param, 'optimizer_cohort', 'base')}"
        group = groups.setdefault(key, {"params": [], "name": key, "wd_mult": 1.0 if decay else 0.0,
                                        "weight_decay": weight_decay if decay else 0.0})
        group["params"].append(param)
    return list(groups.values())


class SkippingAdamW(torch.optim.AdamW):
    """AdamW that skips a step whose gradients are not finite on every rank.

    DeepSpeed's ZeRO and mixed-precision optimizers already skip such steps; with ZeRO-0 in fp32
    the engine steps this optimizer directly and counts a skip when `overflow` is set.

    Under ZeRO-0 in fp32 DeepSpeed clips the gradients right before this step, and the total norm
    it clipped with is handed over here (`record_clip_norm`): a finite norm that summed every local
    gradient proves them all finite, so the per-tensor check (one reduction and one host sync per
    tensor) runs only when the norm is not finite (or unknown) — the same decision as checking
    every tensor each step. The norm is also DeepSpeed's `get_global_grad_norm()` (read from
    `_global_grad_norm` after the step), which it otherwise leaves empty under ZeRO-0.
    """

    overflow = False
    _global_grad_norm: Optional[torch.Tensor] = None
    _pending_norm: Optional[torch.Tensor] = None
    _grads_known_finite = False

    def record_clip_norm(self, norm: torch.Tensor, covers_local_grads: bool) -> None:
        """The total gradient norm clipping computed for this step; `covers_local_grads`: it summed
        every gradient this rank holds (DeepSpeed leaves replicated weights out on TP ranks > 0)."""
        self._pending_norm = norm
        self._grads_known_finite = covers_local_grads and bool(torch.isfinite(norm).all())

    def step(self, closure=None):
        # Consumed once: a norm recorded for an earlier step never vouches for this one.
        self._global_grad_norm, self._pending_norm = self._pending_norm, None
        known_finite, self._grads_known_finite = self._grads_known_finite, False
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        bad = not known_finite and any(not torch.isfinite(g).all() for g in grads)
        if torch.distributed.get_world_size() > 1:  # every rank skips together
            flag = torch.tensor([float(bad)])
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            bad = bool(flag.item())
        self.overflow = bad
        if self.overflow:
            self.zero_grad(set_to_none=True)
            return None
        return super().step(closure)


def deepspeed_config(cfg: RunConfig, grad_accum: int) -> dict:
    """ds_configs/zero{N}.json + ds_configs/{precision}.json + batch/clip from the run config."""
    merged = {}
    for name in (f"zero{cfg.deepspeed.zero_stage}.json", f"{cfg.deepspeed.precision}.json"):
        merged.update(json.loads((DS_CONFIG_DIR / name).read_text()))
    merged.update({
        "train_batch_size": cfg.train.global_batch_size,
        "train_micro_batch_size_per_gpu": cfg.train.micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": cfg.optimizer.clip_grad,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        # Its samples/s timer (on by default) synchronizes the device at every forward and step;
        # throughput is measured by the metrics logger instead.
        "timers": {"throughput": {"enabled": False}},
    })
    return merged


class PipelinedGPT(PipelineModule):
    """DeepSpeed's PipelineModule over the stage list.

    DeepSpeed names a stage's parameters by its index in the list (`3.layer.…`) and tied modules
    by key (`tied_modules.embedding.…`), and saves each stage as `layer_{index:02d}-…` files;
    `stage_name` maps both back to the stage names the plain module uses.
    """

    def __init__(self, specs: list[StageSpec], **kwargs):
        layers = []
        for spec in specs:
            if spec.tied_key is not None:
                layers.append(TiedLayerSpec(spec.tied_key, spec.cls, forward_fn=spec.forward_fn,
                                            tied_weight_attr=["word_embeddings.weight"], **spec.kwargs))
            else:
                layers.append(LayerSpec(spec.cls, **spec.kwargs))
        super().__init__(layers=layers, **kwargs)
        self.stage_names = [spec.name for spec in specs]
        self.tied_owners = owner_names(specs)

    def stage_name(self, name: str) -> str:
        """DeepSpeed's parameter name → `{stage name}.{parameter}`."""
        head, _, rest = name.partition(".")
        if head == "tied_modules":
            key, _, rest = rest.partition(".")
            return f"{self.tied_owners[key]}.{rest}"
        return f"{self.stage_names[int(head)]}.{rest}"

    def is_tied_replica(self, name: str) -> bool:
        """A tied module's copy on a later stage (the first stage holding it owns the weights)."""
        return name.startswith("tied_modules.") and self.stage_id != 0


def _pipeline_module(cfg: RunConfig) -> PipelinedGPT:
    world = torch.distributed.get_world_size()
    tp, pp = cfg.parallel.tensor, cfg.parallel.pipeline
    topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=world // (tp * pp))
    return PipelinedGPT(
        stage_specs(cfg.model, cfg.parallel), topology=topology, loss_fn=lm_loss,
        partition_method="type:DecoderLayerStage",
        activation_checkpoint_interval=1 if cfg.train.activation_checkpointing else 0,
        checkpointable_layers=[DecoderLayerStage.__name__])


@dataclass
class Engine:
    engine: deepspeed.DeepSpeedEngine
    scheduler: OptimizerParamScheduler
    pipelined: bool
    # One data-parallel rank, ZeRO-0, fp32, no pipeline: DeepSpeed's gradient all-reduce is an
    # identity there (a sum over one rank, divided by 1), so `backward` leaves it out.
    single_replica: bool = False
    trainable: list[torch.nn.Parameter] = field(default_factory=list)
    # ZeRO-0 in fp32 without clipping: the one layout where DeepSpeed computes no gradient norm.
    reports_no_grad_norm: bool = False

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """This rank's parameters under their stage names, in either assembly."""
        for name, param in self.module.named_parameters():
            yield (self.module.stage_name(name) if self.pipelined else name), param

    def backward(self, loss: torch.Tensor, last_micro_batch: bool) -> None:
        """`engine.backward(loss)` of a plain (not pipelined) engine.

        With a single replica the all-reduce is skipped through DeepSpeed's public `no_sync()`
        (allowed under ZeRO-0; `step()` is called outside it). Skipping the flatten, the
        one-rank collective and the copy back leaves every gradient bitwise the same; its one side
        effect, a zero gradient for a trainable weight that received none (DeepSpeed's
        `_get_gradients_for_reduction`, at the accumulation boundary), is kept here so the optimizer
        sees the same gradients.
        """
        if not self.single_replica:
            self.engine.backward(loss)
            return
        with self.engine.no_sync():
            self.engine.backward(loss)
        if last_micro_batch:
            for param in self.trainable:
                if param.grad is None and param.numel() > 0:
                    param.grad = torch.zeros(param.size(), dtype=param.dtype, device=param.device)


def build_model(cfg: RunConfig) -> torch.nn.Module:
    # DeepSpeed's comm layer wraps the existing torch process group (PipelineModule needs it).
    deepspeed.init_distributed(dist_backend=torch.distributed.get_backend())
    if cfg.parallel.pipeline > 1:
        return _pipeline_module(cfg)
    model = StagedGPT(stage_specs(cfg.model, cfg.parallel))
    model.activation_checkpointing = cfg.train.activation_checkpointing
    return model


def build_engine(cfg: RunConfig, grad_accum: int, model: torch.nn.Module | None = None) -> Engine:
    model = model if model is not None else build_model(cfg)
    opt = cfg.optimizer
    # foreach: the same update, tensor by tensor in C++ rather than in Python (torch picks it on
    # CUDA by itself, not on CPU, where the per-tensor loop costs more than the arithmetic).
    optimizer = SkippingAdamW(param_groups(model, opt.weight_decay), lr=opt.lr,
                              betas=(opt.beta1, opt.beta2), eps=opt.eps, foreach=True)
    pipelined = isinstance(model, PipelineModule)
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=deepspeed_config(cfg, grad_accum),
        mpu=None if pipelined else MegatronMPU())
    undo_initial_zero_step(engine)
    fp32_zero0 = cfg.deepspeed.zero_stage == 0 and cfg.deepspeed.precision == "fp32"
    if fp32_zero0 and opt.clip_grad > 0:  # DeepSpeed clips in the engine and steps SkippingAdamW directly
        keep_fp32_clip_norm(engine, engine.optimizer.record_clip_norm)
    single_replica = fp32_zero0 and not pipelined and parallel_state.get_data_parallel_world_size() == 1
    return Engine(engine=engine, scheduler=lr_scheduler(cfg, optimizer), pipelined=pipelined,
                  single_replica=single_replica, trainable=[p for p in model.parameters() if p.requires_grad],
                  reports_no_grad_norm=fp32_zero0 and opt.clip_grad <= 0)


def lr_scheduler(cfg: RunConfig, optimizer) -> OptimizerParamScheduler:
    """megatron-core's warmup + cosine/linear decay to lr·min_lr_ratio (weight decay constant)."""
    opt = cfg.optimizer
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=opt.lr, min_lr=opt.lr * opt.min_lr_ratio,
        lr_warmup_steps=opt.warmup_steps, lr_decay_steps=opt.decay_steps or cfg.train.steps,
        lr_decay_style=opt.decay_style, start_wd=opt.weight_decay, end_wd=opt.weight_decay,
        wd_incr_steps=cfg.train.steps, wd_incr_style="constant")
