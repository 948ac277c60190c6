"""DeepSpeed checkpoints with an atomic `latest` pointer, per-rank RNG state and frozen-Q/K checks.

A save writes `checkpoints/step<N>/` through DeepSpeed (save_latest=False), then every rank's
RNG state, then — after a barrier, so every rank's files are on disk — rank 0 replaces the
`latest` file atomically and prunes old tags. An interrupted save therefore leaves `latest`
pointing at the previous complete checkpoint, and a partial directory is never loaded.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from deepspeed.runtime.zero import GatheredParameters

from ora_megatron.attention import RandomQKVLinear

LATEST = "latest"


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def latest_tag(ckpt_dir: Path) -> Optional[str]:
    pointer = ckpt_dir / LATEST
    return pointer.read_text().strip() if pointer.exists() else None


def save(engine, ckpt_dir: Path, step: int, train_state: dict, keep_last: int) -> str:
    """Model + optimizer through DeepSpeed, then train_state.json and every rank's RNG state."""
    tag = tag_for(step)
    engine.save_checkpoint(str(ckpt_dir), tag=tag, save_latest=False)
    rank = dist.get_rank()
    torch.save(rng_state(), ckpt_dir / tag / f"rng_rank{rank}.pt")
    if rank == 0:
        _write_atomic(ckpt_dir / tag / "train_state.json", json.dumps(train_state, indent=2))
    dist.barrier()
    if rank == 0:
        _write_atomic(ckpt_dir / LATEST, tag)
        tags = sorted(p.name for p in ckpt_dir.iterdir() if p.is_dir() and p.name.startswith("step"))
        for old in tags[: tags.index(tag) + 1][:-keep_last]:
            shutil.rmtree(ckpt_dir / old, ignore_errors=True)
    dist.barrier()
    return tag


def read_train_state(ckpt_dir: Path, tag: str) -> dict:
    return json.loads((ckpt_dir / tag / "train_state.json").read_text())


def load(engine, ckpt_dir: Path, tag: str) -> None:
    """Model and optimizer (ZeRO partitions included) through DeepSpeed, then this rank's RNG."""
    path, _ = engine.load_checkpoint(str(ckpt_dir), tag=tag, load_optimizer_states=True,
                                     load_lr_scheduler_states=False)
    if path is None:
        raise RuntimeError(f"checkpoint {ckpt_dir / tag} could not be loaded")
    set_rng_state(torch.load(ckpt_dir / tag / f"rng_rank{dist.get_rank()}.pt", weights_only=False))


def restore_frozen_qk(module: torch.nn.Module) -> int:
    """Regenerate frozen Q/K from (seed, layer, role) and check the loaded copy against them.

    Frozen Q/K are a function, not state: whatever a checkpoint path did to them (ZeRO-3 or bf16
    round trips, universal checkpoints that skip module state), the regenerated values win. A
    stored copy that differs from the regenerated one means a different seed/config and fails.
    Returns the number of tensors checked.
    """
    checked = 0
    for linear in (m for m in module.modules() if isinstance(m, RandomQKVLinear)):
        for role, param in (("q", linear.q_weight), ("k", linear.k_weight)):
            if param.requires_grad:
                continue
            expected = linear.local_weight(role)
            with GatheredParameters([param], modifier_rank=0):
                if not torch.equal(param.data.cpu(), expected.to(param.dtype)):
                    raise RuntimeError(
                        f"frozen {role.upper()} of layer {linear.layer_number} in the checkpoint differs "
                        "from the one regenerated from model.seed: different seed or config?")
                param.data.copy_(expected.to(param.device, param.dtype))
            checked += 1
    return checked
