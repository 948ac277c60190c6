"""DeepSpeed engine for a run: model assembly and the `TrainEngine` around DeepSpeed's (its JSON: ds_config.py).

The model is the stage list of ora_megatron.stages, assembled as a plain module (pipeline size 1)
or as `PipelinedGPT` (pipeline size > 1); both name parameters `{stage name}.{parameter}`. The loss
is pretrain.runtime.loss, the optimizer and LR schedule pretrain.runtime.optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

import deepspeed
import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from megatron.core import parallel_state
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from ora_megatron.attention import settle_hadamard_paths_eagerly
from ora_megatron.stages import DecoderLayerStage, StagedGPT, StageSpec, owner_names, stage_specs
from pretrain.config.run_config import RunConfig
from pretrain.job.parallel_layout import ParallelLayout
from pretrain.runtime.ds_config import deepspeed_config
from pretrain.runtime.ds_internals import (
    base_optimizer,
    keep_fp32_clip_norm,
    skip_nonfinite_steps_by_norm,
    undo_initial_zero_step,
)
from pretrain.runtime.loss import lm_loss
from pretrain.runtime.optimizer import build_optimizer, lr_scheduler
from pretrain.runtime.step_guard import guard_steps


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


def _pipeline_module(cfg: RunConfig, layout: ParallelLayout) -> PipelinedGPT:
    specs = stage_specs(cfg.model, cfg.parallel)
    topology = PipeModelDataParallelTopology(num_pp=layout.pipeline, num_mp=layout.tensor, num_dp=layout.data)
    return PipelinedGPT(
        specs, topology=topology, loss_fn=lm_loss, partition_method="type:DecoderLayerStage",
        activation_checkpoint_interval=1 if cfg.speed.activation_checkpointing else 0,
        checkpointable_layers=[DecoderLayerStage.__name__])


@dataclass
class TrainEngine:
    """A run's DeepSpeed engine (`ds_engine`: a PipelineEngine when pipelined) with its LR schedule
    and what the training loop needs to know about the layout."""

    ds_engine: deepspeed.DeepSpeedEngine
    scheduler: OptimizerParamScheduler
    pipelined: bool
    layout: ParallelLayout
    # One data-parallel rank, ZeRO-0, fp32, no pipeline: DeepSpeed's gradient all-reduce is an
    # identity there (a sum over one rank, divided by 1), so `backward` leaves it out.
    single_replica: bool = False
    trainable: list[torch.nn.Parameter] = field(default_factory=list)
    # ZeRO-0 in fp32 without clipping: the one layout where DeepSpeed computes no gradient norm.
    reports_no_grad_norm: bool = False

    @property
    def module(self) -> torch.nn.Module:
        return self.ds_engine.module

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """This rank's parameters under their stage names, in either assembly."""
        for name, param in self.module.named_parameters():
            yield (self.module.stage_name(name) if self.pipelined else name), param

    def backward(self, loss: torch.Tensor, last_micro_batch: bool) -> None:
        """`ds_engine.backward(loss)` of a plain (not pipelined) engine.

        With a single replica the all-reduce is skipped through DeepSpeed's public `no_sync()`
        (allowed under ZeRO-0; `step()` is called outside it). Skipping the flatten, the
        one-rank collective and the copy back leaves every gradient bitwise the same; its one side
        effect, a zero gradient for a trainable weight that received none (DeepSpeed's
        `_get_gradients_for_reduction`, at the accumulation boundary), is kept here so the optimizer
        sees the same gradients.
        """
        if not self.single_replica:
            self.ds_engine.backward(loss)
            return
        with self.ds_engine.no_sync():
            self.ds_engine.backward(loss)
        if last_micro_batch:
            for param in self.trainable:
                if param.grad is None and param.numel() > 0:
                    param.grad = torch.zeros(param.size(), dtype=param.dtype, device=param.device)


