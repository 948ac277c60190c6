"""A checkpoint save that cannot write its files (a full disk): the run stops with a message that
names the checkpoint, the cause and the checkpoint `latest` still points at, and resumes from it."""

from __future__ import annotations

import errno
import shutil
import subprocess
import sys
from collections import namedtuple
from types import SimpleNamespace

import pytest
from pretrain_runs import REPO, env, losses_by_step, run, write_config

from pretrain.checkpoint import checkpointer as checkpoint
from pretrain.checkpoint.checkpointer import Checkpointer, CheckpointSaveFailed, TrainState
from pretrain.config.loop_sections import CheckpointConfig
from pretrain.run_files.run_dir import RunDir

# What torch's zip writer raises when the disk fills up under it (torch.save onto a full tmpfs).
TORCH_FULL_DISK = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
DiskUsage = namedtuple("DiskUsage", "total used free")


def _save_failing_with(run_dir: RunDir, error: Exception, monkeypatch) -> str:
    """Checkpointer.save of step 6 with an engine whose save writes part of the tag, then raises `error`."""

    def save_checkpoint(save_dir, tag, **_):
        run_dir.checkpoint(tag).mkdir(parents=True)
        (run_dir.checkpoint(tag) / "mp_rank_00_model_states.pt").write_bytes(b"partial")
        raise error

    monkeypatch.setattr(checkpoint.reshard, "optimizer_record", lambda train_engine: {})
    train_engine = SimpleNamespace(scheduler=SimpleNamespace(state_dict=dict),
                                   ds_engine=SimpleNamespace(save_checkpoint=save_checkpoint))
    with pytest.raises(CheckpointSaveFailed) as failed:
        Checkpointer(run_dir, CheckpointConfig()).save(train_engine, TrainState(step=6))
    return str(failed.value)


@pytest.fixture
def run_dir(tmp_path) -> RunDir:
    """A run dir whose last complete checkpoint is step 3 (1 MiB)."""
    run_dir = RunDir(tmp_path / "run")
    run_dir.checkpoint("step00000003").mkdir(parents=True)
    (run_dir.checkpoint("step00000003") / "mp_rank_00_model_states.pt").write_bytes(b"\0" * 2**20)
    run_dir.set_latest_checkpoint("step00000003")
    return run_dir


def _free(monkeypatch, free: int) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda path: DiskUsage(2**40, 2**40 - free, free))


@pytest.mark.parametrize("error, free", [
    (OSError(errno.ENOSPC, "No space left on device"), 0),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), 2**30),
    (TORCH_FULL_DISK, 2**10),  # no errno: less free than the last checkpoint takes
], ids=["ENOSPC", "EDQUOT", "torch-writer"])
def test_full_disk_is_named_and_latest_is_kept(run_dir, monkeypatch, error, free):
    _free(monkeypatch, free)
    message = _save_failing_with(run_dir, error, monkeypatch)
    assert message.startswith(f"saving checkpoint {run_dir.checkpoint('step00000006')} failed: the disk is full")
    assert (f"the last good checkpoint is still step00000003 ({run_dir.latest_pointer} points at it): "
            "free some space, then the same command resumes from it") in message
    assert str(error) in message
    assert run_dir.latest_checkpoint() == "step00000003" and run_dir.checkpoint_tags() == ["step00000003"]


def test_other_write_failures_are_not_called_a_full_disk(run_dir, monkeypatch):
    _free(monkeypatch, 2**40)
    message = _save_failing_with(run_dir, TORCH_FULL_DISK, monkeypatch)
    assert "its files could not be written" in message and "disk is full" not in message
    assert "fix the cause, then the same command resumes from it" in message
    message = _save_failing_with(run_dir, PermissionError(errno.EACCES, "Permission denied"), monkeypatch)
    assert "its files could not be written (PermissionError: [Errno 13] Permission denied)" in message


def test_first_save_failing_says_there_is_no_checkpoint_yet(tmp_path, monkeypatch):
    _free(monkeypatch, 0)
    message = _save_failing_with(RunDir(tmp_path / "run"), TORCH_FULL_DISK, monkeypatch)
    assert "the disk is full" in message
    assert "the run has no complete checkpoint yet: free some space, then the same command starts it again" in message


def test_errors_that_are_not_write_failures_pass_through(run_dir, monkeypatch):
    bug = RuntimeError("shape mismatch in optimizer state")
    monkeypatch.setattr(checkpoint.reshard, "optimizer_record", lambda train_engine: {})

    def save_checkpoint(save_dir, tag, **_):
        raise bug

    train_engine = SimpleNamespace(scheduler=SimpleNamespace(state_dict=dict),
                                   ds_engine=SimpleNamespace(save_checkpoint=save_checkpoint))
    with pytest.raises(RuntimeError) as raised:
        Checkpointer(run_dir, CheckpointConfig()).save(train_engine, TrainState(step=6))
    assert raised.value is bug


# The run's last save (step 6) meets a full disk: DeepSpeed's save raises what torch's writer raises,
# and the disk has no space left.
ON_A_FULL_DISK = """
import shutil, sys
from deepspeed import DeepSpeedEngine

save_checkpoint, disk_usage = DeepSpeedEngine.save_checkpoint, shutil.disk_usage

def save_on_a_full_disk(self, save_dir, tag=None, **kwargs):
    if tag == "step00000006":
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    return save_checkpoint(self, save_dir, tag=tag, **kwargs)

DeepSpeedEngine.save_checkpoint = save_on_a_full_disk
shutil.disk_usage = lambda path: disk_usage(path)._replace(free=0)

from pretrain import pretrain_ora
sys.exit(pretrain_ora.main(sys.argv[1:]))
"""


@pytest.mark.distributed
def test_full_disk_stops_the_run_which_resumes_bitwise(reference, tmp_path):
    config, run_dir = write_config(tmp_path), tmp_path / "run"
    args = [sys.executable, "-c", ON_A_FULL_DISK, "--config", str(config), "--run-dir", str(run_dir)]
    out = subprocess.run(args, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 3, out.stderr[-3000:]
    assert (f"error: saving checkpoint {RunDir(run_dir).checkpoint('step00000006')} failed: the disk is full"
            in out.stderr)
    assert "the last good checkpoint is still step00000003" in out.stderr and "Traceback" not in out.stderr
    assert RunDir(run_dir).latest_checkpoint() == "step00000003"
    assert RunDir(run_dir).checkpoint_tags() == ["step00000003"]

    resumed = run(config, run_dir)  # space freed: the same command
    assert "resumed at step 3" in resumed.stderr
    assert losses_by_step(run_dir) == losses_by_step(reference)  # steps 4-6 again, bitwise (fp32, CPU)
