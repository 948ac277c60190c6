"""Accounting: parameter counts, training FLOPs per token, held bytes, peak memory (the device peak table:
test_accounting_peaks.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from model_fixtures import tiny_model, tokens
from one_process import tiny_run

from pretrain.job.parallel_layout import ParallelLayout
from pretrain.runtime import accounting
from pretrain.runtime.engine import build_engine
from pretrain.runtime.loss import lm_loss

# model_fixtures' tiny model: hidden size, MLP width, sequence length, layers, vocabulary padded to 8.
D, FFN, SEQ, LAYERS, PADDED_VOCAB = 64, 128, 16, 2, 104


pytestmark = pytest.mark.usefixtures("one_process_group")  # conftest.py: one gloo rank


@pytest.fixture(scope="module")
def train_engine():
    """A tiny ORA engine: its Q and K (D×D in each layer) frozen, everything else trainable."""
    return build_engine(tiny_run("ora_qr"), grad_accum=1)


# ---------------------------------------------------------------------------- parameters
def test_parameter_counts_split_trainable_and_frozen(train_engine):
    frozen = LAYERS * 2 * D * D
    total = sum(p.numel() for p in train_engine.module.parameters())
    assert accounting.parameter_counts(train_engine) == (total - frozen, frozen)


def test_parameter_counts_are_per_model_not_per_replica(train_engine, monkeypatch):
    """The all-reduce sums every data-parallel replica's count: two replicas count the model once."""
    single = accounting.parameter_counts(train_engine)
    monkeypatch.setattr(accounting, "dist", SimpleNamespace(all_reduce=lambda counts: counts.mul_(2)))
    monkeypatch.setattr(train_engine, "layout", ParallelLayout(world_size=2))
    assert accounting.parameter_counts(train_engine) == single


# ---------------------------------------------------------------------------- FLOPs
def test_flops_per_token_follow_megatrons_formula():
    """2 FLOPs per multiply-add, ×3 for a trained weight (forward, input and weight gradient), ×2
    for a frozen one; attention scores and P·V: 2·s·width each, forward and twice backward; the
    output layer over the padded vocabulary."""
    weights = 2 * D * FFN + 4 * D * D  # MLP (two matrices), Q, K, V and the output projection
    vanilla = LAYERS * (6 * weights + 3 * 2 * 2 * SEQ * D) + 6 * PADDED_VOCAB * D
    assert accounting.flops_per_token(tiny_model("vanilla")) == vanilla
    frozen_qk_weight_gradients = LAYERS * 2 * (2 * D * D)
    assert accounting.flops_per_token(tiny_model("ora_qr")) == vanilla - frozen_qk_weight_gradients


# ---------------------------------------------------------------------------- bytes
def test_held_bytes_counts_shared_storage_once():
    buffer = torch.zeros(100)
    assert accounting.held_bytes([buffer[25:75], buffer, buffer[:50]]) == 400  # views of one buffer
    assert accounting.held_bytes([buffer[:10], buffer[40:60], buffer[50:70]]) == 4 * (10 + 30)
    assert accounting.held_bytes([buffer[:10], torch.zeros(10, dtype=torch.bfloat16)]) == 40 + 20
    assert accounting.held_bytes([]) == 0


def test_gradient_and_adam_state_bytes(train_engine):
    """fp32 without ZeRO: a gradient of each trainable weight, then an fp32 m and v of it after a step."""
    trainable, _ = accounting.parameter_counts(train_engine)
    batch = tokens()
    loss = lm_loss(train_engine.ds_engine(batch), (batch, torch.ones_like(batch)))
    train_engine.backward(loss, last_micro_batch=True)
    grad_bytes = accounting.local_grad_bytes(train_engine.ds_engine)
    assert grad_bytes == 4 * trainable
    train_engine.ds_engine.step()
    assert accounting.allocated_state(train_engine.ds_engine, grad_bytes) == {
        "optimizer_state_elements": 2 * trainable, "optimizer_state_bytes": 8 * trainable,
        "gradient_bytes": grad_bytes}


# ---------------------------------------------------------------------------- the device
def test_peak_memory_on_the_host_is_the_max_rss_in_bytes(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    peak = accounting.peak_memory_bytes()
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    high_water_mark = int(status["VmHWM"].split()[0]) * 1024  # kB; the kernel updates both lazily
    assert peak == pytest.approx(high_water_mark, rel=0.05)
