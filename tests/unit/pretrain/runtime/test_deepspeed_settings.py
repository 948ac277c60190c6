"""The DeepSpeed JSON a run gets (pretrain.runtime.engine.deepspeed_config): gradient reduction
overlapped with backward on GPUs, fp32 gradient accumulation where DeepSpeed offers it, and no per-tensor
non-finite check where the gradient norm decides."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pretrain.config.run_config import RunConfig
from pretrain.config.runtime_sections import DeepSpeedConfig
from pretrain.runtime.ds_config import deepspeed_config


def settings(zero_stage: int, precision: str = "fp32", grad_accum: int = 1) -> dict:
    cfg = dataclasses.replace(RunConfig(), deepspeed=DeepSpeedConfig(zero_stage=zero_stage, precision=precision))
    return deepspeed_config(cfg, grad_accum)


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_zero_overlaps_gradient_reduction_on_gpus_only(monkeypatch, zero_stage):
    assert not settings(zero_stage)["zero_optimization"].get("overlap_comm", False)  # CPU: no streams
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert settings(zero_stage)["zero_optimization"]["overlap_comm"] is True
    assert "overlap_comm" not in settings(0)["zero_optimization"]


@pytest.mark.parametrize("zero_stage, precision, grad_accum, fp32_accumulation", [
    (2, "bf16", 4, True), (3, "bf16", 2, True),
    (2, "bf16", 1, False),  # nothing to accumulate
    (1, "bf16", 4, False), (0, "bf16", 4, False),  # DeepSpeed: another optimizer / refused
    (2, "fp32", 4, False),  # already fp32
])
def test_bf16_accumulates_gradients_in_fp32_where_deepspeed_offers_it(zero_stage, precision, grad_accum,
                                                                       fp32_accumulation):
    data_types = settings(zero_stage, precision, grad_accum).get("data_types", {})
    assert (data_types.get("grad_accum_dtype") == "fp32") == fp32_accumulation


@pytest.mark.parametrize("zero_stage, precision, per_tensor_check", [
    (1, "bf16", False), (2, "bf16", False),  # the gradient norm decides (ds_internals.skip_nonfinite_steps_by_norm)
    # left as DeepSpeed has it: ZeRO-3 decides from the norm anyway; ZeRO-0's unfused optimizer checks
    # every tensor whatever the setting
    (0, "bf16", True), (3, "bf16", True),
])
def test_bf16_zero1_and_2_leave_the_non_finite_check_to_the_norm(zero_stage, precision, per_tensor_check):
    assert settings(zero_stage, precision)["bf16"].get("check_grad_overflow", True) is per_tensor_check
