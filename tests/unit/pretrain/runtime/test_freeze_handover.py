"""Unfreezing Q/K mid-run keeps the Adam state of every weight that was already training."""

from __future__ import annotations

import pytest
import torch
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

from ora_megatron.attention import RandomQKVLinear
from ora_megatron.model_config import AttentionConfig, ModelConfig
from pretrain.config.freeze import FreezeConfig, FreezeStage
from pretrain.config.loop_sections import TrainConfig
from pretrain.config.run_config import RunConfig
from pretrain.config.runtime_sections import DeepSpeedConfig
from pretrain.runtime.ds_internals import base_optimizer, link_optimizer_fragments, whole_tensor_masters
from pretrain.runtime.engine import build_engine
from pretrain.runtime.freeze import apply_freeze_stage
from pretrain.runtime.loss import lm_loss

pytestmark = pytest.mark.usefixtures("one_process_group")  # conftest.py: one gloo rank


def _config(zero_stage: int, precision: str) -> RunConfig:
    return RunConfig(
        model=ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=16,
                          vocab_size=64, hidden_dropout=0.0, attention_dropout=0.0,
                          attention=AttentionConfig(type="ora")),
        train=TrainConfig(micro_batch_size=2, global_batch_size=2, steps=10),
        freeze=FreezeConfig(schedule=[FreezeStage(0.0, "all", "all"), FreezeStage(0.5, "none", "none")]),
        deepspeed=DeepSpeedConfig(zero_stage=zero_stage, precision=precision))


def _step(ds_engine) -> None:
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    ds_engine.backward(lm_loss(ds_engine(tokens), (tokens, torch.ones_like(tokens))))
    ds_engine.step()


def _moments_and_master(ds_engine, param) -> tuple[torch.Tensor, torch.Tensor]:
    masters = whole_tensor_masters(ds_engine)
    if masters is not None:
        master = masters[param]
        return base_optimizer(ds_engine).state[master]["exp_avg"].clone(), master.detach().clone()
    link_optimizer_fragments(ds_engine)
    return safe_get_full_optimizer_state(param, "exp_avg").clone(), safe_get_full_fp32_param(param).clone()


def _steps_by_group(ds_engine) -> dict:
    base = base_optimizer(ds_engine)
    return {g["name"]: base.state[g["params"][0]]["step"].item() for g in base.param_groups
            if "step" in base.state.get(g["params"][0], {})}


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage,precision", [(0, "fp32"), (1, "fp32"), (2, "fp32"), (0, "bf16"), (1, "bf16")])
def test_unfreeze_keeps_adam_state(zero_stage, precision):
    """bf16 without ZeRO steps fp32 copies of the weights (DeepSpeed's unfused optimizer): their
    moments and the copies themselves, finer than the bf16 weights, must carry over too."""
    cfg = _config(zero_stage, precision)
    train_engine = build_engine(cfg, grad_accum=1)
    for _ in range(3):
        _step(train_engine.ds_engine)
    linear = next(m for m in train_engine.module.modules() if isinstance(m, RandomQKVLinear))
    v_moment, v_master = _moments_and_master(train_engine.ds_engine, linear.v_weight)
    q_before = linear.q_weight.detach().clone()
    steps_before = _steps_by_group(train_engine.ds_engine)
    assert not linear.q_weight.requires_grad

    train_engine = apply_freeze_stage(cfg, train_engine, 1, grad_accum=1)

    assert linear.q_weight.requires_grad and linear.k_weight.requires_grad
    moment_after, master_after = _moments_and_master(train_engine.ds_engine, linear.v_weight)
    assert torch.equal(moment_after, v_moment) and torch.equal(master_after, v_master)
    assert {k: v for k, v in _steps_by_group(train_engine.ds_engine).items() if k in steps_before} == steps_before
    _step(train_engine.ds_engine)
    steps_after = _steps_by_group(train_engine.ds_engine)
    assert steps_after["decay/base"] == steps_before["decay/base"] + 1
    assert steps_after["decay/stage1"] == 1, "newly trainable weights start their own Adam count"
    assert not torch.equal(linear.q_weight.detach(), q_before), "unfrozen Q trains"
