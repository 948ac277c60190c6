"""A run that needs no one watching, end to end: a killed and a hung worker restart the job, which
finishes with the losses of an uninterrupted run; skip-step decides the same across a resume; a
divergence rewinds past the batches that led to it; the SLURM job's time-limit signal saves, stops
and requeues. The decisions themselves are tested in tests/unit/pretrain/test_supervision.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from distributed import run_on_ranks
from pretrain_runs import (
    LONG,
    PARTIAL_FROZEN,
    REPO,
    command,
    env,
    losses_by_step,
    records,
    summary,
    write_config,
)
from processes import trainings_in_one_process, wait_for_step
from slurm_stand_ins import one_node_job

from pretrain.run_files.run_dir import RunDir, checkpoint_tag

pytestmark = pytest.mark.distributed

SBATCH = REPO / "launch" / "slurm" / "pretrain_ora.sbatch"
# The watchdog far above a step's time on a loaded machine (evaluations and saves are not counted), the
# collective timeout above it, restarts without a long backoff (one node: no old rank elsewhere to wait for).
UNATTENDED = ["supervision.max_restarts=2", "supervision.restart_backoff_s=0.5", "supervision.hang_timeout_s=15",
              "supervision.collective_timeout_s=90"]


def test_killed_and_hung_workers_restart_the_job_which_finishes_as_if_uninterrupted(trained_runs, tmp_path):
    """SIGKILL of rank 1 after step 10; in the restarted job, SIGSTOP of rank 0 after step 40: rank 1's
    watchdog writes the stacks and exits, the supervisor kills the stopped rank, the job restarts again.
    The 60 steps (two freeze-schedule engine rebuilds, ZeRO-1) log bitwise the uninterrupted losses."""
    reference = trained_runs.trained(PARTIAL_FROZEN, nproc=2)
    faults = "faults=[{kind: kill, step: 10, rank: 1}, {kind: stop, step: 40, rank: 0, attempt: 1}]"
    run_dir = tmp_path / "unattended"
    out = subprocess.run(command(write_config(tmp_path), run_dir, [*PARTIAL_FROZEN, *UNATTENDED, faults], nproc=2),
                         cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]

    restarts = RunDir(run_dir).read_restarts()
    assert [r.action for r in restarts] == ["restart", "restart"]
    killed, hung = restarts
    assert killed.ranks["1"] == "SIGKILL" and "rank 1: SIGKILL" in killed.cause
    assert (killed.failed_at_step, killed.resumed_from_step, killed.steps_redone) == (10, 9, 1)
    assert hung.ranks["1"] == "exit 4 (hung)" and hung.ranks.get("0", "SIGKILL") == "SIGKILL"
    assert (hung.failed_at_step, hung.resumed_from_step, hung.steps_redone) == (40, 39, 1)
    (dump,) = RunDir(run_dir).hang_dumps()
    assert hung.hang_dumps == [dump.name] and dump.name.endswith("-step00000040-rank1.txt")
    assert "in all_reduce" in dump.read_text()  # where rank 1 waited for the stopped rank 0
    assert "restart 2 in 0.5 s: " in out.stderr and "hang reported in" in out.stderr
    assert "a rank reported a hang: stopping the job's ranks" in hung.log_tail

    expected = losses_by_step(reference)
    assert losses_by_step(run_dir) == expected  # every step, the redone ones last: bitwise (fp32, CPU)
    done = summary(run_dir)
    assert done.final_test_loss == summary(reference).final_test_loss
    assert (done.restarts, done.hangs) == (2, 1)
    assert [(e.step, e.kind) for e in records(run_dir, "event")] == [(9, "restart"), (39, "restart")]
    assert records(run_dir)[-1].restarts == 2


SKIP_STEP = ["train.steps=16", "checkpoint.save_interval=4",
             "stability.spike_skip={enabled: true, window: 8, sigma: 3}",
             "faults=[{kind: spike, batch: 12, factor: 100}]"]
PREEMPTED_AT_9 = "faults=[{kind: spike, batch: 12, factor: 100}, {kind: preempt, step: 9}]"
# Non-finite losses at batches 6 and 7 (2 skipped steps in a row): back to the checkpoint of step 4;
# step 5 trains on its batch again, batches 6 and 7 are skipped.
REWIND = ["train.steps=12", "checkpoint.save_interval=4", "checkpoint.keep_last=3", "stability.max_consecutive_skips=2",
          "stability.rewind={enabled: true, skip_batches: 2, max_rewinds: 2}",
          "faults=[{kind: nan, batch: 6}, {kind: nan, batch: 7}]"]
NO_CHECKPOINT_BEFORE = ["train.steps=12", "checkpoint.save_interval=4", "stability.max_consecutive_skips=2",
                        "stability.rewind={enabled: true}",
                        "faults=[{kind: nan, batch: 2}, {kind: nan, batch: 3}]"]
# The job started long ago (ORA_JOB_START=0 in that process): out of time after the first step.
OUT_OF_TIME = [LONG, "supervision.max_wall_time=1"]
# A save every millisecond, and by steps never: every step saves.
SAVED_BY_TIME = ["train.steps=4", "checkpoint.save_interval=100", "checkpoint.save_interval_s=0.001",
                 "checkpoint.keep_last=10"]


@pytest.fixture(scope="module")
def in_one_process(tmp_path_factory) -> dict:
    """Short trainings in one process (its start-up is most of their time): name -> (summaries, data
    positions read, records)."""
    root = tmp_path_factory.mktemp("unattended")
    trainings = {"uninterrupted": (SKIP_STEP, 1), "preempted and resumed": ([*SKIP_STEP, PREEMPTED_AT_9], 2),
                 "rewound": (REWIND, 1), "nowhere to rewind": (NO_CHECKPOINT_BEFORE, 1),
                 "out of time": (OUT_OF_TIME, 1), "saved by time": (SAVED_BY_TIME, 1)}
    specs = [(str(root / name.replace(" ", "_")), overrides, segments)
             for name, (overrides, segments) in trainings.items()]
    os.environ["ORA_JOB_START"] = "0"  # inherited by the training process; read by supervision.max_wall_time only
    try:
        (results,) = run_on_ranks(trainings_in_one_process, 1, str(write_config(root)), specs)
    finally:
        del os.environ["ORA_JOB_START"]
    return {name: (*result, Path(spec[0])) for name, result, spec in zip(trainings, results, specs)}


def test_skip_step_decides_the_same_across_a_resume(in_one_process):
    """The spike at batch 12 comes three steps after the resume at step 9: only the window saved with
    the checkpoint (8 steps; decisions from 4 on) can tell it is one."""
    (uninterrupted,), _, expected, _ = in_one_process["uninterrupted"]
    (preempted, resumed), _, got, run_dir = in_one_process["preempted and resumed"]
    assert preempted.preempted and preempted.steps == 9
    assert [(r.step, r.skip_reason) for r in expected if r.split == "train" and r.skip_reason] == [(12, "loss spike")]
    spikes = [(r.step, r.detail["reason"]) for r in got if r.split == "event"]
    assert spikes == [(12, "loss spike")]
    assert {r.step: r.loss for r in got if r.split == "train"} == {r.step: r.loss for r in expected
                                                                    if r.split == "train"}
    assert resumed.final_test_loss == uninterrupted.final_test_loss
    assert resumed.spike_skips == uninterrupted.spike_skips == 1
    state = RunDir(run_dir).read_train_state(checkpoint_tag(16))
    assert state["spike_skips"] == 1 and len(state["spike_window"]["losses"]) == 8


def test_a_rewind_skips_the_batches_that_led_to_the_divergence_and_is_recorded(in_one_process):
    (done,), positions, got, run_dir = in_one_process["rewound"]
    assert done.steps == 12 and done.stop_reason is None
    # Steps 1-7 read batches 1-7 (0-based 0-6); 6 and 7 were skipped; back to step 4: step 5 reads batch 5
    # again, steps 6-12 batches 8-14: 6 and 7 are never trained on again.
    assert positions == [*range(7), 4, *range(7, 14)]
    (rewind,) = done.rewinds
    assert {k: rewind[k] for k in ("at_step", "first_skipped_step", "reason", "checkpoint", "back_to_step",
                                   "skipped_batches")} == {
        "at_step": 7, "first_skipped_step": 6, "reason": "non-finite", "checkpoint": "step00000004",
        "back_to_step": 4, "skipped_batches": [6, 7]}
    assert [(e.step, e.kind, e.detail["skipped_batches"]) for e in got if e.split == "event"] == [(7, "rewind", [6, 7])]
    state = RunDir(run_dir).read_train_state(checkpoint_tag(12))
    assert state["data_skips"] == [[5, 2]] and state["skipped_steps"] == 2 and state["rewinds"] == [rewind]
    assert RunDir(run_dir).checkpoint_tags() == [checkpoint_tag(step) for step in (4, 8, 12)]
    assert not RunDir(run_dir).verify_checkpoint(checkpoint_tag(4)), "the rewound checkpoint is re-recorded"
    assert RunDir(run_dir).read_train_state(checkpoint_tag(4))["rewinds"] == [rewind]


def test_a_divergence_with_no_checkpoint_to_rewind_to_stops_and_says_why(in_one_process):
    (stopped,), _, _, run_dir = in_one_process["nowhere to rewind"]
    assert stopped.stop_reason == "diverged" and stopped.steps == 3 and stopped.rewinds == []
    assert RunDir(run_dir).latest_checkpoint() == checkpoint_tag(3)


# The launch script the job runs on its node: here the training entry itself (its own supervisor).
LAUNCH = f"""\
exec {sys.executable} -m pretrain.pretrain_ora --config "$1" --run-dir "$RUN_DIR" "${{@:2}}"
"""


def test_the_time_limit_signal_saves_a_checkpoint_stops_and_requeues_the_job(tmp_path):
    """The job's USR1 (--signal=B:USR1@300) reaches the run through srun as SIGTERM: it saves at the
    end of its step and exits 0, and the job requeues itself, for the same command to resume."""
    run_dir, requeued = tmp_path / "run", tmp_path / "requeued"
    variables = {**env(), **one_node_job(tmp_path, LAUNCH), "PYTHONPATH": str(REPO), "RUN_DIR": str(run_dir),
                 "REQUEUED": str(requeued)}
    job = subprocess.Popen(["bash", str(SBATCH), str(write_config(tmp_path)), "--set", LONG,
                            "--set", "supervision.max_restarts=1"], cwd=REPO, env=variables, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        wait_for_step(run_dir, 3, job)
        job.send_signal(signal.SIGUSR1)
        _, stderr = job.communicate(timeout=180)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, stderr[-3000:]
    assert requeued.read_text() == "requeue 4242\n"
    last = max(r.step for r in records(run_dir))
    assert last < 1000 and summary(run_dir).preempted
    assert RunDir(run_dir).latest_checkpoint() == checkpoint_tag(last)
    assert "interrupted at step" in stderr and "requeueing job 4242" in stderr
    assert RunDir(run_dir).read_restarts() == [], "a stop on request is no failure"


def test_max_wall_time_stops_with_a_checkpoint_before_the_time_runs_out(in_one_process):
    (stopped,), _, _, run_dir = in_one_process["out of time"]
    assert stopped.stop_reason == "max_wall_time" and not stopped.preempted and stopped.steps == 1
    assert stopped.final_test_loss is None
    assert RunDir(run_dir).latest_checkpoint() == checkpoint_tag(1)


def test_a_save_interval_in_seconds_saves_whatever_the_step_count(in_one_process):
    _, _, _, run_dir = in_one_process["saved by time"]
    assert RunDir(run_dir).checkpoint_tags() == [checkpoint_tag(step) for step in (1, 2, 3, 4)]
