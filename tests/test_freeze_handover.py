"""Unfreezing Q/K mid-run keeps the Adam state of every weight that was already training."""

from __future__ import annotations

import pytest
import torch
from deepspeed.utils import safe_get_full_optimizer_state

from ora_megatron.attention import RandomQKVLinear
from ora_megatron.model_config import AttentionConfig, ModelConfig
from ora_megatron.parallel import destroy_distributed, init_distributed
from pretrain.config import DeepSpeedConfig, FreezeStage, RunConfig, TrainConfig
from pretrain.ds_internals import base_optimizer, link_optimizer_fragments
from pretrain.engine import build_engine, lm_loss
from pretrain.freeze import apply_freeze_stage


@pytest.fixture(scope="module", autouse=True)
def one_process_group():
    init_distributed(1, 1, backend="gloo")
    yield
    destroy_distributed()


def _config(zero_stage: int) -> RunConfig:
    return RunConfig(
        model=ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=16,
                          vocab_size=64, hidden_dropout=0.0, attention_dropout=0.0,
                          attention=AttentionConfig(type="ora")),
        train=TrainConfig(micro_batch_size=2, global_batch_size=2, steps=10,
                          freeze_schedule=[FreezeStage(0.0, "all", "all"), FreezeStage(0.5, "none", "none")]),
        deepspeed=DeepSpeedConfig(zero_stage=zero_stage))


def _step(engine) -> None:
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    engine.backward(lm_loss(engine(tokens), (tokens, torch.ones_like(tokens))))
    engine.step()


def _moments(engine, param) -> torch.Tensor:
    if engine.optimizer is base_optimizer(engine):
        return engine.optimizer.state[param]["exp_avg"].clone()
    link_optimizer_fragments(engine)
    return safe_get_full_optimizer_state(param, "exp_avg").clone()


def _steps_by_group(engine) -> dict:
    base = base_optimizer(engine)
    return {g["name"]: base.state[g["params"][0]]["step"].item() for g in base.param_groups
            if "step" in base.state.get(g["params"][0], {})}


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [0, 1, 2])
def test_unfreeze_keeps_adam_state(zero_stage):
    cfg = _config(zero_stage)
    eng = build_engine(cfg, grad_accum=1)
    for _ in range(3):
        _step(eng.engine)
    linear = next(m for m in eng.module.modules() if isinstance(m, RandomQKVLinear))
    v_moment = _moments(eng.engine, linear.v_weight)
    q_before = linear.q_weight.detach().clone()
    steps_before = _steps_by_group(eng.engine)
    assert not linear.q_weight.requires_grad

    eng = apply_freeze_stage(cfg, eng, 1, grad_accum=1)

    assert linear.q_weight.requires_grad and linear.k_weight.requires_grad
    assert torch.equal(_moments(eng.engine, linear.v_weight), v_moment)
    assert {k: v for k, v in _steps_by_group(eng.engine).items() if k in steps_before} == steps_before
    _step(eng.engine)
    steps_after = _steps_by_group(eng.engine)
    assert steps_after["decay/base"] == steps_before["decay/base"] + 1
    assert steps_after["decay/stage1"] == 1, "newly trainable weights start their own Adam count"
    assert not torch.equal(linear.q_weight.detach(), q_before), "unfrozen Q trains"
