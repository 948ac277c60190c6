"""What a run holds and costs: parameter counts, optimizer-state and gradient bytes, FLOPs, MFU,
peak memory. Counts are read from the live tensors, so they hold in every layout."""

from __future__ import annotations

import resource
from typing import Optional

import torch
import torch.distributed as dist
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

# Dense bf16 peak per device (TFLOP/s), for MFU; matched against torch.cuda.get_device_name().
PEAK_BF16_TFLOPS = {"A100": 312.0, "H100": 989.0, "H200": 989.0}


def flops_per_token(model: ModelConfig) -> float:
    """Training FLOPs per token (Megatron's convention; frozen weights skip their weight gradient)."""
    return train_flops_per_token(model, padded_vocab_size(model))


def peak_memory_bytes() -> int:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def device_peak_tflops() -> Optional[float]:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in PEAK_BF16_TFLOPS.items() if key in name), None)


def parameter_counts(eng) -> tuple[int, int]:
    """(trainable, frozen) elements of the whole model; a collective over all ranks.

    Each rank counts its tensor-parallel shards, replicated weights only on TP rank 0, and a
    pipeline's tied embedding only on the first stage; the sum over ranks covers every data-
    parallel replica, hence the division.
    """
    module = eng.module
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    counts = torch.zeros(2, dtype=torch.float64)
    for name, p in module.named_parameters():
        if not getattr(p, "tensor_model_parallel", False) and tp_rank != 0:
            continue
        if eng.pipelined and module.is_tied_replica(name):
            continue
        counts[0 if p.requires_grad else 1] += full_numel(p)
    dist.all_reduce(counts)
    stages = module.num_stages if eng.pipelined else 1
    replicas = dist.get_world_size() // stages // parallel_state.get_tensor_model_parallel_world_size()
    return int(counts[0].item()) // replicas, int(counts[1].item()) // replicas


def held_bytes(tensors) -> int:
    """Bytes of memory the contiguous tensors cover together: views of one buffer count once."""
    total, end = 0, 0
    for start, stop in sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors):
        if stop > end:
            total, end = total + stop - max(start, end), stop
    return total


def local_grad_bytes(engine) -> int:
    """Bytes of gradient this rank holds at the end of a step's backward (ZeRO partitions included)."""
    return held_bytes(local_grad_tensors(engine))


def allocated_state(engine, grad_bytes: Optional[int]) -> dict:
    """Adam-moment bytes this rank holds, read from the live tensors, and its gradient bytes (None
    where unmeasured: the pipeline engine's train_batch has no point between backward and step)."""
    link_optimizer_fragments(engine)
    masters = whole_tensor_masters(engine)
    moments = [m for p in engine.module.parameters() if p.requires_grad for key in MOMENTS
               if (m := local_optimizer_state(engine, p, key, masters)) is not None]
    return {
        "optimizer_state_elements": sum(m.numel() for m in moments),
        "optimizer_state_bytes": sum(m.numel() * m.element_size() for m in moments),
        "gradient_bytes": grad_bytes,
    }
