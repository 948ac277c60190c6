"""What a run holds and costs: parameter counts, optimizer-state and gradient bytes, FLOPs, MFU,
peak memory. Counts are read from the live tensors, so they hold in every layout."""

from __future__ import annotations

import re
import resource
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from deepspeed import DeepSpeedEngine
from megatron.core import parallel_state

from ora_megatron.builder import padded_vocab_size
from ora_megatron.model_config import ModelConfig
from ora_megatron.summary import train_flops_per_token
from pretrain.runtime.ds_internals import (
    MOMENTS,
    full_numel,
    link_optimizer_fragments,
    local_grad_tensors,
    local_optimizer_state,
    whole_tensor_masters,
)
from pretrain.runtime.engine import TrainEngine

# Dense peak TFLOP/s (no structured sparsity) per GPU model and matmul format, for MFU. NVIDIA's datasheets
# print the tensor-core figures "with sparsity", twice the dense ones: the entries are half of those, and the
# plain (non-tensor-core) FP32 figure as printed. bf16 and fp16 share one figure on every model here.
#   A100 (SXM4 and PCIe, 40 and 80 GB): NVIDIA A100 Tensor Core GPU datasheet, www.nvidia.com/content/dam/
#     en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf: BF16 312,
#     TF32 156, FP32 19.5 (dense figures printed there too).
#   H100 SXM / PCIe / NVL: NVIDIA H100 Tensor Core GPU datasheet: BF16 1,979 / 1,513 / 1,671 with sparsity,
#     TF32 989 / 756 / 835 with sparsity, FP32 67 / 51 / 60.
#   H200 SXM / NVL: NVIDIA H200 Tensor Core GPU datasheet: as H100 SXM / H100 NVL.
#   L40S: NVIDIA L40S datasheet: BF16 362.05 dense (733 with sparsity), TF32 183 dense, FP32 91.6.
# A800 and H800 are export variants of A100 and H100 with their compute (a narrower NVLink).
PEAK_TFLOPS = {
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "H100 SXM": {"bf16": 989.5, "fp16": 989.5, "tf32": 494.5, "fp32": 67.0},
    "H100 PCIe": {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.0},
    "H100 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "H200 SXM": {"bf16": 989.5, "fp16": 989.5, "tf32": 494.5, "fp32": 67.0},
    "H200 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "L40S": {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6},
}
# torch.cuda.get_device_name() → a model of PEAK_TFLOPS. The name is lower-cased and cut into words at spaces
# and hyphens ("NVIDIA A100-SXM4-80GB" → nvidia, a100, sxm4, 80gb); the first rule whose words all occur
# wins, so a form factor's rule (PCIe, NVL) comes before its chip's, whose names for the SXM module vary
# ("NVIDIA H100 80GB HBM3", "NVIDIA H800"). Whole words only: "GH200" is not an H200 and "L40" not an L40S.
# A name no rule matches has no peak, hence no MFU rather than a wrong one.
DEVICE_RULES = (
    (("h100", "pcie"), "H100 PCIe"),
    (("h100", "nvl"), "H100 NVL"),
    (("h100",), "H100 SXM"),
    (("h800", "pcie"), "H100 PCIe"),
    (("h800",), "H100 SXM"),
    (("h200", "nvl"), "H200 NVL"),
    (("h200",), "H200 SXM"),
    (("a100",), "A100"),
    (("a800",), "A100"),
    (("l40s",), "L40S"),
)


@dataclass(frozen=True)
class Peak:
    """The dense peak a run's MFU is measured against."""

    device: str  # torch's name of the device
    model: str  # the PEAK_TFLOPS entry it matched
    dtype: str  # the matmul format: bf16, fp16, tf32 or fp32
    tflops: float


def device_model(name: str) -> Optional[str]:
    """The PEAK_TFLOPS model of a CUDA device name (DEVICE_RULES), or None."""
    words = set(re.split(r"[\s-]+", name.lower()))
    return next((model for needed, model in DEVICE_RULES if words.issuperset(needed)), None)


