"""`speed.compile`: the compiled layers and loss train the model the eager ones train (fp32, CPU),
under the same parameter names, and the layout it is not supported in is refused before any worker
starts."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from model_fixtures import tokens
from one_process import tiny_run

from ora_megatron.config_io import ConfigError, from_dict, to_dict
from pretrain.config.loop_sections import TrainConfig
from pretrain.config.run_config import RunConfig
from pretrain.config.runtime_sections import SpeedConfig
from pretrain.runtime.engine import build_engine

pytestmark = pytest.mark.usefixtures("one_process_group")  # conftest.py: one gloo rank

STEPS = 8


def train_losses(compile_layers: bool) -> tuple[list[float], list[str]]:
    cfg = tiny_run(train=TrainConfig(micro_batch_size=2, global_batch_size=2, steps=STEPS),
                   speed=SpeedConfig(compile=compile_layers))
    torch.manual_seed(0)
    train_engine = build_engine(cfg, grad_accum=1)
    losses = []
    for step in range(STEPS):
        train_engine.scheduler.step(1)
        batch = tokens(step)
        loss = train_engine.ds_engine(batch, (batch, torch.ones_like(batch)))  # the fused loss, compiled too
        train_engine.backward(loss, last_micro_batch=True)
        train_engine.ds_engine.step()
        losses.append(loss.item())
    return losses, [name for name, _ in train_engine.named_parameters()]


@pytest.mark.slow  # inductor compiles the layer's kernels with the C++ compiler: tens of seconds
def test_compiled_layers_train_like_eager_ones():
    eager, eager_names = train_losses(compile_layers=False)
    compiled, compiled_names = train_losses(compile_layers=True)
    assert compiled_names == eager_names  # checkpoints and exports see the eager model's names
    assert eager[-1] < eager[0]
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-5, atol=0)


def test_compile_with_zero3_is_refused_naming_the_key():
    cfg = tiny_run()
    data = to_dict(dataclasses.replace(cfg, speed=SpeedConfig(compile=True)))
    data["deepspeed"]["zero_stage"] = 3
    with pytest.raises(ConfigError, match="speed.compile"):
        from_dict(RunConfig, data)
