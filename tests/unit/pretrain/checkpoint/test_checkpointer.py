"""Checkpointer: when it saves, what a save leaves on disk and in which order, and what a load restores."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from model_fixtures import build
from one_process import optimizer_steps, tiny_run

from ora_megatron.attention import RandomQKVLinear
from pretrain.checkpoint import checkpointer as checkpointer_module
from pretrain.checkpoint.checkpointer import Checkpointer, TrainState, restore_frozen_qk
from pretrain.config.loop_sections import CheckpointConfig
from pretrain.run_files.run_dir import RunDir, checkpoint_tag
from pretrain.runtime.engine import build_engine

pytestmark = pytest.mark.usefixtures("one_process_group")  # conftest.py: one gloo rank


@pytest.fixture(scope="module")
def trained():
    """A tiny ORA engine after 3 optimizer steps (ZeRO-0, fp32): what the tests save."""
    train_engine = build_engine(tiny_run(), grad_accum=1)
    optimizer_steps(train_engine, 3)
    return train_engine


def fresh_engine():
    return build_engine(tiny_run(), grad_accum=1)


def checkpointer(tmp_path, save_interval: int = 3, keep_last: int = 2) -> Checkpointer:
    return Checkpointer(RunDir(tmp_path / "run"), CheckpointConfig(save_interval=save_interval, keep_last=keep_last))


def saved_steps(checkpointer: Checkpointer, monkeypatch) -> list[int]:
    """The steps `checkpointer.save` is called for from now on (it still saves)."""
    steps, save = [], checkpointer.save

    def recording_save(train_engine, state):
        steps.append(state.step)
        return save(train_engine, state)

    monkeypatch.setattr(checkpointer, "save", recording_save)
    return steps


def first_q(module) -> torch.nn.Parameter:
    return next(m for m in module.modules() if isinstance(m, RandomQKVLinear)).q_weight


# ---------------------------------------------------------------------------- when
def test_saves_every_interval_and_once_more_at_the_final_step(trained, tmp_path, monkeypatch):
    ckpt = checkpointer(tmp_path, save_interval=3)
    saves = saved_steps(ckpt, monkeypatch)
    for step in range(1, 8):
        ckpt.save_if_due(trained, TrainState(step=step), final=step == 7)
    assert saves == [3, 6, 7]


def test_never_saves_the_same_step_twice(trained, tmp_path, monkeypatch):
    """A final step that is also a save interval (the end of training at step 6) is saved once."""
    ckpt = checkpointer(tmp_path, save_interval=3)
    saves = saved_steps(ckpt, monkeypatch)
    ckpt.save_if_due(trained, TrainState(step=6), final=False)
    ckpt.save_if_due(trained, TrainState(step=6), final=True)
    assert saves == [6]


# ---------------------------------------------------------------------------- what and in which order
def test_save_writes_every_file_then_the_integrity_record_then_latest(trained, tmp_path, monkeypatch):
    """Every rank's files are on disk (a barrier) before rank 0 records them and moves `latest`."""
    ckpt = checkpointer(tmp_path)
    run_dir, tag = ckpt.run_dir, checkpoint_tag(3)
    events = []
    write_record, set_latest = run_dir.write_integrity_record, run_dir.set_latest_checkpoint
    monkeypatch.setattr(checkpointer_module, "dist", SimpleNamespace(
        get_rank=dist.get_rank, barrier=lambda: (events.append("barrier"), dist.barrier())))
    monkeypatch.setattr(run_dir, "write_integrity_record", lambda t: (
        events.append(("integrity", tuple(run_dir.checkpoint_files(t)))), write_record(t))[1])
    monkeypatch.setattr(run_dir, "set_latest_checkpoint", lambda t: (
        events.append(("latest", run_dir.integrity_record_file(t).is_file())), set_latest(t)))

    assert ckpt.save(trained, TrainState(step=3)) == tag

    files = ("mp_rank_00_model_states.pt", "rng_rank0.pt", "topology.json", "train_state.json")
    assert events == ["barrier", ("integrity", files), ("latest", True), "barrier"]
    assert run_dir.latest_checkpoint() == tag and ckpt.latest() == tag
    assert run_dir.verify_checkpoint(tag) == []


