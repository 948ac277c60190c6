"""bf16 without ZeRO (DeepSpeed's unfused optimizer) trains exactly as bf16 under ZeRO-1; bf16 under ZeRO-1/2
skips a step with non-finite gradients."""

from __future__ import annotations

import math

import pytest
import torch
from model_fixtures import tiny_model, tokens

from ora_megatron.model_config import ModelConfig
from pretrain.config.loop_sections import TrainConfig
from pretrain.config.run_config import RunConfig
from pretrain.config.runtime_sections import DeepSpeedConfig, OptimizerConfig
from pretrain.runtime.ds_internals import base_optimizer
from pretrain.runtime.engine import build_engine
from pretrain.runtime.loss import lm_loss

pytestmark = pytest.mark.usefixtures("one_process_group")  # conftest.py: one gloo rank


def _losses(zero_stage: int, steps: int = 8) -> list[float]:
    cfg = RunConfig(
        model=ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=16, vocab_size=64,
                          hidden_dropout=0.0, attention_dropout=0.0),
        train=TrainConfig(micro_batch_size=4, global_batch_size=4, steps=steps),
        # No clipping: the two optimizers sum the gradient norm in different orders, so a clipped step
        # differs in its last bits (from step 6 here, depending on the process), which is not the claim.
        optimizer=OptimizerConfig(clip_grad=0.0),
        deepspeed=DeepSpeedConfig(zero_stage=zero_stage, precision="bf16"))
    torch.manual_seed(0)
    train_engine = build_engine(cfg, grad_accum=1)
    losses = []
    for step in range(steps):
        train_engine.scheduler.step(1)
        tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(step))
        loss = lm_loss(train_engine.ds_engine(tokens), (tokens, torch.ones_like(tokens)))
        train_engine.backward(loss, last_micro_batch=True)
        train_engine.ds_engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.slow
def test_bf16_zero0_trains_like_zero1():
    """DeepSpeed's unfused optimizer steps once with zero gradients when built, decaying its fp32
    copies and starting Adam's counts at 1 (ds_internals.undo_initial_zero_step takes that back)."""
    assert _losses(0) == _losses(1)


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [1, 2])
def test_bf16_zero_skips_nonfinite_steps_from_the_norm(zero_stage):
    """ZeRO-1/2 in bf16 run without DeepSpeed's pass over every gradient (bf16.check_grad_overflow off):
    the step's gradient norm decides (ds_internals.skip_nonfinite_steps_by_norm), at the first step too."""
    cfg = RunConfig(model=tiny_model("ora_qr"), train=TrainConfig(micro_batch_size=2, global_batch_size=2, steps=4),
                    deepspeed=DeepSpeedConfig(zero_stage=zero_stage, precision="bf16"))
    train_engine = build_engine(cfg, grad_accum=1)
    ds_engine = train_engine.ds_engine
    assert ds_engine.optimizer.check_grad_overflow is False

    def weights():
        return [p.detach().clone() for p in ds_engine.module.parameters() if p.requires_grad]

    def step(index, poisoned):
        train_engine.scheduler.step(1)
        batch = tokens(index)
        loss = lm_loss(ds_engine(batch), (batch, batch.new_ones(batch.shape)))
        train_engine.backward(loss * float("nan") if poisoned else loss, last_micro_batch=True)
        ds_engine.step()

    start = weights()
    step(0, poisoned=True)
    assert ds_engine.skipped_steps == 1 and all(torch.equal(a, b) for a, b in zip(start, weights()))
    assert not base_optimizer(ds_engine).state or all(not s for s in base_optimizer(ds_engine).state.values())
    step(1, poisoned=False)
    after_good = weights()
    assert ds_engine.skipped_steps == 1 and any(not torch.equal(a, b) for a, b in zip(start, after_good))
    step(2, poisoned=True)
    assert ds_engine.skipped_steps == 2 and all(torch.equal(a, b) for a, b in zip(after_good, weights()))
    step(3, poisoned=False)
    assert ds_engine.skipped_steps == 2 and all(torch.isfinite(p).all() for p in weights())
    assert math.isfinite(ds_engine.get_global_grad_norm())
