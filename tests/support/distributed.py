"""Run a function on N gloo processes (megatron parallel state initialised) and collect results."""

from __future__ import annotations

import os
import socket
import tempfile

import torch
import torch.multiprocessing as mp

from ora_megatron.parallel import destroy_distributed, init_distributed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, tensor, pipeline, outdir, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    init_distributed(tensor, pipeline, backend="gloo")
    try:
        torch.save(fn(rank, *args), os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        destroy_distributed()


def run_on_ranks(fn, world_size: int, *args, tensor: int = 1, pipeline: int = 1) -> list:
    """fn(rank, *args) on each rank; returns the list of per-rank return values (torch.save-able)."""
    with tempfile.TemporaryDirectory() as outdir:
        mp.start_processes(_worker, args=(world_size, free_port(), tensor, pipeline, outdir, fn, args),
                           nprocs=world_size, start_method="spawn", join=True)
        return [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
