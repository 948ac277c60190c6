"""DeepSpeed engine for a run: model assembly, optimizer groups, DeepSpeed JSON, LR schedule."""

from __future__ import annotations

import json
from dataclasses import dataclass

import deepspeed
import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from megatron.core import parallel_state
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

from ora_megatron.stages import DecoderLayerStage, StagedGPT, stage_specs
from pretrain.config import DS_CONFIG_DIR, RunConfig


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


def lm_loss(logits: torch.Tensor, labels_and_mask) -> torch.Tensor:
    """Mean next-token cross entropy over unmasked positions; logits are vocab-parallel [b, s, V/tp]."""
    labels, loss_mask = labels_and_mask
    losses = vocab_parallel_cross_entropy(logits.float(), labels)
    mask = loss_mask.float()
    return (losses * mask).sum() / mask.sum().clamp(min=1.0)


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
    """

    overflow = False

    def step(self, closure=None):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        bad = torch.tensor([float(any(not torch.isfinite(g).all() for g in grads))])
        torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
        self.overflow = bool(bad.item())
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
    })
    return merged


def _pipeline_module(cfg: RunConfig) -> PipelineModule:
    layers = []
    for spec in stage_specs(cfg.model, cfg.parallel):
        if spec.tied_key is not None:
            layers.append(TiedLayerSpec(spec.tied_key, spec.cls, forward_fn=spec.forward_fn,
                                        tied_weight_attr=["word_embeddings.weight"], **spec.kwargs))
        else:
            layers.append(LayerSpec(spec.cls, **spec.kwargs))
    world = torch.distributed.get_world_size()
    tp, pp = cfg.parallel.tensor, cfg.parallel.pipeline
    topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=world // (tp * pp))
    return PipelineModule(
        layers=layers, topology=topology, loss_fn=lm_loss, partition_method="type:DecoderLayerStage",
        activation_checkpoint_interval=1 if cfg.train.activation_checkpointing else 0,
        checkpointable_layers=[DecoderLayerStage.__name__])


@dataclass
class Engine:
    engine: deepspeed.DeepSpeedEngine
    scheduler: OptimizerParamScheduler
    pipelined: bool

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module


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
    optimizer = SkippingAdamW(param_groups(model, opt.weight_decay), lr=opt.lr,
                                  betas=(opt.beta1, opt.beta2), eps=opt.eps)
    pipelined = isinstance(model, PipelineModule)
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=deepspeed_config(cfg, grad_accum),
        mpu=None if pipelined else MegatronMPU())
    return Engine(engine=engine, scheduler=lr_scheduler(cfg, optimizer), pipelined=pipelined)


def link_optimizer_fragments(engine) -> None:
    """Point every parameter's ZeRO-1/2 (and bf16-optimizer) fragment at its optimizer state.

    DeepSpeed links fragments once, right after stepping the *first* parameter group, so the
    fragments of later groups stay empty and deepspeed.utils.safe_*_optimizer_state fails for
    them. Linking again after a step (every group then has state) repairs it.
    """
    optimizer = engine.optimizer
    if hasattr(optimizer, "_hp_optimizer_states_linked"):
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()


def lr_scheduler(cfg: RunConfig, optimizer) -> OptimizerParamScheduler:
    """megatron-core's warmup + cosine/linear decay to lr·min_lr_ratio (weight decay constant)."""
    opt = cfg.optimizer
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=opt.lr, min_lr=opt.lr * opt.min_lr_ratio,
        lr_warmup_steps=opt.warmup_steps, lr_decay_steps=opt.decay_steps or cfg.train.steps,
        lr_decay_style=opt.decay_style, start_wd=opt.weight_decay, end_wd=opt.weight_decay,
        wd_incr_steps=cfg.train.steps, wd_incr_style="constant")