def compile_model(model: torch.nn.Module, backend: str | Callable = "inductor", cuda_graphs: bool = False) -> None:
    """torch.compile each transformer layer, in place: its parameters keep their names (no
    `_orig_mod.`), so checkpoints and exports are those of the eager model; and the loss.

    Each layer is one graph, without a break (ora_megatron.stages substitutes megatron-core's
    make_viewless_tensor; frozen Hadamard Q/K are traced as plain ops, their path settled eagerly),
    so its norms, activation and bias-dropout-adds fuse. `backend`: torch.compile's (a cheaper one
    counts the graphs dynamo makes, which do not depend on it). `cuda_graphs` (speed.cuda_graphs):
    mode "reduce-overhead", each graph captured once and replayed as a CUDA graph."""
    settle_hadamard_paths_eagerly(model)
    mode = "reduce-overhead" if cuda_graphs else None
    for module in model.modules():
        if isinstance(module, DecoderLayerStage):
            module.compile(backend=backend, mode=mode)
    name = "loss_fn" if isinstance(model, PipelineModule) else "fused_loss"
    loss = torch.compile(getattr(model, name), backend=backend, mode=mode)
    if cuda_graphs:
        # CUDA graph replays reuse their outputs' memory: each micro-batch's forward starts a new replay, and
        # the loss a trainer keeps across micro-batches is copied out of the graphs' pool.
        model.register_forward_pre_hook(lambda module, args: torch.compiler.cudagraph_mark_step_begin())
        setattr(model, name, lambda *args: loss(*args).clone())
    else:
        setattr(model, name, loss)


def build_model(cfg: RunConfig, layout: ParallelLayout) -> torch.nn.Module:
    # DeepSpeed's comm layer wraps the existing torch process group (PipelineModule needs it).
    deepspeed.init_distributed(dist_backend=torch.distributed.get_backend())
    if layout.pipeline > 1:
        model = _pipeline_module(cfg, layout)
    else:
        model = StagedGPT(stage_specs(cfg.model, cfg.parallel))
        model.activation_checkpointing = cfg.speed.activation_checkpointing
    if cfg.speed.compile:
        compile_model(model, cuda_graphs=cfg.speed.cuda_graphs)
    return model


def build_engine(cfg: RunConfig, grad_accum: int, model: torch.nn.Module | None = None,
                 step_veto: Callable[[], bool] | None = None) -> TrainEngine:
    """The run's engine around `model` (default: built from the config). `step_veto`: asked before each
    torch optimizer step, which it skips when it says so (the training loop's step guard); it decides
    before the engine's own guards."""
    layout = ParallelLayout.of(cfg.parallel, torch.distributed.get_world_size())
    model = model if model is not None else build_model(cfg, layout)
    opt = cfg.optimizer
    fp32_zero0 = cfg.deepspeed.zero_stage == 0 and cfg.deepspeed.precision == "fp32"
    optimizer = build_optimizer(model, opt, decides_skips=fp32_zero0)
    pipelined = isinstance(model, PipelineModule)
    ds_engine, optimizer, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=deepspeed_config(cfg, grad_accum),
        mpu=None if pipelined else MegatronMPU())
    undo_initial_zero_step(ds_engine)
    skip_nonfinite_steps_by_norm(ds_engine)
    if fp32_zero0 and opt.clip_grad > 0:  # DeepSpeed clips in the engine and steps SkippingAdamW directly
        keep_fp32_clip_norm(ds_engine, ds_engine.optimizer.record_clip_norm)
    if step_veto is not None:
        guard_steps(base_optimizer(ds_engine), step_veto)
    single_replica = fp32_zero0 and not pipelined and layout.data == 1
    return TrainEngine(ds_engine=ds_engine, scheduler=lr_scheduler(cfg, optimizer), pipelined=pipelined,
                       layout=layout, single_replica=single_replica,
                       trainable=[p for p in model.parameters() if p.requires_grad],
                       reports_no_grad_norm=fp32_zero0 and opt.clip_grad <= 0)
