"""Freeze schedules: which layers' Q/K are frozen at which step, and the optimizer hand-over.

Changing the trainable set means a new DeepSpeed engine (ZeRO flattens its parameter groups at
initialisation). The hand-over keeps every already-trainable parameter's fp32 master weight,
Adam moments and its group's step count; newly trainable weights join in new groups of their own
(`optimizer_cohort`), starting their Adam state from zero, and frozen-again weights leave the
optimizer with their state.
"""

from __future__ import annotations

from typing import Callable

import torch
from deepspeed import DeepSpeedEngine

from ora_megatron.attention import RandomQKVLinear
from ora_megatron.model_config import ModelConfig
from pretrain.config.freeze import FreezeConfig
from pretrain.config.run_config import RunConfig
from pretrain.runtime.ds_internals import (
    base_optimizer,
    full_optimizer_state,
    link_optimizer_fragments,
    set_full_optimizer_state,
    whole_tensor_masters,
)
from pretrain.runtime.engine import TrainEngine, build_engine


def _layers(layer_set, num_layers: int) -> set[int]:
    if isinstance(layer_set, list):
        return set(layer_set)
    half = num_layers // 2
    return {"all": set(range(1, num_layers + 1)), "none": set(),
            "first_half": set(range(1, half + 1)),
            "second_half": set(range(half + 1, num_layers + 1))}[layer_set]


def trainability(model: ModelConfig, freeze: FreezeConfig, index: int) -> dict[tuple[int, str], bool]:
    """(layer, "q"|"k") → requires_grad for stage `index` (-1: the attention config's flags)."""
    att, n = model.attention, model.num_layers
    if index < 0:
        return {(layer, role): flag for layer in range(1, n + 1)
                for role, flag in (("q", att.train_q), ("k", att.train_k))}
    stage = freeze.stages[index]
    frozen = {"q": _layers(stage.frozen_q, n), "k": _layers(stage.frozen_k, n)}
    return {(layer, role): layer not in frozen[role] for layer in range(1, n + 1) for role in ("q", "k")}


def _trainability_changes(module: torch.nn.Module, wanted: dict) -> list[tuple[torch.nn.Parameter, bool]]:
    """The Q/K parameters whose requires_grad differs from `wanted`, with their new flag."""
    changes = []
    for linear in (m for m in module.modules() if isinstance(m, RandomQKVLinear)):
        for role in ("q", "k"):
            param = getattr(linear, f"{role}_weight")
            flag = wanted[(linear.layer_number, role)]
            if param.requires_grad != flag:
                changes.append((param, flag))
    return changes


def _capture(ds_engine: DeepSpeedEngine) -> tuple[dict, dict]:
    """Per trainable parameter: fp32 master and Adam moments; per group name: Adam step."""
    per_param = {}
    base = base_optimizer(ds_engine)
    if not base.state:  # before the first step (on every rank alike): nothing to carry
        return {}, {}
    link_optimizer_fragments(ds_engine)
    masters = whole_tensor_masters(ds_engine)
    for param in (p for p in ds_engine.module.parameters() if p.requires_grad):
        state = full_optimizer_state(ds_engine, param, masters)
        if all(v is not None for v in state.values()):
            per_param[id(param)] = {k: v.detach().cpu().clone() for k, v in state.items()}
    steps = {}
    for group in base.param_groups:
        first = group["params"][0]
        if first in base.state and "step" in base.state[first]:
            steps[group["name"]] = base.state[first]["step"].clone()
    return per_param, steps


def _restore(ds_engine: DeepSpeedEngine, per_param: dict, steps: dict) -> None:
    base = base_optimizer(ds_engine)
    masters = whole_tensor_masters(ds_engine)
    for group in base.param_groups:
        if group["name"] not in steps:
            continue
        for flat in group["params"]:  # lazily created by torch; create it with the carried step
            base.state[flat] = {"step": steps[group["name"]].clone(),
                                "exp_avg": torch.zeros_like(flat), "exp_avg_sq": torch.zeros_like(flat)}
    if masters is None:
        link_optimizer_fragments(ds_engine)  # to the state just created
    for param in ds_engine.module.parameters():
        carried = per_param.get(id(param))
        if carried is None or not param.requires_grad:
            continue
        # fp32 masters too: a new bf16/fp16 engine copied its own from the rounded weights
        set_full_optimizer_state(ds_engine, param, carried, masters)


def apply_freeze_stage(cfg: RunConfig, train_engine: TrainEngine, index: int, grad_accum: int,
                       step_veto: Callable[[], bool] | None = None):
    """Set Q/K trainability for stage `index`; rebuild the engine if the trainable set changed (with
    `step_veto`, as build_engine takes it)."""
    module = train_engine.module
    changes = _trainability_changes(module, trainability(cfg.model, cfg.freeze, index))
    if not changes:
        return train_engine
    per_param, steps = _capture(train_engine.ds_engine)
    for param, flag in changes:
        param.requires_grad_(flag)
        param.optimizer_cohort = f"stage{index}"  # its own Adam step count
    scheduler_state = train_engine.scheduler.state_dict()
    train_engine.ds_engine.destroy()  # drop the old ZeRO gradient hooks before a new engine adds its own
    new = build_engine(cfg, grad_accum, model=module, step_veto=step_veto)
    new.scheduler.load_state_dict(scheduler_state)
    _restore(new.ds_engine, per_param, steps)
    return new
