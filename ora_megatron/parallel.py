"""torch.distributed + megatron-core parallel state, for one process or many."""

from __future__ import annotations

import datetime
import os
import tempfile

import torch
import torch.distributed as dist
from megatron.core import parallel_state


def init_distributed(tensor: int = 1, pipeline: int = 1, backend: str | None = None,
                     timeout: datetime.timedelta | None = None, alone: bool = False) -> None:
    """Join (or create, when launched alone) the process group, then megatron's TP/PP/DP groups.

    Under torchrun / the deepspeed launcher the env:// rendezvous is used; a plain `python` run
    gets a private one-process group so the same code path serves both. `alone`: a private group
    even under a launcher (a launcher's rank 0 building a one-process model before rendezvous).
    """
    if not dist.is_initialized():
        # With CUDA, NCCL for device tensors and gloo for the host-side scalars some collectives use
        # (parameter counts, the skip/preemption flags): an NCCL-only group rejects CPU tensors.
        backend = backend or ("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
        if torch.cuda.is_available():
            # One device per local rank, chosen before NCCL or any CUDA tensor picks device 0 for all.
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if "WORLD_SIZE" in os.environ and not alone:
            dist.init_process_group(backend, timeout=timeout)
        else:
            os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed reads it even for one process
            store = tempfile.NamedTemporaryFile(prefix="ora-pg-", delete=False).name
            dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1,
                                    timeout=timeout)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor, pipeline_model_parallel_size=pipeline)


def tp_rank_size(tp_group) -> tuple[int, int]:
    """(rank, size) in a tensor-parallel group; no group is one rank."""
    if tp_group is None:
        return 0, 1
    return tp_group.rank(), tp_group.size()


def destroy_distributed() -> None:
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
