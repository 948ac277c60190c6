"""pretrain/research/speed/trace.py and step_time's trace cache: the trace joins megatron's state when the
caller holds it, frees what it built, covers micro-batch 1 by its own trace, and a cached trace is parsed
once per process."""

from __future__ import annotations

import gc

import pytest
import torch
from megatron.core import parallel_state
from pretrain_runs import TINY_RUN

from pretrain.checkpoint.consolidate import tp1_parallel_state
from pretrain.config.run_config import load_run_config
from pretrain.research.speed import step_time
from pretrain.research.speed.gpus import H100
from pretrain.research.speed.trace import trace

slow = pytest.mark.slow  # traces the tiny model's CUDA ops on CPU (seconds)


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    path = tmp_path_factory.mktemp("speed_trace") / "tiny.yaml"
    path.write_text(TINY_RUN)
    return load_run_config(str(path), [])


def _live_tensors() -> int:
    gc.collect()
    return sum(isinstance(o, torch.Tensor) for o in gc.get_objects())


@slow
def test_the_trace_joins_the_callers_megatron_state_and_sets_up_its_own_otherwise(cfg):
    with tp1_parallel_state():
        trace(cfg)
        assert parallel_state.model_parallel_is_initialized()
    assert not parallel_state.model_parallel_is_initialized()
    trace(cfg)
    assert not parallel_state.model_parallel_is_initialized()


@slow
def test_a_trace_keeps_nothing_it_built(cfg):
    trace(cfg)  # first-use state (imports, lazily made globals) out of the count
    before = _live_tensors()
    trace(cfg)
    # None added (a leak grows by the model's parameters and activations, hundreds of tensors); fewer is
    # fine: megatron state an earlier test of this process left may be torn down with the trace's own.
    assert _live_tensors() <= before


@slow
def test_micro_batch_1_is_traced_as_it_is(cfg):
    def loss_tokens(ops):
        return next(op.inputs[0].shape[0] for op in ops if op.name == "linear_cross_entropy")

    seq = cfg.model.seq_length
    one, two = step_time.micro_batch_ops(cfg, 1, None), step_time.micro_batch_ops(cfg, 2, None)
    assert (loss_tokens(one), loss_tokens(two)) == (seq, 2 * seq)
    assert step_time.micro_batch_time(cfg, H100, 1, cache=None).device_s \
        < step_time.micro_batch_time(cfg, H100, 2, cache=None).device_s
    with pytest.raises(ValueError, match="at least 1"):
        step_time.micro_batch_ops(cfg, 0, None)


@slow
def test_a_cached_trace_is_read_once(cfg, tmp_path):
    first = step_time.cached_trace(cfg, tmp_path)
    for path in tmp_path.iterdir():  # the JSON written; a second call does not read it again
        path.unlink()
    assert step_time.cached_trace(cfg, tmp_path) is first
    assert first == step_time.cached_trace(cfg, None)

