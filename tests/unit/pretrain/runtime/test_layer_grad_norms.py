"""Per-stage gradient norms (logging.layer_grad_norms) of a one-process engine: each stage's
gradients, and together DeepSpeed's norm of the whole step."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from deepspeed.runtime.utils import get_flattened_grad_norm
from model_fixtures import tokens
from one_process import tiny_run

from pretrain.config.loop_sections import TrainConfig
from pretrain.runtime.engine import MegatronMPU, build_engine
from pretrain.runtime.loss import lm_loss
from pretrain.runtime.metrics import layer_grad_norms, layer_grad_norms_due

pytestmark = pytest.mark.usefixtures("one_process_group")  # conftest.py: one gloo rank


def test_each_stage_norm_is_its_gradients_and_together_the_steps_norm():
    train_engine = build_engine(tiny_run("ora_qr"), grad_accum=1)
    batch = tokens(0)
    loss = lm_loss(train_engine.ds_engine(batch), (batch, batch.new_ones(batch.shape)))
    train_engine.backward(loss, last_micro_batch=True)
    norms = layer_grad_norms(train_engine)

    by_stage: dict[str, list[torch.Tensor]] = {}
    for name, param in train_engine.named_parameters():
        if param.requires_grad:
            by_stage.setdefault(name.split(".")[0], []).append(param.grad.flatten())
    # gpt2 ties the output head to the embedding: no stage of its own; frozen Q/K have no gradient.
    assert list(norms) == ["embedding", "layer1", "layer2", "final_norm"] == list(by_stage)
    for stage, grads in by_stage.items():
        assert norms[stage] == pytest.approx(torch.cat(grads).norm().item(), rel=1e-6)
    step_norm = float(get_flattened_grad_norm(train_engine.trainable, mpu=MegatronMPU()))
    assert math.sqrt(sum(n * n for n in norms.values())) == pytest.approx(step_norm, rel=1e-6)


def test_they_are_taken_at_log_interval_steps_when_asked_for():
    cfg = tiny_run(train=TrainConfig(micro_batch_size=2, global_batch_size=2, steps=20, log_interval=5))
    assert not any(layer_grad_norms_due(cfg.logging, 5, step) for step in range(1, 21)), "off by default"
    logging = dataclasses.replace(cfg.logging, layer_grad_norms=True)
    assert [step for step in range(1, 21) if layer_grad_norms_due(logging, 5, step)] == [5, 10, 15, 20]
