"""Where the model chooses a kernel path by device, and the one switch that makes a host run take the
CUDA paths (`cuda_branches`): pretrain.research.speed traces, on CPU tensors, the ops a CUDA step
dispatches. Unset, every choice follows the device as it always does."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

_CUDA_BRANCHES = False


@contextlib.contextmanager
def cuda_branches() -> Iterator[None]:
    """Within: choices by device take their CUDA branch whatever the tensors' device (for tracing only:
    some CUDA branches call kernels that exist only on CUDA, which the tracer stands in for)."""
    global _CUDA_BRANCHES
    before, _CUDA_BRANCHES = _CUDA_BRANCHES, True
    try:
        yield
    finally:
        _CUDA_BRANCHES = before


def on_cuda(device: torch.device) -> bool:
    """Whether code running on `device` takes its CUDA branch."""
    return _CUDA_BRANCHES or device.type == "cuda"


def cuda_available() -> bool:
    """Whether a model built now takes its CUDA build choices (the fusions megatron-core runs on a GPU)."""
    return _CUDA_BRANCHES or torch.cuda.is_available()
