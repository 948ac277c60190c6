"""The step-time model's constants per GPU kind, fitted on one configuration each: Base, vanilla, eager,
micro-batch 64 (docs/speed_model.md, "Constants").

    python -m pretrain.research.speed.fit

H100 (docs/results/gpu/h100-2026-11-27-after-mb64, revision 0ff5a15): the Base profile's kernel time a
step by category (trace_breakdown.json) fits `gemm_efficiency` (GEMM kernels), `attention_efficiency`
(cuDNN's flash kernels) and `bandwidth_efficiency` (every other kernel, the optimizer's included). H200
(DESIGN.md §4b, revision 2f8f273): `gemm_efficiency` from its 8192³ matmul (769–798 TFLOP/s, taken at
783.5); the attention fraction is the H100's (the same kernels on the same die). The host's time per op:
from the H100's Base step, 204.1 ms unprofiled (its micro-batches device-bound, its optimizer stretch
host-bound); the same software on the H200's host. The H200's bandwidth fraction then makes its Base step
take its 173.6 ms. `kernel_s` is not fitted: 2 µs, the launch-to-launch floor of back-to-back small
kernels on Hopper. A100: no GPU measured: the H100's fractions of its data sheet, the same host.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from typing import Callable

from pretrain.research.speed.cost import wave_efficiency
from pretrain.research.speed.gpus import GPU_KINDS, GPUKind, SpeedConstants

KERNEL_S = 2.0e-6


@dataclass(frozen=True)
class FitData:
    """The figures a GPU kind's constants are fitted to (None: not measured there)."""

    revision: str
    step_ms: float
    gemm_ms: float | None = None
    attention_ms: float | None = None
    other_ms: float | None = None
    matmul_8192_tflops: float | None = None


FIT_DATA = {
    # after-mb64 trace_breakdown.json, base-vanilla: kernel ms a step 154.69 = gemm 58.73 + attention 16.14 + the rest.
    "h100": FitData("0ff5a15", step_ms=204.14, gemm_ms=58.73, attention_ms=16.14, other_ms=154.69 - 58.73 - 16.14),
    "h200": FitData("2f8f273", step_ms=173.6, matmul_8192_tflops=783.5),
}


def _solve(value_at: Callable[[float], float], target: float, low: float, high: float) -> float:
    """x in [low, high] with value_at(x) = target, value_at monotone (bisection)."""
    increasing = value_at(high) > value_at(low)
    for _ in range(60):
        middle = (low + high) / 2
        if (value_at(middle) < target) == increasing:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def _with(gpu: GPUKind, **constants) -> GPUKind:
    return replace(gpu, constants=replace(gpu.constants, **constants))


def _base_step_ops(revision: str):
    from pretrain.research.speed.step_time import load_config, step_ops

    return step_ops(load_config("base", ["model.attention.type=vanilla"]), 64, revision)


def _category_ms(ops, gpu: GPUKind, *names: str) -> float:
    categories = ops.time(gpu, compiled=False).totals().categories
    return sum(categories[n].device_s for n in names) * 1e3


def fit_device(gpu: GPUKind, data: FitData, ops) -> GPUKind:
    """The H100's GEMM, attention and bandwidth fractions from its profile's kernel time by category."""
    targets = (("gemm_efficiency", data.gemm_ms, ("gemm",)),
               ("attention_efficiency", data.attention_ms, ("attention",)),
               ("bandwidth_efficiency", data.other_ms, ("other", "optimizer")))
    gpu = _with(gpu, kernel_s=KERNEL_S)
    for _ in range(2):  # GEMMs and attention can be bandwidth-bound: settle the three together
        for name, measured_ms, categories in targets:
            def category_ms(value: float, fixed: GPUKind = gpu, name: str = name, categories=categories) -> float:
                return _category_ms(ops, _with(fixed, **{name: value}), *categories)

            gpu = _with(gpu, **{name: _solve(category_ms, measured_ms, 0.05, 1.0)})
    return gpu


def fit_host(h100: GPUKind, ops) -> GPUKind:
    """The H100's host time per op: its Base step's micro-batches are device-bound (ORA, with more ops
    and fewer GEMM FLOPs, takes vanilla's time on both GPUs at micro-batch 64), its optimizer stretch is
    host-bound (the per-tensor non-finite check): the step's time beyond the device's fits it."""
    step_ms = FIT_DATA["h100"].step_ms
    per_op = _solve(lambda x: ops.time(_with(h100, host_s_per_op=x), compiled=False).seconds * 1e3,
                    step_ms, 1e-6, 300e-6)
    return _with(h100, host_s_per_op=per_op)


def fit_h200(h200: GPUKind, h100: GPUKind, ops) -> GPUKind:
    """The H200: its 8192³ matmul's GEMM efficiency, the H100's attention and host, and the bandwidth
    fraction that makes its Base step take its measured time."""
    data = FIT_DATA["h200"]
    waves = wave_efficiency(1, 8192, 8192, 8192, h200.sm_count)
    gemm = data.matmul_8192_tflops * 1e12 / (h200.bf16_dense_flops * waves)
    gpu = replace(h200, constants=replace(h100.constants, gemm_efficiency=gemm))
    bandwidth = _solve(lambda e: ops.time(_with(gpu, bandwidth_efficiency=e), compiled=False).seconds * 1e3,
                       data.step_ms, 0.1, 1.0)
    return _with(gpu, bandwidth_efficiency=bandwidth)


def fitted() -> dict[str, SpeedConstants]:
    """Every GPU kind's constants, fitted (the module docstring)."""
    h100_ops = _base_step_ops(FIT_DATA["h100"].revision)
    h100 = fit_host(fit_device(GPU_KINDS["h100"], FIT_DATA["h100"], h100_ops), h100_ops)
    h200 = fit_h200(GPU_KINDS["h200"], h100, _base_step_ops(FIT_DATA["h200"].revision))
    return {"h100": h100.constants, "h200": h200.constants, "a100": h100.constants}


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    for key, constants in fitted().items():
        print(f"{key}: {constants}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
