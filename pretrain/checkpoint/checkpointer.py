"""Checkpoints: when to save (one rule), how to save atomically, how to resume.

A save writes the tag's directory through DeepSpeed (save_latest=False), then every rank's RNG
state and train_state.json, then — after a barrier, so every rank's files are on disk — rank 0
writes the tag's integrity record (size and sha256 of every file), moves the run dir's `latest`
pointer atomically and prunes old tags. An interrupted save therefore leaves `latest` at the
previous complete checkpoint, and a partial one is never loaded. A save that cannot write its
files (a full disk) raises CheckpointSaveFailed, whose message names the cause and the checkpoint
`latest` still points at; the partial tag is removed. Before any worker starts, the entry point
checks the record of the checkpoint to resume from (pretrain/checkpoint/resume_check.py).
"""

from __future__ import annotations

import errno
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
from pretrain.checkpoint import reshard
from pretrain.checkpoint.unpickling import restrict_checkpoint_loading, safe_load
from pretrain.config.loop_sections import CheckpointConfig
from pretrain.run_files.run_dir import RunDir, checkpoint_tag
from pretrain.runtime.engine import TrainEngine


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
    spike_skips: int = 0  # updates skipped as loss or gradient-norm spikes (stability.spike_skip)
    spike_window: dict = field(default_factory=dict)  # the skip-step window (pretrain/runtime/step_guard.py)
    # [from_step, batches]: from (0-based) step `from_step` on, the data position is that many batches
    # further on (a rewind skipped them); the batches a step reads are those of data_position(step).
    data_skips: list = field(default_factory=list)
    rewinds: list = field(default_factory=list)  # one record per rewind (Trainer._rewind)

    def data_position(self, step: int) -> int:
        """The (0-based) global batch of the data that (0-based) step `step` trains on."""
        return step + sum(batches for start, batches in self.data_skips if step >= start)


class CheckpointSaveFailed(RuntimeError):
    """A save could not write its files (a full disk, a lost mount); `latest` still names the last
    complete checkpoint. The message says which, and why."""


# How torch's zip writer reports a failed write: a RuntimeError with no errno, e.g. on a full disk
# "[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534".
TORCH_WRITE_FAILURES = ("inline_container.cc", "PytorchStreamWriter", "basic_ios::clear", "iostream error")


def is_write_failure(error: Exception) -> bool:
    return isinstance(error, OSError) or any(marker in str(error) for marker in TORCH_WRITE_FAILURES)


