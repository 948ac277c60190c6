"""The command of a finished run, again: it trains nothing and leaves every file of the run as it was;
with fewer steps than the run has trained it is refused."""

from __future__ import annotations

import dataclasses
import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest
from distributed import free_port
from pretrain_runs import REPO, command, env, keep_environment, write_config

from pretrain import pretrain_ora
from pretrain.checkpoint.resume_check import nothing_to_train
from pretrain.config.run_config import load_run_config
from pretrain.run_files.run_dir import RunDir

pytestmark = pytest.mark.distributed  # the session's reference run trains once


@pytest.fixture
def finished(reference, tmp_path, monkeypatch) -> Path:
    """A copy of the session's finished 6-step run (checkpoints at steps 3 and 6)."""
    keep_environment(monkeypatch)
    copy = tmp_path / "run"
    shutil.copytree(reference, copy)
    assert RunDir(copy).latest_checkpoint() == "step00000006" and RunDir(copy).summary.exists()
    return copy


def _snapshot(run_dir: Path) -> dict:
    """Every file with its modification time and content; run.lock, which every start takes, aside."""
    return {str(p.relative_to(run_dir)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(run_dir.rglob("*")) if p.is_file() and p.name != "run.lock"}


def _main(tmp_path: Path, run_dir: Path, overrides=(), *flags: str) -> int:
    argv = ["--config", str(write_config(tmp_path)), "--run-dir", str(run_dir), *flags]
    for item in overrides:
        argv += ["--set", item]
    return pretrain_ora.main(argv)


@pytest.mark.parametrize("overrides", [[], ["checkpoint.keep_last=5"]], ids=["same-config", "changed-setting"])
def test_rerunning_a_finished_run_trains_nothing_and_changes_no_file(finished, tmp_path, capsys, overrides):
    before = _snapshot(finished)
    assert _main(tmp_path, finished, overrides) == 0
    err = capsys.readouterr().err
    assert _snapshot(finished) == before
    assert f"run dir {finished}: finished at step 6, nothing to train" in err
    assert "resumed at step" not in err, "no worker should have started"


@pytest.mark.parametrize("check_only", [False, True], ids=["run", "check-only"])
def test_fewer_steps_than_the_run_has_trained_are_refused(finished, tmp_path, capsys, check_only):
    before = _snapshot(finished)
    assert _main(tmp_path, finished, ["train.steps=3"], *(["--check-only"] if check_only else [])) == 2
    err = capsys.readouterr().err
    assert (f"error: cannot resume {finished} from checkpoint step00000006 with train.steps=3: the run has "
            "trained 6 steps. Resume with train.steps >= 6") in err
    assert _snapshot(finished) == before


def test_under_an_external_launcher_the_workers_find_nothing_to_train(finished, tmp_path):
    """There the first rank cannot stop before the others rendezvous: every worker stops instead."""
    before = _snapshot(finished)
    launched = {**env(), "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(free_port())}
    out = subprocess.run(command(write_config(tmp_path), finished), cwd=REPO, env=launched, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"run dir {finished}: finished at step 6, nothing to train" in out.stderr
    assert _snapshot(finished) == before


def test_an_early_stopped_run_is_finished_until_its_early_stopping_changes(finished, tmp_path, capsys):
    """Resuming it would train `eval_interval` more steps and stop again, on the same evaluation."""
    summary = RunDir(finished).read_summary()
    RunDir(finished).write_summary(dataclasses.replace(summary, stopped_early=True))
    config = write_config(tmp_path)
    (finished / "config.yaml").write_text((finished / "config.yaml").read_text().replace(
        "early_stopping:\n    enabled: false", "early_stopping:\n    enabled: true"))
    before = _snapshot(finished)
    assert _main(tmp_path, finished, ["train.steps=12", "eval.early_stopping.enabled=true"]) == 0
    assert (f"run dir {finished}: stopped early at step 6 (eval.early_stopping), nothing to train"
            in capsys.readouterr().err)
    assert _snapshot(finished) == before
    cfg = load_run_config(str(config), ["train.steps=12", "eval.early_stopping.enabled=true",
                                        "eval.early_stopping.patience=20"])
    assert nothing_to_train(RunDir(finished), "step00000006", cfg) is None
