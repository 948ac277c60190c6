"""Checkpoints: when to save (one rule), how to save atomically, how to resume.

A save writes the tag's directory through DeepSpeed (save_latest=False), then every rank's RNG
state and train_state.json, then — after a barrier, so every rank's files are on disk — rank 0
writes the tag's integrity record (size and sha256 of every file), moves the run dir's `latest`
pointer atomically and prunes old tags. An interrupted save therefore leaves `latest` at the
previous complete checkpoint, and a partial one is never loaded. Before any worker starts, the
entry point checks the record of the checkpoint to resume from (pretrain/resume_check.py).
"""

from __future__ import annotations

import math
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from deepspeed.runtime.zero import GatheredParameters

from ora_megatron.attention import RandomQKVLinear
from ora_megatron.orthogonal import matches_regenerated
from pretrain import reshard
from pretrain.config import CheckpointConfig
from pretrain.run_dir import RunDir, checkpoint_tag


@dataclass
class TrainState:
    """Everything besides model/optimizer that a resumed run needs; saved as train_state.json."""

    step: int = 0  # optimizer steps attempted (applied + skipped)
    skipped_steps: int = 0
    consecutive_skips: int = 0
    tokens_seen: int = 0
    best_valid_loss: float = math.inf
    evals_without_improvement: int = 0
    freeze_stage: int = -1  # -1: the attention config's own trainability
    scheduler: dict = field(default_factory=dict)
    train_time_s: float = 0.0  # training-loop wall time of every segment of the run, up to this checkpoint


class Checkpointer:
    """Saves at every `save_interval` steps and once more at a final step (end of training,
    early stop, preemption, too many skipped steps) — never twice for the same step."""

    def __init__(self, run_dir: RunDir, cfg: CheckpointConfig):
        self.run_dir, self.cfg = run_dir, cfg
        self.last_saved_step: Optional[int] = None

    def save_if_due(self, eng, state: TrainState, *, final: bool) -> None:
        due = final or state.step % self.cfg.save_interval == 0
        if due and state.step != self.last_saved_step:
            self.save(eng, state)

    def save(self, eng, state: TrainState) -> str:
        """Model + optimizer through DeepSpeed, then train_state.json and every rank's RNG state."""
        state.scheduler = eng.scheduler.state_dict()
        tag = checkpoint_tag(state.step)
        eng.engine.save_checkpoint(str(self.run_dir.checkpoints), tag=tag, save_latest=False,
                                   client_state=reshard.optimizer_record(eng))  # names ZeRO-0's torch state
        rank = dist.get_rank()
        torch.save(_rng_state(), self.run_dir.rng_state_file(tag, rank))
        if rank == 0:
            self.run_dir.write_train_state(tag, asdict(state))
            reshard.record_topology(self.run_dir, tag, reshard.engine_topology(eng))
        dist.barrier()
        if rank == 0:
            self.run_dir.write_integrity_record(tag)  # before `latest` moves: a pointed-to tag has one
            self.run_dir.set_latest_checkpoint(tag)
            tags = self.run_dir.checkpoint_tags()
            for old in tags[: tags.index(tag) + 1][: -self.cfg.keep_last]:
                shutil.rmtree(self.run_dir.checkpoint(old), ignore_errors=True)
        dist.barrier()
        self.last_saved_step = state.step
        return tag

    def latest(self) -> Optional[str]:
        return self.run_dir.latest_checkpoint()

    def read_state(self, tag: str) -> TrainState:
        return TrainState(**self.run_dir.read_train_state(tag))

    def load(self, eng, tag: str, state: TrainState, converted: Optional[Path] = None) -> None:
        """Model and optimizer (ZeRO partitions included) through DeepSpeed and this rank's RNG —
        or, for a tag another topology wrote, its topology-free conversion `converted` (per-rank
        RNG states do not carry over) — then the LR schedule from `state` (the tag's train state)
        and frozen Q/K regenerated and checked."""
        if converted is not None:
            reshard.load_converted(eng, converted)
        else:
            path, _ = eng.engine.load_checkpoint(str(self.run_dir.checkpoints), tag=tag, load_optimizer_states=True,
                                                 load_lr_scheduler_states=False)
            if path is None:
                raise RuntimeError(f"checkpoint {self.run_dir.checkpoint(tag)} could not be loaded")
            _set_rng_state(torch.load(self.run_dir.rng_state_file(tag, dist.get_rank()), weights_only=False))
        eng.scheduler.load_state_dict(state.scheduler)
        restore_frozen_qk(eng.module)
        self.last_saved_step = state.step


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def restore_frozen_qk(module: torch.nn.Module) -> int:
    """Regenerate frozen Q/K from (seed, layer, role) and check the loaded copy against them.

    Frozen Q/K are a function, not state: whatever a checkpoint path did to them (ZeRO-3 or bf16
    round trips, universal checkpoints that skip module state), the regenerated values win. A
    stored copy that differs from the regenerated one by more than an ulp of its dtype (another
    LAPACK build) means a different seed/config and fails.
    Returns the number of tensors checked.
    """
    checked = 0
    for linear in (m for m in module.modules() if isinstance(m, RandomQKVLinear)):
        for role, param in (("q", linear.q_weight), ("k", linear.k_weight)):
            if param.requires_grad:
                continue
            expected = linear.local_weight(role)
            with GatheredParameters([param], modifier_rank=0):
                if not matches_regenerated(param.data, expected):
                    raise RuntimeError(
                        f"frozen {role.upper()} of layer {linear.layer_number} in the checkpoint differs "
                        "from the one regenerated from model.seed: different seed or config?")
                param.data.copy_(expected.to(param.device, param.dtype))
            checked += 1
    return checked
