"""Resume, interrupted saves, preemption and freeze schedules, end to end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
from pretrain_runs import (
    LONG,
    PARTIAL_FROZEN,
    REPO,
    arguments,
    command,
    env,
    forbid_workers,
    losses_by_step,
    records,
    run,
    summary,
    write_config,
)
from processes import children_of, kill_job, trainings_preempted_at, wait_for_step, workers_of

from pretrain import pretrain_ora
from pretrain.run_files.run_dir import RunDir, checkpoint_tag

pytestmark = pytest.mark.distributed

# The freeze-schedule test reads PARTIAL_FROZEN's training; the SIGKILL test kills the same command
# mid-run: a kill after step 4 leaves a wide margin before the end. It logs to wandb offline, as the
# presets do: wandb's service, a process rank 0 starts, is alive at the kill (it does not change a loss).
KILLED = [*PARTIAL_FROZEN, "logging.wandb_mode=offline"]
# A training test_consolidate.py reads too (the run cache trains it once).
BF16_ZERO3 = ["deepspeed.zero_stage=3", "deepspeed.precision=bf16"]


def test_sigkill_then_resume_reproduces_losses(trained_runs, tmp_path, capsys, monkeypatch):
    reference = trained_runs.trained(PARTIAL_FROZEN, nproc=2)
    config = write_config(tmp_path)
    interrupted = tmp_path / "interrupted"
    proc = subprocess.Popen(command(config, interrupted, KILLED, nproc=2), cwd=REPO, env=env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    wait_for_step(interrupted, 4, proc)  # step 3's checkpoint is saved before step 4 trains
    workers = workers_of(proc)
    assert [pid for worker in workers for pid in children_of(worker)], "no helper of a rank alive at the kill"
    # The lock is the launcher's and its workers', never a helper's, which may outlive them.
    assert {holder.pid for holder in RunDir(interrupted).lock_holders()} == {proc.pid, *workers}
    kill_job(proc)
    killed_at = max(r.step for r in records(interrupted))
    assert killed_at < 60, "the workers trained on after their launcher was killed"
    # The checkpoint carries the training time so far; make it large, so the resumed run's summary
    # can only be right by adding to it.
    tag = RunDir(interrupted).latest_checkpoint()
    state = RunDir(interrupted).read_train_state(tag)
    assert state["train_time_s"] > 0
    RunDir(interrupted).write_train_state(tag, {**state, "train_time_s": 1e4})
    RunDir(interrupted).write_integrity_record(tag)
    # The same command resumes from the latest checkpoint at once, never refused: what is left of the
    # killed ranks (threads still exiting) gets a bounded wait (run_dir.STRAGGLER_WAIT_S).
    run(config, interrupted, KILLED, nproc=2)

    expected = losses_by_step(reference)
    resumed = records(interrupted)
    assert max(r.step for r in resumed) == 60
    for r in resumed:  # every logged step, before and after the kill, bitwise equal (fp32, CPU)
        assert r.loss == expected[r.step], f"step {r.step}"
    assert summary(interrupted).final_test_loss == summary(reference).final_test_loss
    assert 1e4 < summary(interrupted).wall_time_s < 1e4 + 900 and summary(reference).wall_time_s < 900
    assert RunDir(interrupted).checkpoint_tags() == ["step00000057", "step00000060"], "keep_last=2 prunes the rest"

    # A finished run's command again trains nothing: it returns before any worker would start.
    forbid_workers(monkeypatch)
    finished = RunDir(interrupted).summary.read_text()
    assert pretrain_ora.main(arguments(config, interrupted, KILLED, nproc=2)) == 0
    assert "finished at step 60, nothing to train" in capsys.readouterr().err
    assert RunDir(interrupted).summary.read_text() == finished, "the finished run's summary is kept"


def test_interrupted_save_leaves_previous_checkpoint_loadable(trained_runs, reference, tmp_path):
    # The state a save killed while writing the last step (6) leaves: a partial step 6, `latest` still
    # at 3, no summary.
    crashed = trained_runs.copy(tmp_path / "crashed")
    crashed_dir = RunDir(crashed)
    model_file = crashed_dir.checkpoint("step00000006") / "mp_rank_00_model_states.pt"
    model_file.write_bytes(model_file.read_bytes()[: model_file.stat().st_size // 2])
    crashed_dir.train_state_file("step00000006").unlink()
    crashed_dir.set_latest_checkpoint("step00000003")
    crashed_dir.summary.unlink()
    kept = [line for line in crashed_dir.metrics.read_text().splitlines() if json.loads(line)["step"] <= 3]
    crashed_dir.metrics.write_text("\n".join(kept) + "\n")

    out = run(tmp_path / "run.yaml", crashed)
    assert "resumed at step 3" in out.stderr
    assert losses_by_step(crashed) == losses_by_step(reference)
    assert crashed_dir.latest_checkpoint() == "step00000006"


def test_stored_frozen_qk_that_differs_from_the_seed_is_rejected(trained_runs, tmp_path):
    import torch

    run_dir = trained_runs.copy(tmp_path / "tampered")
    path = RunDir(run_dir).checkpoint("step00000006") / "mp_rank_00_model_states.pt"
    states = torch.load(path, weights_only=False)
    key = next(k for k in states["module"] if k.endswith("linear_qkv.q_weight"))
    states["module"][key] = states["module"][key] + 1e-3
    torch.save(states, path)
    RunDir(run_dir).write_integrity_record("step00000006")  # a checkpoint saved with other Q/K, not a damaged one
    out = run(tmp_path / "run.yaml", run_dir, ["train.steps=9"], check=False)
    assert out.returncode != 0
    assert "differs from the one regenerated from model.seed" in out.stderr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_sigterm_and_ctrl_c_checkpoint_and_exit_zero_saying_so(tmp_path, signum):
    config = write_config(tmp_path)
    run_dir = tmp_path / "preempted"
    proc = subprocess.Popen(command(config, run_dir, [LONG]), cwd=REPO, env=env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for_step(run_dir, 3, proc)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-2000:]
    last = max(r.step for r in records(run_dir))
    assert last < 1000
    assert RunDir(run_dir).latest_checkpoint() == checkpoint_tag(last)
    assert summary(run_dir).preempted is True
    assert (f"interrupted at step {last}: checkpoint {RunDir(run_dir).checkpoint(checkpoint_tag(last))} saved; "
            "the same command resumes from it") in stderr


def test_partial_frozen_schedule_unfreezes_at_the_right_steps(trained_runs):
    run_dir = trained_runs.trained(PARTIAL_FROZEN, nproc=2)
    trainable = {r.step: r.trainable_params for r in records(run_dir)}
    base = trainable[1]
    qk_per_layer = 2 * 64 * 64
    # 50% of the 60 steps all Q/K frozen, 30% those of the first half of the layers, the last 20% none
    expected = [base] * 30 + [base + qk_per_layer] * 18 + [base + 2 * qk_per_layer] * 12
    assert [trainable[s] for s in range(1, 61)] == expected
    losses = losses_by_step(run_dir)
    assert losses[60] < losses[1]
    assert summary(run_dir).frozen_params == 0


# One process at ZeRO-0 in fp32 is the single-replica path: no gradient all-reduce, and the
# finiteness check reads the norm DeepSpeed clipped with (pretrain/runtime/optimizer.py, SkippingAdamW).
# bf16 under ZeRO-1/2: the all-reduced norm decides on every rank (ds_internals.skip_nonfinite_steps_by_norm).
@pytest.mark.parametrize("zero_stage, nproc, precision", [(0, 2, "fp32"), (2, 2, "fp32"), (0, 1, "fp32"),
                                                          (1, 2, "bf16")])
def test_nonfinite_steps_are_skipped_and_leave_weights_untouched(tmp_path, zero_stage, nproc, precision):
    import math

    import torch

    config = write_config(tmp_path)
    run_dir = tmp_path / "poisoned"
    run(config, run_dir, [f"deepspeed.zero_stage={zero_stage}", f"deepspeed.precision={precision}",
                          "faults=[{kind: nan, batch: 3}, {kind: nan, batch: 4}]", "checkpoint.save_interval=1",
                          "checkpoint.keep_last=10"], nproc=nproc)
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


NAN_AT_2_TO_5 = "faults=[" + ", ".join(f"{{kind: nan, batch: {b}}}" for b in range(2, 6)) + "]"


def test_consecutive_nonfinite_steps_stop_with_a_checkpoint(tmp_path):
    config = write_config(tmp_path)
    run_dir = tmp_path / "diverged"
    out = run(config, run_dir, [NAN_AT_2_TO_5, "stability.max_consecutive_skips=3"],
              check=False)
    assert out.returncode == 3
    assert "3 consecutive steps had non-finite" in out.stderr
    assert RunDir(run_dir).latest_checkpoint() == "step00000004"
    state = RunDir(run_dir).read_train_state("step00000004")
    assert state["skipped_steps"] == 3 and state["consecutive_skips"] == 3


def test_a_dead_rank_ends_the_run_in_bounded_time(tmp_path):
    config = write_config(tmp_path)
    run_dir = tmp_path / "rank_dies"
    proc = subprocess.Popen(command(config, run_dir, [LONG, "supervision.collective_timeout_s=30"], nproc=2),
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


def test_bf16_zero3_checkpoint_resumes_with_frozen_qk_intact(trained_runs, tmp_path):
    """Upstream DeepSpeed lost frozen weights from some bf16/ZeRO-3 checkpoints; on resume ours
    are regenerated and compared with the stored copy, so a loss or corruption would fail here."""
    run_dir = trained_runs.copy(tmp_path / "bf16_zero3", BF16_ZERO3, nproc=2)
    out = run(tmp_path / "run.yaml", run_dir, BF16_ZERO3 + ["train.steps=9"], nproc=2)
    assert "resumed at step 6" in out.stderr
    losses = losses_by_step(run_dir)
    assert sorted(losses) == list(range(1, 10)) and losses[9] < losses[1]


# Trainings that SIGTERM interrupts during their final step: id -> (overrides, that step, the tags saved).
PREEMPTED_ON_A_FINAL_STEP = {
    # the final step (5) is not a multiple of save_interval (3)
    "final-step": (["train.steps=5"], 5, ["step00000003", "step00000005"]),
    # early stopping stops at step 4 (an eval every step; after step 1 no eval improves by 1.0)
    "early-stop-step": (["train.steps=9", "train.eval_interval=1",
                         "eval.early_stopping={enabled: true, patience: 3, min_delta: 1.0}"],
                        4, ["step00000003", "step00000004"]),
}


@pytest.fixture(scope="module")
def preempted_on_a_final_step(tmp_path_factory) -> dict:
    """Each of PREEMPTED_ON_A_FINAL_STEP trained in one process: id -> (the tags saved, the summary)."""
    from distributed import run_on_ranks

    root = tmp_path_factory.mktemp("preempted")
    trainings = [(str(root / name), overrides, step)
                 for name, (overrides, step, _) in PREEMPTED_ON_A_FINAL_STEP.items()]
    (results,) = run_on_ranks(trainings_preempted_at, 1, str(write_config(root)), trainings)
    return dict(zip(PREEMPTED_ON_A_FINAL_STEP, results))


@pytest.mark.parametrize("name", PREEMPTED_ON_A_FINAL_STEP)
def test_preemption_on_a_final_step_saves_it_once(preempted_on_a_final_step, name):
    _, sigterm_step, expected = PREEMPTED_ON_A_FINAL_STEP[name]
    saved, result = preempted_on_a_final_step[name]
    assert saved == expected
    assert result.preempted and result.steps == sigterm_step