def matmul_dtype(precision: str, tf32: bool) -> str:
    """The format a run's matmuls run in: its precision, except fp32, whose matmuls run in TF32 where torch
    allows it (Ampere and later; `speed.tf32`, torch's default is off) and in FP32 otherwise."""
    if precision != "fp32":
        return precision
    return "tf32" if tf32 else "fp32"


def peak_of(device: str, precision: str, tf32: bool) -> Optional[Peak]:
    """The dense peak of `device` for a run in `precision` (deepspeed.precision); None for a device not in
    the table."""
    model = device_model(device)
    if model is None:
        return None
    dtype = matmul_dtype(precision, tf32)
    return Peak(device, model, dtype, PEAK_TFLOPS[model][dtype])


def tf32_matmuls() -> bool:
    """Whether torch runs fp32 matmuls on CUDA in TF32 (torch.backends.cuda.matmul.fp32_precision, which
    also reflects the older allow_tf32 and set_float32_matmul_precision settings)."""
    return torch.backends.cuda.matmul.fp32_precision == "tf32"


def device_peak(precision: str = "bf16") -> Optional[Peak]:
    """This process's CUDA device's dense peak for a run in `precision`; None without CUDA or for a device
    not in the table."""
    if not torch.cuda.is_available():
        return None
    return peak_of(torch.cuda.get_device_name(), precision, tf32_matmuls())


def device_peak_tflops(precision: str = "bf16") -> Optional[float]:
    """device_peak's TFLOP/s."""
    peak = device_peak(precision)
    return None if peak is None else peak.tflops


def flops_per_token(model: ModelConfig) -> float:
    """Training FLOPs per token (Megatron's convention; frozen weights skip their weight gradient)."""
    return train_flops_per_token(model, padded_vocab_size(model))


def peak_memory_bytes() -> int:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def parameter_counts(train_engine: TrainEngine) -> tuple[int, int]:
    """(trainable, frozen) elements of the whole model; a collective over all ranks.

    Each rank counts its tensor-parallel shards, replicated weights only on TP rank 0, and a
    pipeline's tied embedding only on the first stage; the sum over ranks covers every data-
    parallel replica, hence the division.
    """
    module = train_engine.module
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    counts = torch.zeros(2, dtype=torch.float64)
    for name, p in module.named_parameters():
        if not getattr(p, "tensor_model_parallel", False) and tp_rank != 0:
            continue
        if train_engine.pipelined and module.is_tied_replica(name):
            continue
        counts[0 if p.requires_grad else 1] += full_numel(p)
    dist.all_reduce(counts)
    replicas = train_engine.layout.data
    return int(counts[0].item()) // replicas, int(counts[1].item()) // replicas


def held_bytes(tensors) -> int:
    """Bytes of memory the contiguous tensors cover together: views of one buffer count once."""
    total, end = 0, 0
    for start, stop in sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors):
        if stop > end:
            total, end = total + stop - max(start, end), stop
    return total


def local_grad_bytes(ds_engine: DeepSpeedEngine) -> int:
    """Bytes of gradient this rank holds at the end of a step's backward (ZeRO partitions included)."""
    return held_bytes(local_grad_tensors(ds_engine))


def allocated_state(ds_engine: DeepSpeedEngine, grad_bytes: Optional[int]) -> dict:
    """Adam-moment bytes this rank holds, read from the live tensors, and its gradient bytes (None
    where unmeasured: the pipeline engine's train_batch has no point between backward and step)."""
    link_optimizer_fragments(ds_engine)
    masters = whole_tensor_masters(ds_engine)
    moments = [m for p in ds_engine.module.parameters() if p.requires_grad for key in MOMENTS
               if (m := local_optimizer_state(ds_engine, p, key, masters)) is not None]
    return {
        "optimizer_state_elements": sum(m.numel() for m in moments),
        "optimizer_state_bytes": sum(m.numel() * m.element_size() for m in moments),
        "gradient_bytes": grad_bytes,
    }
