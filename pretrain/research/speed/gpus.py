"""The GPU kinds the step-time model knows: vendor data-sheet peaks and the model's fitted constants.

Data-sheet figures (dense, i.e. without structured sparsity; per GPU):

- A100 SXM 80GB: "NVIDIA A100 Tensor Core GPU" data sheet (2021, the 80GB edition): BF16 tensor core
  312 TFLOP/s, HBM2e 2,039 GB/s, third-generation NVLink 600 GB/s. Network: one HDR InfiniBand NIC
  per GPU (200 Gb/s = 25 GB/s), as in a DGX A100 (8 GPUs, 8 HDR compute NICs).
- H100 SXM (80GB): "NVIDIA H100 Tensor Core GPU" data sheet (2023): BF16 tensor core 1,979 TFLOP/s
  with sparsity, 989.5 dense; HBM3 3.35 TB/s; fourth-generation NVLink 900 GB/s. Network: one NDR
  InfiniBand NIC per GPU (ConnectX-7, 400 Gb/s = 50 GB/s), as in a DGX H100.
- H200 SXM (141GB): "NVIDIA H200 Tensor Core GPU" data sheet (2024): BF16 1,979 TFLOP/s with
  sparsity, 989.5 dense; HBM3e 4.8 TB/s; NVLink 900 GB/s. Network: one NDR NIC per GPU (400 Gb/s),
  as in a DGX H200.

SM counts: 108 (A100), 132 (H100 SXM, H200: the same GH100 die). NVLink figures are the total
bidirectional bandwidth per GPU the data sheets quote; InfiniBand is one direction of one NIC.

The fitted constants (`SpeedConstants`) are documented where they are defined and fitted in
`pretrain.research.speed.fit`; docs/speed_model.md lists their fit data.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GPUS_PER_NODE = 8


@dataclass(frozen=True)
class SpeedConstants:
    """The step-time model's constants for one GPU kind (see `pretrain.research.speed.cost`).

    gemm_efficiency: the fraction of the dense bf16 peak a GEMM reaches whose tiles fill whole waves of
        the SMs (smaller GEMMs lose their last wave's idle share: `cost.wave_efficiency`).
    attention_efficiency: the fraction of the peak the attention kernels reach on their FLOPs.
    bandwidth_efficiency: the fraction of the data sheet's HBM bandwidth a memory-bound kernel reaches.
    kernel_s: the device time a kernel costs beyond its FLOPs and bytes (launch, ramp, tail).
    host_s_per_op: the host's time per op issued eagerly: each aten op the layers dispatch, views included
        (megatron-core's modules in Python, the dispatcher, autograd), each kernel of the loss's chunk loop
        and of the gradients' and optimizer's per-tensor loops. A stretch of the step takes the larger of
        the device's and the host's time. Compiled layers issue their kernels at `kernel_s`.
    """

    gemm_efficiency: float
    attention_efficiency: float
    bandwidth_efficiency: float
    kernel_s: float
    host_s_per_op: float


@dataclass(frozen=True)
class GPUKind:
    name: str
    data_sheet: str
    memory_gb: float
    sm_count: int
    bf16_dense_flops: float  # FLOP/s
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float  # per GPU, both directions together
    infiniband_bytes_per_s: float  # per GPU: one NIC, one direction
    infiniband_nic: str
    constants: SpeedConstants

    @property
    def gemm_peak_flops(self) -> float:
        return self.bf16_dense_flops * self.constants.gemm_efficiency

    @property
    def achievable_bytes_per_s(self) -> float:
        return self.hbm_bytes_per_s * self.constants.bandwidth_efficiency


# Fitted by `python -m pretrain.research.speed.fit` on Base, vanilla, eager, micro-batch 64 (H100: the
# after-mb64 report's profile and step; H200: DESIGN.md §4b's 8192³ matmul and Base step); the A100 takes
# the H100's fractions of its data sheet (no A100 has been measured). docs/speed_model.md: the fit data.
H100_CONSTANTS = SpeedConstants(
    gemm_efficiency=0.7728, attention_efficiency=0.1364, bandwidth_efficiency=0.6223, kernel_s=2.0e-6,
    host_s_per_op=25.25e-6,
)
H200_CONSTANTS = replace(H100_CONSTANTS, gemm_efficiency=0.8166, bandwidth_efficiency=0.4111)
A100_CONSTANTS = H100_CONSTANTS

A100 = GPUKind(
    name="A100 SXM 80GB", data_sheet="NVIDIA A100 Tensor Core GPU data sheet (80GB edition, 2021)",
    memory_gb=80.0, sm_count=108, bf16_dense_flops=312e12, hbm_bytes_per_s=2.039e12, nvlink_bytes_per_s=600e9,
    infiniband_bytes_per_s=25e9, infiniband_nic="HDR 200 Gb/s", constants=A100_CONSTANTS,
)
H100 = GPUKind(
    name="H100 SXM", data_sheet="NVIDIA H100 Tensor Core GPU data sheet (2023)",
    memory_gb=80.0, sm_count=132, bf16_dense_flops=989.5e12, hbm_bytes_per_s=3.35e12, nvlink_bytes_per_s=900e9,
    infiniband_bytes_per_s=50e9, infiniband_nic="NDR 400 Gb/s", constants=H100_CONSTANTS,
)
H200 = GPUKind(
    name="H200 SXM", data_sheet="NVIDIA H200 Tensor Core GPU data sheet (2024)",
    memory_gb=141.0, sm_count=132, bf16_dense_flops=989.5e12, hbm_bytes_per_s=4.8e12, nvlink_bytes_per_s=900e9,
    infiniband_bytes_per_s=50e9, infiniband_nic="NDR 400 Gb/s", constants=H200_CONSTANTS,
)

GPU_KINDS = {"a100": A100, "h100": H100, "h200": H200}


def gpu_kind(key: str) -> GPUKind:
    """The GPU kind by its short key (a100, h100, h200); a clear error naming the known keys."""
    try:
        return GPU_KINDS[key.lower()]
    except KeyError:
        raise ValueError(f"unknown GPU kind {key!r}; known: {', '.join(GPU_KINDS)}") from None
