"""Skip-step (pretrain/runtime/step_guard.py): OLMo-core's rule, its window as checkpointed state, and the
guard that keeps a spiking update from the torch optimizer."""

from __future__ import annotations

import math

import pytest
import torch

from pretrain.runtime.step_guard import Spike, SpikeWindow, StepGuard, guard_steps

STEADY = [2.0, 2.1, 1.9, 2.0, 2.05, 1.95, 2.0, 2.1]  # mean 2.0125, sample std ~0.0641


def filled(window: int = 8, sigma: float = 6.0) -> SpikeWindow:
    spikes = SpikeWindow(window, sigma)
    for loss in STEADY:
        assert spikes.check(loss, grad_norm=loss / 2) is None
    return spikes


def test_a_loss_above_mean_plus_sigma_std_of_the_window_is_a_spike():
    spikes = filled()
    mean = sum(STEADY) / len(STEADY)
    std = math.sqrt(sum((v - mean) ** 2 for v in STEADY) / (len(STEADY) - 1))
    assert spikes.check(mean + 5.9 * std, grad_norm=1.0) is None
    spikes = filled()
    assert spikes.check(mean + 6.1 * std, grad_norm=1.0) == Spike("loss spike", mean + 6.1 * std,
                                                                  pytest.approx(mean + 6 * std))
    spike = filled().check(2.0, grad_norm=5.0)
    assert spike.reason == "grad-norm spike" and spike.value == 5.0


def test_no_decision_before_half_the_window_and_every_finite_value_enters_it():
    spikes = SpikeWindow(window=8, sigma=6.0)
    assert [spikes.check(v, None) for v in (2.0, 2.0, 2.0, 50.0)] == [None] * 4  # 3 values: not ready
    assert spikes.check(500.0, None) is not None  # 4 values: ready
    assert spikes.losses[-2:] == [50.0, 500.0], "a skipped spike joins the window: a lasting level is learned"
    for v in range(20):
        spikes.check(float(v), None)
    assert len(spikes.losses) == 8


def test_a_window_restored_from_its_state_decides_as_the_original():
    original, restored = filled(), SpikeWindow(8, 6.0, state=filled().state_dict())
    for loss, norm in [(2.0, 1.0), (2.9, 1.0), (2.0, 9.0), (2.02, 1.01), (9.0, 1.0)]:
        assert original.check(loss, norm) == restored.check(loss, norm)
    assert original.state_dict() == restored.state_dict()


def test_the_guard_decides_once_per_step_and_a_skipped_step_leaves_the_weights_and_adam_state():
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([weight], lr=0.1)
    norms = iter([1.0, 50.0])
    spikes = filled()
    guard = StepGuard(spikes, grad_norm=lambda: next(norms))
    guard_steps(optimizer, guard.skip)
    assert type(optimizer) is torch.optim.AdamW  # DeepSpeed's ZeRO checks the type

    weight.grad = torch.full((3,), 0.5)
    guard.arm(2.0)
    optimizer.step()
    assert guard.take() is None and not torch.equal(weight.data, torch.ones(3))
    before, state = weight.data.clone(), {k: v.clone() for k, v in optimizer.state[weight].items()}

    guard.arm(2.0)
    optimizer.step()
    optimizer.step()  # ZeRO steps the torch optimizer once per parameter group: one decision for all
    spike = guard.take()
    assert spike.reason == "grad-norm spike" and guard.norm == 50.0
    assert torch.equal(weight.data, before)
    assert all(torch.equal(optimizer.state[weight][k], v) for k, v in state.items())
    optimizer.step()  # not armed: a plain step
    assert not torch.equal(weight.data, before)


def test_a_nonfinite_step_is_left_to_deepspeed_and_kept_out_of_the_window():
    spikes = filled()
    guard = StepGuard(spikes, grad_norm=lambda: float("inf"))
    guard.arm(2.0)
    assert guard.skip() is False and guard.take() is None
    assert len(spikes.losses) == len(STEADY)