def test_train_state_is_saved_with_the_lr_schedule(trained, tmp_path):
    ckpt = checkpointer(tmp_path)
    state = TrainState(step=3, skipped_steps=1, tokens_seen=96, best_valid_loss=4.5,
                       evals_without_improvement=2, freeze_stage=0, train_time_s=12.5)
    ckpt.save(trained, state)
    assert state.scheduler == trained.scheduler.state_dict() and state.scheduler["num_steps"] == 3
    assert ckpt.read_state(checkpoint_tag(3)) == state


def test_keeps_the_last_keep_last_checkpoints(trained, tmp_path):
    ckpt = checkpointer(tmp_path, keep_last=2)
    for step in (3, 6, 9):
        ckpt.save(trained, TrainState(step=step))
    assert ckpt.run_dir.checkpoint_tags() == [checkpoint_tag(6), checkpoint_tag(9)]
    assert ckpt.latest() == checkpoint_tag(9)


def test_pruning_leaves_checkpoints_newer_than_the_saved_one(trained, tmp_path):
    """Only tags up to the one just saved count; a newer one (another attempt's) is not pruned."""
    ckpt = checkpointer(tmp_path, keep_last=1)
    ckpt.save(trained, TrainState(step=3))
    ckpt.run_dir.checkpoint(checkpoint_tag(9)).mkdir()
    ckpt.save(trained, TrainState(step=6))
    assert ckpt.run_dir.checkpoint_tags() == [checkpoint_tag(6), checkpoint_tag(9)]
    assert ckpt.latest() == checkpoint_tag(6)


# ---------------------------------------------------------------------------- load
def test_load_restores_weights_lr_schedule_and_rng(trained, tmp_path):
    ckpt = checkpointer(tmp_path)
    ckpt.save(trained, TrainState(step=3))
    draws = [random.random(), np.random.rand(), torch.rand(1).item()]
    lr = trained.ds_engine.optimizer.param_groups[0]["lr"]

    train_engine = fresh_engine()
    resumed = Checkpointer(ckpt.run_dir, ckpt.cfg)
    resumed.load(train_engine, checkpoint_tag(3), resumed.read_state(checkpoint_tag(3)))

    scheduler = train_engine.scheduler
    assert scheduler.num_steps == 3 and scheduler.state_dict() == trained.scheduler.state_dict()
    assert train_engine.ds_engine.optimizer.param_groups[0]["lr"] == lr > 0
    assert all(torch.equal(p, q) for p, q in zip(train_engine.module.parameters(), trained.module.parameters()))
    assert [random.random(), np.random.rand(), torch.rand(1).item()] == draws
    assert resumed.last_saved_step == 3  # a resume at its final step does not save that step again
    resumed.save_if_due(train_engine, TrainState(step=3), final=True)
    assert resumed.run_dir.checkpoint_tags() == [checkpoint_tag(3)]


def test_load_regenerates_frozen_qk(trained, tmp_path):
    """A stored frozen Q an ulp off (another LAPACK) is replaced by the regenerated one."""
    ckpt, q = checkpointer(tmp_path), first_q(trained.module)
    regenerated = q.detach().clone()
    with torch.no_grad():
        q.mul_(1 + torch.finfo(q.dtype).eps)
    try:
        ckpt.save(trained, TrainState(step=3))
    finally:
        with torch.no_grad():
            q.copy_(regenerated)
    train_engine = fresh_engine()
    ckpt.load(train_engine, checkpoint_tag(3), ckpt.read_state(checkpoint_tag(3)))
    assert torch.equal(first_q(train_engine.module), regenerated)


def test_load_refuses_frozen_qk_of_another_seed(trained, tmp_path):
    ckpt, q = checkpointer(tmp_path), first_q(trained.module)
    regenerated = q.detach().clone()
    with torch.no_grad():
        q.copy_(torch.randn_like(q) * q.abs().max())
    try:
        ckpt.save(trained, TrainState(step=3))
    finally:
        with torch.no_grad():
            q.copy_(regenerated)
    with pytest.raises(RuntimeError, match="frozen Q of layer 1 in the checkpoint differs from the one "
                                           "regenerated from model.seed"):
        ckpt.load(fresh_engine(), checkpoint_tag(3), ckpt.read_state(checkpoint_tag(3)))


@pytest.mark.parametrize("variant, checked", [("ora_qr", 4), ("ora_train_q", 2), ("vanilla", 0)])
def test_restore_frozen_qk_checks_every_frozen_tensor(variant, checked):
    """Two layers: a Q and a K each when both are frozen; trained ones are state, not regenerated."""
    model = build(variant)
    assert restore_frozen_qk(model) == checked
