"""torch AdamW's implementation by host: fused on CUDA (one kernel a launch), foreach elsewhere (the CPU
results the tests pin)."""

from __future__ import annotations

import torch

from pretrain.config.runtime_sections import OptimizerConfig
from pretrain.runtime import optimizer


def test_adamw_is_fused_on_cuda_and_foreach_elsewhere(monkeypatch):
    model = torch.nn.Linear(4, 4)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    on_cpu = optimizer.build_optimizer(model, OptimizerConfig(), decides_skips=False)
    assert on_cpu.defaults["foreach"] is True and not on_cpu.defaults["fused"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    on_gpu = optimizer.build_optimizer(model, OptimizerConfig(), decides_skips=True)
    assert on_gpu.defaults["fused"] is True and not on_gpu.defaults["foreach"]
    assert isinstance(on_gpu, optimizer.SkippingAdamW)
