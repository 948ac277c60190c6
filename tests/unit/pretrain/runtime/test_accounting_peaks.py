"""The dense peak MFU is measured against: the GPU model from torch's device name, the matmul format
from the run's precision (fp32 runs in TF32 where torch allows it), the figure from the table."""

from __future__ import annotations

import pytest
import torch

from pretrain.runtime import accounting
from pretrain.runtime.accounting import Peak, device_model, matmul_dtype, peak_of


@pytest.mark.parametrize("name, model", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM"),
    ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA H100 NVL", "H100 NVL"),
    ("NVIDIA A100-SXM4-80GB", "A100"),
    ("NVIDIA A100-SXM4-40GB", "A100"),
    ("NVIDIA A100 80GB PCIe", "A100"),
    ("NVIDIA A800-SXM4-80GB", "A100"),
    ("NVIDIA H800", "H100 SXM"),
    ("NVIDIA H800 PCIe", "H100 PCIe"),
    ("NVIDIA H200", "H200 SXM"),
    ("NVIDIA H200 NVL", "H200 NVL"),
    ("NVIDIA L40S", "L40S"),
    # Not in the table, and not to be taken for a model that is: no MFU rather than a wrong one.
    ("Tesla T4", None),
    ("NVIDIA L40", None),
    ("NVIDIA GH200 480GB", None),
    ("NVIDIA GeForce RTX 4090", None),
])
def test_device_model_from_torchs_device_name(name, model):
    assert device_model(name) == model


def test_the_run_precision_picks_the_matmul_format():
    assert [matmul_dtype(p, tf32=False) for p in ("bf16", "fp16", "fp32")] == ["bf16", "fp16", "fp32"]
    assert [matmul_dtype(p, tf32=True) for p in ("bf16", "fp16", "fp32")] == ["bf16", "fp16", "tf32"]


@pytest.mark.parametrize("name, precision, tf32, tflops", [
    ("NVIDIA H100 80GB HBM3", "bf16", False, 989.5),
    ("NVIDIA H100 80GB HBM3", "fp32", True, 494.5),
    ("NVIDIA H100 80GB HBM3", "fp32", False, 67.0),
    ("NVIDIA H100 PCIe", "bf16", False, 756.5),
    ("NVIDIA H100 NVL", "fp16", False, 835.5),
    ("NVIDIA A100-SXM4-80GB", "bf16", True, 312.0),
    ("NVIDIA A100-SXM4-80GB", "fp32", True, 156.0),
    ("NVIDIA A100-SXM4-80GB", "fp32", False, 19.5),
    ("NVIDIA H800", "bf16", False, 989.5),
    ("NVIDIA L40S", "bf16", False, 362.05),
])
def test_peak_of_a_device_for_a_precision(name, precision, tf32, tflops):
    peak = peak_of(name, precision, tf32)
    assert peak.tflops == tflops and peak.device == name and peak.dtype == matmul_dtype(precision, tf32)


def test_every_model_has_every_format_and_dense_bf16_above_tf32_above_fp32():
    for model, peaks in accounting.PEAK_TFLOPS.items():
        assert set(peaks) == {"bf16", "fp16", "tf32", "fp32"}, model
        assert peaks["bf16"] == peaks["fp16"] > peaks["tf32"] > peaks["fp32"], model
    assert {model for _, model in accounting.DEVICE_RULES} == set(accounting.PEAK_TFLOPS)


def test_device_peak_reads_this_process_device_and_tf32_setting(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(accounting, "tf32_matmuls", lambda: True)
    assert accounting.device_peak("fp32") == Peak("NVIDIA H100 80GB HBM3", "H100 SXM", "tf32", 494.5)
    monkeypatch.setattr(accounting, "tf32_matmuls", lambda: False)
    assert accounting.device_peak_tflops("fp32") == 67.0
    assert accounting.device_peak_tflops() == 989.5  # bf16 unless asked otherwise
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "Tesla T4")
    assert accounting.device_peak_tflops("bf16") is None


def test_no_device_peak_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert accounting.device_peak("bf16") is None and accounting.device_peak_tflops() is None


@pytest.mark.parametrize("setting, tf32", [
    (lambda: setattr(torch.backends.cuda.matmul, "fp32_precision", "tf32"), True),
    (lambda: setattr(torch.backends.cuda.matmul, "fp32_precision", "ieee"), False),
    (lambda: torch.set_float32_matmul_precision("high"), True),
    (lambda: torch.set_float32_matmul_precision("highest"), False),
])
def test_tf32_matmuls_follows_torchs_settings(setting, tf32):
    assert torch.backends.cuda.matmul.fp32_precision == "none"  # torch's default, restored below
    try:
        setting()
        assert accounting.tf32_matmuls() is tf32
    finally:  # through the older API, then the newer: both read back consistently (torch refuses a mix)
        torch.set_float32_matmul_precision("highest")
        torch.backends.cuda.matmul.fp32_precision = "none"
