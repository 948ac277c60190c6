"""A one-process job clips its gradients with torch's foreach clipping: what DeepSpeed's computes."""

from __future__ import annotations

import pytest
import torch
from deepspeed.runtime.utils import clip_grad_norm_

from ora_megatron.model_config import ModelConfig
from pretrain.config.loop_sections import TrainConfig
from pretrain.config.run_config import RunConfig
from pretrain.config.runtime_sections import OptimizerConfig
from pretrain.runtime.ds_internals import keep_fp32_clip_norm
from pretrain.runtime.engine import build_engine
from pretrain.runtime.loss import lm_loss

pytestmark = pytest.mark.usefixtures("one_process_group")  # conftest.py: one gloo rank


@pytest.mark.parametrize("max_norm", [0.05, 1e6], ids=["clipping", "not-clipping"])
def test_one_process_clipping_equals_deepspeeds(max_norm):
    cfg = RunConfig(model=ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=16,
                                      vocab_size=64, hidden_dropout=0.0, attention_dropout=0.0),
                    train=TrainConfig(micro_batch_size=2, global_batch_size=2, steps=10),
                    optimizer=OptimizerConfig(clip_grad=max_norm))
    train_engine = build_engine(cfg, grad_accum=1)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = lm_loss(train_engine.ds_engine(tokens), (tokens, torch.ones_like(tokens)))
    train_engine.backward(loss, last_micro_batch=True)
    params = [p for p in train_engine.module.parameters() if p.grad is not None]
    grads = [p.grad.clone() for p in params]

    recorded = []
    keep_fp32_clip_norm(train_engine.ds_engine, lambda norm, covers_local: recorded.append((norm, covers_local)))
    train_engine.ds_engine.clip_fp32_gradients()  # what the engine calls before the optimizer step
    ours = [p.grad.clone() for p in params]
    for p, g in zip(params, grads):
        p.grad.copy_(g)
    deepspeed_norm = clip_grad_norm_(parameters=params, max_norm=max_norm, mpu=train_engine.ds_engine.mpu)

    (norm, covers_local), = recorded
    assert covers_local
    torch.testing.assert_close(norm, deepspeed_norm.reshape(norm.shape), rtol=1e-6, atol=0)
    for mine, theirs in zip(ours, (p.grad for p in params)):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=0)
    clipped = any(not torch.equal(mine, g) for mine, g in zip(ours, grads))
    assert clipped == (norm.item() > max_norm)
