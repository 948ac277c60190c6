"""Resume, interrupted saves, preemption, config errors and freeze schedules, end to end."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

import pytest

from pretrain_runs import REPO, TINY_RUN, command, env, losses_by_step, records, run, summary, write_config

# Big enough that a step takes tens of milliseconds, so a kill lands mid-run.
SLOWER_RUN = TINY_RUN.replace("hidden_size: 64", "hidden_size: 128").replace("num_layers: 2", "num_layers: 4") \
    .replace("steps: 6, eval_interval: 3", "steps: 40, eval_interval: 20") \
    .replace("save_interval: 3", "save_interval: 5")


def _wait_for_step(run_dir, step: int, proc, timeout: float = 240.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (run_dir / "metrics.jsonl").exists() and any(r["step"] >= step for r in records(run_dir)):
            return
        assert proc.poll() is None, "run ended before it could be interrupted"
        time.sleep(0.02)
    raise TimeoutError(f"step {step} not reached")


def test_sigkill_then_resume_reproduces_losses(tmp_path):
    config = write_config(tmp_path, SLOWER_RUN)
    overrides = ["deepspeed.zero_stage=1"]
    reference = tmp_path / "reference"
    run(config, reference, overrides, nproc=2)

    interrupted = tmp_path / "interrupted"
    proc = subprocess.Popen(command(config, interrupted, overrides, nproc=2), cwd=REPO, env=env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    _wait_for_step(interrupted, 12, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = max(r["step"] for r in records(interrupted))
    assert killed_at < 40
    run(config, interrupted, overrides, nproc=2)  # the same command resumes from the latest checkpoint

    expected = losses_by_step(reference)
    resumed = records(interrupted)
    assert max(r["step"] for r in resumed) == 40
    for r in resumed:  # every logged step, before and after the kill, bitwise equal (fp32, CPU)
        assert r["loss"] == expected[r["step"]], f"step {r['step']}"
    assert summary(interrupted)["final_test_loss"] == summary(reference)["final_test_loss"]


def test_interrupted_save_leaves_previous_checkpoint_loadable(tmp_path):
    config = write_config(tmp_path)
    overrides = ["train.steps=9", "checkpoint.keep_last=3"]
    complete = tmp_path / "complete"
    run(config, complete, overrides)
    # The state a save killed while writing step 9 leaves: a partial step 9, `latest` still at 6.
    crashed = tmp_path / "crashed"
    shutil.copytree(complete, crashed)
    ckpt = crashed / "checkpoints"
    model_file = ckpt / "step00000009" / "mp_rank_00_model_states.pt"
    model_file.write_bytes(model_file.read_bytes()[: model_file.stat().st_size // 2])
    (ckpt / "step00000009" / "train_state.json").unlink()
    (ckpt / "latest").write_text("step00000006")
    kept = [line for line in (crashed / "metrics.jsonl").read_text().splitlines() if '"step": 7' not in line
            and '"step": 8' not in line and '"step": 9' not in line]
    (crashed / "metrics.jsonl").write_text("\n".join(kept) + "\n")

    out = run(config, crashed, overrides)
    assert "resumed at step 6" in out.stderr
    assert losses_by_step(crashed) == losses_by_step(complete)
    assert (ckpt / "latest").read_text() == "step00000009"


def test_sigterm_checkpoints_and_exits_zero(tmp_path):
    config = write_config(tmp_path, SLOWER_RUN)
    run_dir = tmp_path / "preempted"
    proc = subprocess.Popen(command(config, run_dir, ["train.steps=400"]), cwd=REPO, env=env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _wait_for_step(run_dir, 3, proc)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-2000:]
    last = max(r["step"] for r in records(run_dir))
    assert last < 400
    assert (run_dir / "checkpoints" / "latest").read_text() == f"step{last:08d}"
    assert summary(run_dir)["preempted"] is True


@pytest.mark.parametrize("overrides, key", [
    (["train.global_batch_size=12"], "train.global_batch_size"),
    (["parallel.pipeline=2", "deepspeed.zero_stage=2"], "deepspeed.zero_stage"),
    (["model.num_attention_heads=3"], "model.num_attention_heads"),
    (["train.freeze_schedule=partial_frozen", "model.attention.type=vanilla"], "train.freeze_schedule"),
    (["optimizer.lr=fast"], "optimizer.lr"),
])
def test_config_error_names_key_and_starts_no_workers(tmp_path, overrides, key):
    run_dir = tmp_path / "never"
    started = time.time()
    out = run(write_config(tmp_path), run_dir, overrides, nproc=2, check=False)
    assert out.returncode == 2
    assert key in out.stderr
    assert not run_dir.exists(), "no worker may have started"
    assert "torch.distributed" not in out.stderr and time.time() - started < 30


def test_partial_frozen_schedule_unfreezes_at_the_right_steps(tmp_path):
    config = write_config(tmp_path)
    run_dir = tmp_path / "partial"
    run(config, run_dir, ["train.steps=10", "train.freeze_schedule=partial_frozen",
                          "deepspeed.zero_stage=1"], nproc=2)
    trainable = {r["step"]: r["trainable_params"] for r in records(run_dir)}
    base = trainable[1]
    qk_per_layer = 2 * 64 * 64
    assert [trainable[s] for s in range(1, 11)] == [base] * 5 + [base + qk_per_layer] * 3 + [base + 2 * qk_per_layer] * 2
    losses = losses_by_step(run_dir)
    assert losses[10] < losses[1]
    assert summary(run_dir)["frozen_params"] == 0