def _size_of(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


class Checkpointer:
    """Saves at every `save_interval` steps, when `save_interval_s` has passed since the last save,
    and once more at a final step (end of training, early stop, preemption, too many skipped steps,
    supervision.max_wall_time) — never twice for the same step."""

    def __init__(self, run_dir: RunDir, cfg: CheckpointConfig):
        self.run_dir, self.cfg = run_dir, cfg
        self.last_saved_step: Optional[int] = None

    def save_if_due(self, train_engine: TrainEngine, state: TrainState, *, final: bool, by_time: bool = False) -> bool:
        """Save if due (every save_interval steps, at a final step, or `by_time`: save_interval_s has
        passed since the last save, as every rank agreed); whether it saved."""
        due = final or by_time or state.step % self.cfg.save_interval == 0
        if due and state.step != self.last_saved_step:
            self.save(train_engine, state)
            return True
        return False

    def save(self, train_engine: TrainEngine, state: TrainState) -> str:
        """Model + optimizer through DeepSpeed, then train_state.json and every rank's RNG state.
        Raises CheckpointSaveFailed, naming the cause, when this rank cannot write its files."""
        tag = checkpoint_tag(state.step)
        try:
            self._write(train_engine, state, tag)
        except (OSError, RuntimeError) as e:
            if not is_write_failure(e):
                raise
            raise CheckpointSaveFailed(self._save_failure(tag, e)) from e
        self.last_saved_step = state.step
        return tag

    def _write(self, train_engine: TrainEngine, state: TrainState, tag: str) -> None:
        state.scheduler = train_engine.scheduler.state_dict()
        train_engine.ds_engine.save_checkpoint(str(self.run_dir.checkpoints), tag=tag, save_latest=False,
                                               client_state=reshard.optimizer_record(train_engine))  # ZeRO-0's names
        rank = dist.get_rank()
        torch.save(_rng_state(), self.run_dir.rng_state_file(tag, rank))
        if rank == 0:
            self.run_dir.write_train_state(tag, asdict(state))
            reshard.record_topology(self.run_dir, tag, reshard.engine_topology(train_engine))
        dist.barrier()
        if rank == 0:
            self.run_dir.write_integrity_record(tag)  # before `latest` moves: a pointed-to tag has one
            self.run_dir.set_latest_checkpoint(tag)
            tags = self.run_dir.checkpoint_tags()
            for old in tags[: tags.index(tag) + 1][: -self.cfg.keep_last]:
                shutil.rmtree(self.run_dir.checkpoint(old), ignore_errors=True)
        dist.barrier()

    def _save_failure(self, tag: str, error: Exception) -> str:
        """The message of a save that could not write its files; removes the partial tag, which
        nothing reads (`latest` still names the previous one) and which holds space a full disk needs.
        The disk counts as full on ENOSPC/EDQUOT, or, for torch's writer (which reports no errno),
        when less space is free than a checkpoint takes: the last complete one, or else what this
        one wrote before failing."""
        path, latest = self.run_dir.checkpoint(tag), self.latest()
        needed = _size_of(self.run_dir.checkpoint(latest) if latest else path)
        checkpoints = self.run_dir.checkpoints
        free = shutil.disk_usage(checkpoints if checkpoints.is_dir() else self.run_dir.path).free
        disk_full = error.errno in (errno.ENOSPC, errno.EDQUOT) if isinstance(error, OSError) else free < needed
        if latest != tag:
            shutil.rmtree(path, ignore_errors=True)
        what = (f"the disk is full ({free / 2**20:,.0f} MiB free, a checkpoint takes {needed / 2**20:,.0f} MiB)"
                if disk_full else "its files could not be written")
        cause = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
        remedy = "free some space" if disk_full else "fix the cause"
        if latest is None:
            left = f"the run has no complete checkpoint yet: {remedy}, then the same command starts it again"
        else:
            left = (f"the last good checkpoint is still {latest} ({self.run_dir.latest_pointer} points at it): "
                    f"{remedy}, then the same command resumes from it")
        return f"saving checkpoint {path} failed: {what} ({cause}); the partial {tag} was removed; {left}"

    def latest(self) -> Optional[str]:
        return self.run_dir.latest_checkpoint()

    def rewound_to(self, tag: str, state: TrainState) -> None:
        """Once every rank has loaded `tag` again for a rewind, make it the run's checkpoint with the
        rewind's train state `state` (its data skips and record), re-recorded for integrity; `latest`
        points at it and the later checkpoints, of the stretch given up, are deleted, so that a job
        resumed from here on goes the rewound way. Rank 0 writes; a collective."""
        dist.barrier()
        if dist.get_rank() == 0:
            self.run_dir.write_train_state(tag, asdict(state))
            self.run_dir.write_integrity_record(tag)
            self.run_dir.set_latest_checkpoint(tag)
            for later in self.run_dir.checkpoint_tags():
                if later > tag:
                    shutil.rmtree(self.run_dir.checkpoint(later), ignore_errors=True)
        dist.barrier()
        self.last_saved_step = state.step

    def read_state(self, tag: str) -> TrainState:
        return TrainState(**self.run_dir.read_train_state(tag))

    def load(self, train_engine: TrainEngine, tag: str, state: TrainState, converted: Optional[Path] = None) -> None:
        """Model and optimizer (ZeRO partitions included) through DeepSpeed and this rank's RNG —
        or, for a tag another topology wrote, its topology-free conversion `converted` (per-rank
        RNG states do not carry over) — then the LR schedule from `state` (the tag's train state)
        and frozen Q/K regenerated and checked."""
        if converted is not None:
            reshard.load_converted(train_engine, converted)
        else:
            # a run dir from elsewhere must not run code when loaded
            restrict_checkpoint_loading(train_engine.ds_engine)
            path, _ = train_engine.ds_engine.load_checkpoint(str(self.run_dir.checkpoints), tag=tag,
                                                             load_optimizer_states=True, load_lr_scheduler_states=False)
            if path is None:
                raise RuntimeError(f"checkpoint {self.run_dir.checkpoint(tag)} could not be loaded")
            _set_rng_state(self.run_dir.rng_state_file(tag, dist.get_rank()))
        train_engine.scheduler.load_state_dict(state.scheduler)
        restore_frozen_qk(train_engine.module)
        self.last_saved_step = state.step


def _rng_state() -> dict:
    """This process's RNG states as tensors, numbers and lists, which the restricted unpickler reads."""
    name, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    state = {"python": random.getstate(), "numpy": [name, keys.tolist(), position, has_gauss, cached_gaussian],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(path: Path) -> None:
    """Restore this process's RNG states from its file of a checkpoint, read with the restricted unpickler."""
    state = safe_load(path)
    name, keys, *rest = state["numpy"]
    random.setstate(state["python"])
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def restore_frozen_qk(module: torch.nn.Module) -> int:
    """Regenerate frozen Q/K from (seed, layer, role) and check the loaded copy against them (a run
    that imported its Q/K, init_from.qk: imported, restores those: RandomQKVLinear.imported_qk).

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
                    reference = ("the one imported at the run's start (init_from.qk: imported)"
                                 if role in linear.imported_qk else "the one regenerated from model.seed")
                    raise RuntimeError(
                        f"frozen {role.upper()} of layer {linear.layer_number} in the checkpoint differs "
                        f"from {reference}: different seed or config?")
                param.data.copy_(expected.to(param.device, param.dtype))
            checked += 1
    return checked
