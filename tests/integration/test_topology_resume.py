"""Resume on a different topology (pretrain/checkpoint/reshard.py), end to end.

Each test takes a run saved at step 3 in layout A, resumes it in layout B (the same command with
other parallel settings / process count) to step 6, and checks that (1) every loss logged after the
resume matches an uninterrupted run within 1e-5 relative, and (2) the optimizer state the resumed
run saves at step 6 — fp32 weights, both Adam moments, step counts, converted through the same
reader — matches the uninterrupted run's. The workers additionally read back every loaded master
weight, moment and group step through DeepSpeed (safe_get_full_*) and fail unless they equal the
converted ones exactly.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch
from pretrain_runs import (
    LAYOUTS,
    ONE_RANK_ZERO1,
    REPO,
    arguments,
    command,
    env,
    forbid_workers,
    losses_by_step,
    records,
    write_config,
)

from pretrain import pretrain_ora
from pretrain.checkpoint import reshard
from pretrain.config.run_config import read_run_config
from pretrain.run_files.run_dir import RunDir, checkpoint_tag, step_of_tag

pytestmark = pytest.mark.distributed

ZERO1 = LAYOUTS["dp2-zero1"]
BF16 = ["deepspeed.precision=bf16"]


def launch(run_dir, overrides, nproc, check=True) -> subprocess.CompletedProcess:
    """pretrain_ora.py as a user runs it; the config is the module's TINY_RUN."""
    args = command(run_dir.parent / "run.yaml", run_dir, overrides, nproc)
    out = subprocess.run(args, cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
    if check and out.returncode != 0:
        raise AssertionError(f"run failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return out


def branch(source, dest, step: int):
    """A copy of run `source` as it was right after saving `step`: later checkpoints and records dropped."""
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("tensorboard", "wandb", "summary.json"))
    run_dir = RunDir(dest)
    for tag in run_dir.checkpoint_tags():
        if step_of_tag(tag) > step:
            shutil.rmtree(run_dir.checkpoint(tag))
    run_dir.set_latest_checkpoint(checkpoint_tag(step))
    kept = [line for line in run_dir.metrics.read_text().splitlines() if json.loads(line)["step"] <= step]
    run_dir.metrics.write_text("\n".join(kept) + "\n")
    return dest


def resume(source, dest, step: int, overrides, nproc) -> tuple:
    """(run dir, launcher's stderr) of `source` branched at `step` and resumed with other settings."""
    out = launch(branch(source, dest, step), overrides, nproc)
    return dest, out.stderr


def converted_states(run_dir, tag: str = "step00000006") -> dict:
    """{name: {fp32, exp_avg, exp_avg_sq, step}} of a checkpoint, via the conversion under test."""
    rd = RunDir(run_dir)
    if not reshard.is_converted(rd, tag):
        reshard.convert_checkpoint(rd, tag, read_run_config(rd), reshard.checkpoint_topology(rd, tag))
    params = reshard.converted_dir(rd, tag) / "params"
    return {p.stem: torch.load(p, weights_only=True) for p in params.glob("*.pt")}


def assert_resumed_like(resumed, stderr: str, reference, after: int, note: str, state_rtol: float = 1e-5) -> None:
    assert note in stderr and f"resumed at step {after}" in stderr, stderr[-3000:]
    assert [r.step for r in records(resumed)] == list(range(1, 7)), "each step logged once"
    expected, got = losses_by_step(reference), losses_by_step(resumed)
    for step in range(after + 1, 7):
        assert abs(got[step] - expected[step]) <= 1e-5 * abs(expected[step]), f"step {step}"
    mine, theirs = converted_states(resumed), converted_states(reference)
    assert sorted(mine) == sorted(theirs) and len(mine) == 28  # every trainable parameter, no frozen Q/K
    for name, state in mine.items():
        assert state["step"] == theirs[name]["step"] == 6, name
        for key in reshard.STATES:  # other layouts sum in other orders (measured: <= 5e-7 of the scale)
            scale = theirs[name][key].abs().max()
            assert (state[key] - theirs[name][key]).abs().max() <= state_rtol * scale, f"{key} of {name}"


# ---------------------------------------------------------------------------- runs shared by the tests
# The uninterrupted runs are copies of the session's (conftest.py): converted_states writes the
# conversion of their step 6 beside it, and the session's runs are only read.
@pytest.fixture(scope="module")
def root(tmp_path_factory):
    path = tmp_path_factory.mktemp("topology_resume")
    write_config(path)
    return path


@pytest.fixture(scope="module")
def dp2(root, trained_runs):
    """Uninterrupted, 2 processes: DP2/TP1/PP1/ZeRO-1 (checkpoints at 3 and 6)."""
    return trained_runs.copy(root / "dp2", ZERO1, nproc=2)


@pytest.fixture(scope="module")
def dp1(root, trained_runs):
    """Uninterrupted, 1 process: DP1/TP1/PP1/ZeRO-1."""
    return trained_runs.copy(root / "dp1", ONE_RANK_ZERO1, nproc=1)


@pytest.fixture(scope="module")
def dp2_to_dp1(root, dp2):
    """ZeRO-1 on one rank trains at ZeRO-0: the resume converts the stage with the data-parallel size."""
    return resume(dp2, root / "dp2_to_dp1", 3, ZERO1, nproc=1)


@pytest.fixture(scope="module")
def zero1_to_zero3(root, dp2_to_dp1):
    """dp2's step 3 resumed as DP2/TP1/PP1/ZeRO-3, from dp2_to_dp1's copy of it: that holds the
    conversion dp2_to_dp1's resume made, which this resume (another target) reuses."""
    return resume(dp2_to_dp1[0], root / "zero1_to_zero3", 3, ["deepspeed.zero_stage=3"], nproc=2)


@pytest.fixture(scope="module")
def pp2_resumed(root, dp1):
    """dp1's step 3 resumed as DP1/TP1/PP2/ZeRO-1, saving every step (for the way back)."""
    return resume(dp1, root / "pp2_resumed", 3, ONE_RANK_ZERO1 + ["parallel.pipeline=2", "checkpoint.save_interval=1",
                                                                 "checkpoint.keep_last=3"], nproc=2)


@pytest.fixture(scope="module")
def pp2_to_pp1(root, pp2_resumed):
    """The way back, into ZeRO-0 (torch's own optimizer state): its step-6 checkpoint is ZeRO-0's."""
    return resume(pp2_resumed[0], root / "pp2_to_pp1", 4, ["deepspeed.zero_stage=0"], nproc=1)


# ---------------------------------------------------------------------------- one test per change
def test_dp2_to_dp1(dp2, dp2_to_dp1):
    assert_resumed_like(*dp2_to_dp1, dp2, 3, "checkpoint step00000003 written with DP2/TP1/PP1/ZeRO-1, resuming "
                                             "with DP1/TP1/PP1/ZeRO-0: converted once to")


def test_dp1_to_dp2(root, dp1):
    resumed = resume(dp1, root / "dp1_to_dp2", 3, ZERO1, nproc=2)
    assert_resumed_like(*resumed, dp1, 3, "written with DP1/TP1/PP1/ZeRO-1, resuming with DP2/TP1/PP1/ZeRO-1")


def test_tp1_to_tp2(root, dp1):
    resumed = resume(dp1, root / "tp1_to_tp2", 3, ONE_RANK_ZERO1 + ["parallel.tensor=2"], nproc=2)
    assert_resumed_like(*resumed, dp1, 3, "written with DP1/TP1/PP1/ZeRO-1, resuming with DP1/TP2/PP1/ZeRO-1")


def test_pp1_to_pp2(dp1, pp2_resumed):
    assert_resumed_like(*pp2_resumed, dp1, 3, "written with DP1/TP1/PP1/ZeRO-1, resuming with DP1/TP1/PP2/ZeRO-1")


def test_pp2_back_to_pp1_and_zero0(dp1, pp2_to_pp1):
    assert_resumed_like(*pp2_to_pp1, dp1, 4, "checkpoint step00000004 written with DP1/TP1/PP2/ZeRO-1, resuming "
                                             "with DP1/TP1/PP1/ZeRO-0")


def test_zero1_to_zero3(dp2, zero1_to_zero3):
    assert_resumed_like(*zero1_to_zero3, dp2, 3, "written with DP2/TP1/PP1/ZeRO-1, resuming with DP2/TP1/PP1/ZeRO-3")


@pytest.fixture(scope="module")
def bf16_zero0(root, trained_runs):
    """Uninterrupted, 1 process, bf16 without ZeRO: DeepSpeed's unfused optimizer steps fp32 copies."""
    return trained_runs.copy(root / "bf16_zero0", BF16 + ["deepspeed.zero_stage=0"], nproc=1)


def test_bf16_zero0_to_zero1_and_back(root, bf16_zero0):
    """The fp32 masters of bf16 without ZeRO are DeepSpeed's copies, not the rounded weights: read from
    its checkpoint on the way there, set in its optimizer on the way back."""
    # Losses stay within 1e-5 (measured: equal). The state gets a bf16-sized bound: the two
    # optimizers' fp32 arithmetic differs by an ulp here and there (fp32 masters: <= 1.7e-6 of the
    # scale), which flips the bf16 rounding of a few weights and so a few gradients. The moments
    # then differ by a fraction of bf16's ulp (2^-8 = 3.9e-3): measured 7.8e-5 of the scale on one
    # machine and 2.8e-3 on another (another CPU, other vector kernels). Masters rounded to bf16
    # instead of carried fail the loss bound.
    there = resume(bf16_zero0, root / "bf16_zero0_to_zero1", 3,  # (bf16 keeps its stage on one rank)
                   BF16 + ZERO1 + ["checkpoint.save_interval=1", "checkpoint.keep_last=3"], nproc=1)
    assert_resumed_like(*there, bf16_zero0, 3, "written with DP1/TP1/PP1/ZeRO-0, resuming with DP1/TP1/PP1/ZeRO-1",
                        state_rtol=1e-2)
    back = resume(there[0], root / "bf16_zero1_to_zero0", 4, BF16 + ["deepspeed.zero_stage=0"], nproc=1)
    assert_resumed_like(*back, bf16_zero0, 4, "written with DP1/TP1/PP1/ZeRO-1, resuming with DP1/TP1/PP1/ZeRO-0",
                        state_rtol=1e-2)


# ---------------------------------------------------------------------------- records and refusals
def test_conversion_is_cached(dp2_to_dp1, zero1_to_zero3):
    """The first resume of dp2's step 3 converted it; the next one, into another topology, uses that
    conversion (test_zero1_to_zero3 checks what it trains)."""
    assert "written with DP2/TP1/PP1/ZeRO-1, resuming with DP1/TP1/PP1/ZeRO-0: converted once to" in dp2_to_dp1[1]
    assert "written with DP2/TP1/PP1/ZeRO-1, resuming with DP2/TP1/PP1/ZeRO-3: using its topology-free " \
           "conversion cached in" in zero1_to_zero3[1]


def test_recorded_topologies(dp2, dp1, dp2_to_dp1, pp2_resumed, pp2_to_pp1):
    """Every checkpoint records the topology that wrote it in its topology.json."""
    seen = {str(reshard.checkpoint_topology(RunDir(run_dir), tag))
            for run_dir in (dp2, dp1, dp2_to_dp1[0], pp2_resumed[0], pp2_to_pp1[0])
            for tag in RunDir(run_dir).checkpoint_tags()}
    assert seen == {"DP2/TP1/PP1/ZeRO-1", "DP1/TP1/PP1/ZeRO-1", "DP1/TP1/PP2/ZeRO-1", "DP1/TP1/PP1/ZeRO-0"}


def test_global_batch_change_is_refused_before_workers_start(dp2, capsys, monkeypatch):
    """A step reads samples [s·G, (s+1)·G): another global batch would skip or repeat data. (PP>1 with
    ZeRO-2/3 is refused by config validation: test_pretrain_faults.py.)"""
    forbid_workers(monkeypatch)
    code = pretrain_ora.main(arguments(dp2.parent / "run.yaml", dp2, ZERO1 + ["train.global_batch_size=16"], nproc=1))
    stderr = capsys.readouterr().err
    assert code == 2 and "train.global_batch_size" in stderr and "Traceback" not in stderr
    assert "run dir:" not in stderr, "no worker started"


