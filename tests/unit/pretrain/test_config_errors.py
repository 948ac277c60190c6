"""Input that used to pass validation and then crash a worker: refused before anything starts,
with exit status 2 and one line naming the key, flag or path."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pretrain_runs import arguments, forbid_workers, keep_environment, write_config

from pretrain import pretrain_ora


@pytest.fixture
def config(tmp_path, monkeypatch):
    keep_environment(monkeypatch)
    return write_config(tmp_path)


def main(config: Path, run_dir: Path, *args: str) -> int:
    return pretrain_ora.main(["--config", str(config), "--run-dir", str(run_dir), *args])


@pytest.mark.parametrize("override, key, message", [
    ("model.make_vocab_size_divisible_by=0", "model.make_vocab_size_divisible_by", "must be > 0"),
    ("model.kv_channels=0", "model.kv_channels", "must be > 0 (or null)"),
    ("model.ffn_hidden_size=-4", "model.ffn_hidden_size", "must be > 0 (or null)"),
    ("model.layernorm_epsilon=0", "model.layernorm_epsilon", "must be > 0"),
    ("optimizer.decay_steps=0", "optimizer.decay_steps", "must be > 0 (or null)"),
    ("data.seed=-1", "data.seed", "must be in [0, 2**32)"),
    ("data.split='0,1,1'", "data.split", "with a train share > 0"),
    ("freeze.schedule=partial", "freeze.schedule",
     "'partial' is not one of: none, partial_frozen; or list of mapping (start, frozen_q, frozen_k)"),
    ("freeze.schedule=[{start: 0.5, frozen_q: half}]", "freeze.schedule[0].frozen_q",
     "'half' is not one of: all, none, first_half, second_half; or list of int"),
    ("freeze.schedule=[{start: 2}]", "freeze.schedule[0].start", "must be in [0, 1)"),
    ("supervision.max_restarts=-1", "supervision.max_restarts", "must be >= 0"),
    ("supervision.hang_timeout_s=600", "supervision.hang_timeout_s",
     "600 must be below collective_timeout_s (600), so that the watchdog (which writes every thread's stack) fires"),
    ("stability.spike_skip={enabled: true, window: 2}", "stability.spike_skip.window", "must be >= 4"),
    ("stability.rewind={enabled: true, max_rewinds: 0}", "stability.rewind.max_rewinds", "must be >= 1"),
    ("faults=[{kind: kill}]", "faults[0].step", "a kill fault needs step >= 1"),
    ("faults=[{kind: spike, step: 3}]", "faults[0].batch", "a spike fault needs batch >= 1"),
])
def test_invalid_value_is_refused_naming_the_key(config, tmp_path, capsys, override, key, message):
    run_dir = tmp_path / "never"
    assert main(config, run_dir, "--check-only", "--set", override, "--set", "model.attention.type=ora") == 2
    err = capsys.readouterr().err
    assert f"error: config error at '{key}': " in err and message in err, err
    assert "typing." not in err and "Traceback" not in err
    assert not run_dir.exists()


@pytest.mark.parametrize("overrides, key", [
    (["train.global_batch_size=12"], "train.global_batch_size"),
    (["parallel.pipeline=2", "deepspeed.zero_stage=2"], "deepspeed.zero_stage"),
    (["model.num_attention_heads=3"], "model.num_attention_heads"),
    (["freeze.schedule=partial_frozen", "model.attention.type=vanilla"], "freeze.schedule"),
    (["optimizer.lr=fast"], "optimizer.lr"),
    (["optimizer.warmup_steps=6"], "optimizer.warmup_steps"),
    (["freeze.schedule=partial_frozen", "deepspeed.zero_stage=3"], "freeze.schedule"),
    (["parallel.pipeline=2", "data.reset_attention_mask=true"], "data.reset_attention_mask"),
    # A job that would restart failures refuses a config error before anything starts: it is never retried.
    (["supervision.max_restarts=3", "train.global_batch_size=12"], "train.global_batch_size"),
    (["supervision.max_restarts=3", "faults=[{kind: kill, step: 2, rank: 2}]"], "faults"),
    (["parallel.pipeline=2", "stability.spike_skip.enabled=true"], "stability.spike_skip.enabled"),
])
def test_config_error_names_key_and_starts_no_worker(config, tmp_path, capsys, monkeypatch, overrides, key):
    """A two-process run's command, refused before it would start its workers."""
    forbid_workers(monkeypatch)
    run_dir = tmp_path / "never"
    assert pretrain_ora.main(arguments(config, run_dir, overrides, nproc=2)) == 2
    err = capsys.readouterr().err
    assert key in err and "Traceback" not in err
    assert not run_dir.exists()


@pytest.mark.parametrize("flag, value", [("--nproc-per-node", "-1"), ("--nproc-per-node", "0"),
                                         ("--world-size", "0"), ("--world-size", "two")])
def test_process_count_must_be_a_whole_number_of_at_least_one(config, tmp_path, capsys, flag, value):
    with pytest.raises(SystemExit) as exit:
        main(config, tmp_path / "never", "--check-only", flag, value)
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert f"error: argument {flag}: " in err and value in err
    assert not (tmp_path / "never").exists()


def _deny_writes_to(monkeypatch, denied: Path) -> None:
    """os.access as for a user who may not write `denied` (chmod cannot show it to root)."""
    access = os.access

    def fake_access(path, mode, **kwargs):
        return not (Path(path) == denied and mode & os.W_OK) and access(path, mode, **kwargs)

    monkeypatch.setattr(os, "access", fake_access)


@pytest.mark.parametrize("layout, denied", [
    ("run dir", "run"),
    ("a file in it", "run/metrics.jsonl"),
    ("the folder it would be created in", "."),
])
def test_unwritable_run_dir_is_refused_before_anything_starts(config, tmp_path, capsys, monkeypatch, layout, denied):
    run_dir = tmp_path / "run"
    if layout != "the folder it would be created in":
        run_dir.mkdir()
        (run_dir / "metrics.jsonl").write_text("")
    _deny_writes_to(monkeypatch, tmp_path / denied)
    assert main(config, run_dir, "--check-only") == 2
    err = capsys.readouterr().err
    assert f"error: run dir {run_dir} cannot be written: {tmp_path / denied} is read-only" in err
    assert "--run-dir" in err and "Traceback" not in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes whatever the permission bits say")
def test_read_only_run_dir_is_refused_before_anything_starts(config, tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run_dir.chmod(0o555)
    try:
        assert main(config, run_dir) == 2
    finally:
        run_dir.chmod(0o755)
    assert f"error: run dir {run_dir} cannot be written: {run_dir} is read-only" in capsys.readouterr().err
    assert list(run_dir.iterdir()) == []
