"""Resume, interrupted saves, preemption, config errors and freeze schedules, end to end."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

import pytest
from pretrain_runs import REPO, TINY_RUN, command, env, losses_by_step, records, run, summary, write_config
from processes import kill_job, wait_for_step, workers_of

from pretrain.run_dir import RunDir, checkpoint_tag

pytestmark = pytest.mark.distributed

# Big enough that a step takes tens of milliseconds, so a kill lands mid-run.
SLOWER_RUN = TINY_RUN.replace("hidden_size: 64", "hidden_size: 128").replace("num_layers: 2", "num_layers: 4") \
    .replace("steps: 6, eval_interval: 3", "steps: 40, eval_interval: 20") \
    .replace("save_interval: 3", "save_interval: 5")


def test_sigkill_then_resume_reproduces_losses(tmp_path):
    config = write_config(tmp_path, SLOWER_RUN)
    overrides = ["deepspeed.zero_stage=1"]
    reference = tmp_path / "reference"
    run(config, reference, overrides, nproc=2)

    interrupted = tmp_path / "interrupted"
    proc = subprocess.Popen(command(config, interrupted, overrides, nproc=2), cwd=REPO, env=env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    wait_for_step(interrupted, 12, proc)
    kill_job(proc)
    killed_at = max(r.step for r in records(interrupted))
    assert killed_at < 40, "the workers trained on after their launcher was killed"
    # The checkpoint carries the training time so far; make it large, so the resumed run's summary
    # can only be right by adding to it.
    tag = RunDir(interrupted).latest_checkpoint()
    state = RunDir(interrupted).read_train_state(tag)
    assert state["train_time_s"] > 0
    RunDir(interrupted).write_train_state(tag, {**state, "train_time_s": 1e4})
    RunDir(interrupted).write_integrity_record(tag)
    run(config, interrupted, overrides, nproc=2)  # the same command resumes from the latest checkpoint

    expected = losses_by_step(reference)
    resumed = records(interrupted)
    assert max(r.step for r in resumed) == 40
    for r in resumed:  # every logged step, before and after the kill, bitwise equal (fp32, CPU)
        assert r.loss == expected[r.step], f"step {r.step}"
    assert summary(interrupted).final_test_loss == summary(reference).final_test_loss
    assert 1e4 < summary(interrupted).wall_time_s < 1e4 + 900 and summary(reference).wall_time_s < 900
    assert RunDir(interrupted).checkpoint_tags() == ["step00000035", "step00000040"], "keep_last=2 prunes the rest"

    finished = RunDir(reference).summary.read_text()
    run(config, reference, overrides, nproc=2)  # a finished run's command again trains nothing
    assert RunDir(reference).summary.read_text() == finished, "the finished run's summary is kept"


def test_interrupted_save_leaves_previous_checkpoint_loadable(tmp_path):
    config = write_config(tmp_path)
    overrides = ["train.steps=9", "checkpoint.keep_last=3"]
    complete = tmp_path / "complete"
    run(config, complete, overrides)
    # The state a save killed while writing step 9 leaves: a partial step 9, `latest` still at 6.
    crashed = tmp_path / "crashed"
    shutil.copytree(complete, crashed)
    crashed_dir = RunDir(crashed)
    model_file = crashed_dir.checkpoint("step00000009") / "mp_rank_00_model_states.pt"
    model_file.write_bytes(model_file.read_bytes()[: model_file.stat().st_size // 2])
    crashed_dir.train_state_file("step00000009").unlink()
    crashed_dir.set_latest_checkpoint("step00000006")
    kept = [line for line in crashed_dir.metrics.read_text().splitlines() if '"step": 7' not in line
            and '"step": 8' not in line and '"step": 9' not in line]
    crashed_dir.metrics.write_text("\n".join(kept) + "\n")

    out = run(config, crashed, overrides)
    assert "resumed at step 6" in out.stderr
    assert losses_by_step(crashed) == losses_by_step(complete)
    assert crashed_dir.latest_checkpoint() == "step00000009"


def test_stored_frozen_qk_that_differs_from_the_seed_is_rejected(tmp_path):
    import torch

    config = write_config(tmp_path)
    run_dir = tmp_path / "tampered"
    run(config, run_dir, ["train.steps=3"])
    path = RunDir(run_dir).checkpoint("step00000003") / "mp_rank_00_model_states.pt"
    states = torch.load(path, weights_only=False)
    key = next(k for k in states["module"] if k.endswith("linear_qkv.q_weight"))
    states["module"][key] = states["module"][key] + 1e-3
    torch.save(states, path)
    RunDir(run_dir).write_integrity_record("step00000003")  # a checkpoint saved with other Q/K, not a damaged one
    out = run(config, run_dir, ["train.steps=6"], check=False)
    assert out.returncode != 0
    assert "differs from the one regenerated from model.seed" in out.stderr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_sigterm_and_ctrl_c_checkpoint_and_exit_zero_saying_so(tmp_path, signum):
    config = write_config(tmp_path, SLOWER_RUN)
    run_dir = tmp_path / "preempted"
    proc = subprocess.Popen(command(config, run_dir, ["train.steps=400"]), cwd=REPO, env=env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for_step(run_dir, 3, proc)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-2000:]
    last = max(r.step for r in records(run_dir))
    assert last < 400
    assert RunDir(run_dir).latest_checkpoint() == checkpoint_tag(last)
    assert summary(run_dir).preempted is True
    assert (f"interrupted at step {last}: checkpoint {RunDir(run_dir).checkpoint(checkpoint_tag(last))} saved; "
            "the same command resumes from it") in stderr


@pytest.mark.parametrize("overrides, key", [
    (["train.global_batch_size=12"], "train.global_batch_size"),
    (["parallel.pipeline=2", "deepspeed.zero_stage=2"], "deepspeed.zero_stage"),
    (["model.num_attention_heads=3"], "model.num_attention_heads"),
    (["train.freeze_schedule=partial_frozen", "model.attention.type=vanilla"], "train.freeze_schedule"),
    (["optimizer.lr=fast"], "optimizer.lr"),
    (["optimizer.warmup_steps=6"], "optimizer.warmup_steps"),
    (["train.freeze_schedule=partial_frozen", "deepspeed.zero_stage=3"], "train.freeze_schedule"),
])
def test_config_error_names_key_and_starts_noworkers_of(tmp_path, overrides, key):
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
    trainable = {r.step: r.trainable_params for r in records(run_dir)}
    base = trainable[1]
    qk_per_layer = 2 * 64 * 64
    expected = [base] * 5 + [base + qk_per_layer] * 3 + [base + 2 * qk_per_layer] * 2
    assert [trainable[s] for s in range(1, 11)] == expected
    losses = losses_by_step(run_dir)
    assert losses[10] < losses[1]
    assert summary(run_dir).frozen_params == 0


# One process at ZeRO-0 in fp32 is the single-replica path: no gradient all-reduce, and the
# finiteness check reads the norm DeepSpeed clipped with (pretrain/runtime/optimizer.py, SkippingAdamW).
@pytest.mark.parametrize("zero_stage, nproc", [(0, 2), (2, 2), (0, 1)])
def test_nonfinite_steps_are_skipped_and_leave_weights_untouched(tmp_path, zero_stage, nproc):
    import math

    import torch

    config = write_config(tmp_path)
    run_dir = tmp_path / "poisoned"
    run(config, run_dir, [f"deepspeed.zero_stage={zero_stage}", "train.inject_nonfinite_loss_steps=[3,4]",
                          "checkpoint.save_interval=1", "checkpoint.keep_last=10"], nproc=nproc)
    steps = {r.step: r for r in records(run_dir)}
    assert steps[2].skipped_steps == 0 and steps[4].skipped_steps == 2 and steps[6].skipped_steps == 2
    # Every layout reports the clipping's norm on a good step, and none on a skipped one.
    assert [s for s, r in steps.items() if r.grad_norm is None] == [3, 4]
    assert all(math.isfinite(r.grad_norm) and r.grad_norm > 0 for s, r in steps.items() if s not in (3, 4))
    assert summary(run_dir).skipped_steps == 2

    def weights(step):
        path = RunDir(run_dir).checkpoint(checkpoint_tag(step)) / "mp_rank_00_model_states.pt"
        module = torch.load(path, weights_only=False)["module"]
        return {k: v for k, v in module.items() if isinstance(v, torch.Tensor)}  # not megatron's _extra_state

    after_2, after_4, after_5 = weights(2), weights(4), weights(5)
    assert all(torch.equal(after_2[k], after_4[k]) for k in after_2), "skipped steps must not update"
    assert any(not torch.equal(after_4[k], after_5[k]) for k in after_4), "training resumes after the skips"
    assert all(torch.isfinite(v).all() for v in after_5.values() if v.is_floating_point())


def test_consecutive_nonfinite_steps_stop_with_a_checkpoint(tmp_path):
    config = write_config(tmp_path)
    run_dir = tmp_path / "diverged"
    out = run(config, run_dir, ["train.inject_nonfinite_loss_steps=[2,3,4,5]", "train.max_consecutive_skips=3"],
              check=False)
    assert out.returncode == 3
    assert "3 consecutive steps had non-finite" in out.stderr
    assert RunDir(run_dir).latest_checkpoint() == "step00000004"
    state = RunDir(run_dir).read_train_state("step00000004")
    assert state["skipped_steps"] == 3 and state["consecutive_skips"] == 3


def test_a_dead_rank_ends_the_run_in_bounded_time(tmp_path):
    config = write_config(tmp_path, SLOWER_RUN)
    run_dir = tmp_path / "rank_dies"
    proc = subprocess.Popen(command(config, run_dir, ["train.steps=400", "train.collective_timeout_s=30"], nproc=2),
                            cwd=REPO, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    wait_for_step(run_dir, 3, proc)
    children = workers_of(proc)
    assert len(children) == 2, children
    os.kill(children[1], signal.SIGKILL)
    started = time.time()
    try:
        proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert time.time() - started < 90


def test_bf16_zero3_checkpoint_resumes_with_frozen_qk_intact(tmp_path):
    """Upstream DeepSpeed lost frozen weights from some bf16/ZeRO-3 checkpoints; on resume ours
    are regenerated and compared with the stored copy, so a loss or corruption would fail here."""
    config = write_config(tmp_path)
    run_dir = tmp_path / "bf16_zero3"
    overrides = ["deepspeed.precision=bf16", "deepspeed.zero_stage=3"]
    run(config, run_dir, overrides, nproc=2)
    out = run(config, run_dir, overrides + ["train.steps=9"], nproc=2)
    assert "resumed at step 6" in out.stderr
    losses = losses_by_step(run_dir)
    assert sorted(losses) == list(range(1, 10)) and losses[9] < losses[1]


def _saves_when_sigterm_arrives_at(rank, config_path, run_dir, overrides, sigterm_step):
    """Train in this process; a real SIGTERM arrives during step `sigterm_step`. Returns the tags
    DeepSpeed was asked to save, in order, and the summary."""
    from deepspeed import DeepSpeedEngine

    from pretrain.config import load_run_config, validate_for_world
    from pretrain.runtime.trainer import Trainer

    cfg = load_run_config(config_path, overrides)
    saved = []
    save_checkpoint = DeepSpeedEngine.save_checkpoint
    train_step = Trainer._train_step

    def counting_save(self, save_dir, tag=None, **kwargs):
        saved.append(tag)
        return save_checkpoint(self, save_dir, tag=tag, **kwargs)

    def step_then_sigterm(self, step):
        loss = train_step(self, step)
        if step + 1 == sigterm_step:
            os.kill(os.getpid(), signal.SIGTERM)
        return loss

    DeepSpeedEngine.save_checkpoint, Trainer._train_step = counting_save, step_then_sigterm
    trainer = Trainer(cfg, RunDir(run_dir), validate_for_world(cfg, 1))
    return saved, trainer.train()


@pytest.mark.parametrize("overrides, sigterm_step, expected", [
    # the final step (5) is not a multiple of save_interval (3)
    (["train.steps=5"], 5, ["step00000003", "step00000005"]),
    # early stopping stops at step 4 (an eval every step; after step 1 no eval improves by 1.0)
    (["train.steps=9", "train.eval_interval=1", "train.early_stopping={enabled: true, patience: 3, min_delta: 1.0}"],
     4, ["step00000003", "step00000004"]),
], ids=["final-step", "early-stop-step"])
def test_preemption_on_a_final_step_saves_it_once(tmp_path, overrides, sigterm_step, expected):
    from distributed import run_on_ranks

    config = write_config(tmp_path)
    ((saved, result),) = run_on_ranks(_saves_when_sigterm_arrives_at, 1, str(config), str(tmp_path / "run"),
                                      overrides, sigterm_step)
    assert saved == expected
    assert result.preempted and result.steps == sigterm_step
