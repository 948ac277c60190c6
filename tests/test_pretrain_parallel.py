"""Training on 2 gloo processes: every layout trains and agrees with one process (fp32)."""

from __future__ import annotations

import pytest

from pretrain_runs import losses_by_step, run, summary, write_config

LAYOUTS = {
    "dp2-zero0": ["deepspeed.zero_stage=0"],
    "dp2-zero1": ["deepspeed.zero_stage=1"],
    "dp2-zero2": ["deepspeed.zero_stage=2"],
    "dp2-zero3": ["deepspeed.zero_stage=3"],
    "tp2-zero1": ["parallel.tensor=2", "deepspeed.zero_stage=1"],
    "pp2-zero1": ["parallel.pipeline=2", "deepspeed.zero_stage=1"],
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("pretrain_parallel")


@pytest.fixture(scope="module")
def reference(workdir):
    run_dir = workdir / "single"
    run(write_config(workdir), run_dir)
    return run_dir


@pytest.fixture(scope="module")
def layout_runs(workdir):
    config = write_config(workdir)
    runs = {}
    for name, overrides in LAYOUTS.items():
        runs[name] = workdir / name
        run(config, runs[name], overrides, nproc=2)
    return runs


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_trains_and_matches_single_process(reference, layout_runs, layout):
    losses = losses_by_step(layout_runs[layout])
    assert sorted(losses) == list(range(1, 7))
    assert losses[6] < losses[1] - 0.1, "loss must fall"
    expected = losses_by_step(reference)[5]
    assert abs(losses[5] - expected) <= 1e-4 * abs(expected)


@pytest.mark.parametrize("layout", ["dp2-zero1", "dp2-zero2", "dp2-zero3"])
def test_optimizer_state_covers_exactly_the_trainable_params(layout_runs, layout):
    result = summary(layout_runs[layout])
    per_rank = [r["optimizer_state_elements"] for r in result["allocated_by_rank"]]
    assert sum(per_rank) == 2 * result["trainable_params"]  # Adam: exp_avg + exp_avg_sq
    assert all(0 < n < 2 * result["trainable_params"] for n in per_rank), "state is partitioned"
    assert result["frozen_params"] == 2 * 2 * 64 * 64  # Q and K of 2 layers, outside the optimizer


@pytest.mark.parametrize("layout", LAYOUTS)
def test_parameter_counts_are_global_in_every_layout(reference, layout_runs, layout):
    expected = summary(reference)
    result = summary(layout_runs[layout])
    assert (result["trainable_params"], result["frozen_params"]) == (expected["trainable_params"],
                                                                   expected["frozen_params"])


def test_activation_checkpointing_changes_no_loss(reference, workdir):
    run_dir = workdir / "recompute"
    run(write_config(workdir), run_dir, ["train.activation_checkpointing=true"])
    assert losses_by_step(run_dir) == losses_by_step(reference)


def test_single_process_state_and_frozen_split(reference):
    result = summary(reference)
    assert result["allocated_by_rank"][0]["optimizer_state_elements"] == 2 * result["trainable_params"]
    assert result["final_test_loss"] is not None and result["tokens_seen"] == 6 * 8 * 32
