"""`speed.compile`: the compiled layers and loss train the model the eager ones train (fp32, CPU),
under the same parameter names, and the layout it is not supported in is refused before any worker
starts; `speed.cuda_graphs` reaches every compiled graph as mode "reduce-overhead"."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from model_fixtures import tokens
from one_process import tiny_run

from ora_megatron.config_io import ConfigError, from_dict, to_dict
from ora_megatron.stages import build_staged_gpt
from pretrain.config.loop_sections import TrainConfig
from pretrain.config.run_config import RunConfig
from pretrain.config.runtime_sections import SpeedConfig
from pretrain.job.parallel_layout import ParallelLayout
from pretrain.runtime import engine
from pretrain.runtime.engine import build_engine, compile_model

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


def test_cuda_graphs_without_compile_is_refused_naming_the_key():
    cfg = tiny_run()
    data = to_dict(dataclasses.replace(cfg, speed=SpeedConfig(cuda_graphs=True)))
    with pytest.raises(ConfigError, match="speed.cuda_graphs"):
        from_dict(RunConfig, data)


def test_cuda_graphs_compile_every_layer_and_the_loss_in_reduce_overhead_mode(monkeypatch):
    modes, replays = [], []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: replays.append(1))

    def recording_backend(graph, example_inputs, **options):
        modes.append(options.get("mode"))
        return graph.forward

    cfg = tiny_run()
    model = build_staged_gpt(cfg.model, cfg.parallel)
    torch._dynamo.reset()
    compile_model(model, backend=recording_backend, cuda_graphs=True)
    batch = tokens()
    model(batch, (batch, torch.ones_like(batch))).backward()
    torch._dynamo.reset()
    # The layers' graph (one for both: the same code, the module inlined) and the loss's, each captured for
    # replay as a CUDA graph on a GPU.
    assert modes == ["reduce-overhead"] * 2
    assert replays == [1]  # each forward starts a new replay of the graphs


def test_build_model_hands_speed_cuda_graphs_to_the_compile(monkeypatch):
    calls = []
    monkeypatch.setattr(engine, "compile_model", lambda model, **options: calls.append(options))
    cfg = tiny_run()
    cfg = dataclasses.replace(cfg, speed=SpeedConfig(compile=True, cuda_graphs=True))
    engine.build_model(cfg, ParallelLayout.of(cfg.parallel, 1))
    assert calls == [{"cuda_graphs": True}]
