"""DeepSpeed engine for a run: model assembly, optimizer groups, DeepSpeed JSON, LR schedule.

The model is the stage list of ora_megatron.stages, assembled as a plain module (pipeline size 1)
or as `PipelinedGPT` (pipeline size > 1); both name parameters `{stage name}.{parameter}`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterator

import deepspeed
import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from megatron.core import parallel_state
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

from ora_megatron.stages import DecoderLayerStage, StagedGPT, StageSpec, owner_names, stage_specs
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


def batch_loss(engine, batch: dict) -> torch.Tensor:
    """Loss of one micro-batch through a plain (not pipelined) engine."""
    # DeepSpeed's plain engine does not move inputs (its pipeline engine does); batches are host tensors.
    tokens, labels, loss_mask = (batch[k].to(engine.device, non_blocking=True)
                                 for k in ("tokens", "labels", "loss_mask"))
    return lm_loss(engine(tokens), (labels, loss_mask))


def data_parallel_mean(value: torch.Tensor) -> float:
    """Mean of a per-rank scalar over the data-parallel group (every rank gets it)."""
    torch.distributed.all_reduce(value, group=parallel_state.get_data_parallel_group())
    return value.item() / parallel_state.get_data_parallel_world_size()


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

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """This rank's parameters under their stage names, in either assembly."""
        for name, param in self.module.named_parameters():
            yield (self.module.stage_name(name) if self.pipelined else name), param


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


def lr_scheduler(cfg: RunConfig, optimizer) -> OptimizerParamScheduler:
    """megatron-core's warmup + cosine/linear decay to lr·min_lr_ratio (weight decay constant)."""
    opt = cfg.optimizer
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=opt.lr, min_lr=opt.lr * opt.min_lr_ratio,
        lr_warmup_steps=opt.warmup_steps, lr_decay_steps=opt.decay_steps or cfg.train.steps,
        lr_decay_style=opt.decay_style, start_wd=opt.weight_decay, end_wd=opt.weight_decay,
        wd_incr_steps=cfg.train.steps, wd_incr_style="constant")
