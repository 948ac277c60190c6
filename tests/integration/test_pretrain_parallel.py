"""Training on 2 gloo processes: every layout trains and agrees with one process (fp32)."""

from __future__ import annotations

import pytest
from pretrain_runs import LAYOUTS, losses_by_step, summary

# The runs (reference, layout_runs) are the session's (conftest.py): other tests read them too.
pytestmark = pytest.mark.distributed


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
    per_rank = [r["optimizer_state_elements"] for r in result.allocated_by_rank]
    assert sum(per_rank) == 2 * result.trainable_params  # Adam: exp_avg + exp_avg_sq
    assert all(0 < n < 2 * result.trainable_params for n in per_rank), "state is partitioned"
    # Reduced fp32 gradients, partitioned too, each byte counted once.
    assert sum(r["gradient_bytes"] for r in result.allocated_by_rank) == 4 * result.trainable_params
    assert result.frozen_params == 2 * 2 * 64 * 64  # Q and K of 2 layers, outside the optimizer


def test_pipeline_gradient_bytes_are_left_unmeasured_not_zero(layout_runs):
    """The pipeline engine steps inside train_batch: no point to read the gradients from."""
    assert [r["gradient_bytes"] for r in summary(layout_runs["pp2-zero1"]).allocated_by_rank] == [None, None]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_parameter_counts_are_global_in_every_layout(reference, layout_runs, layout):
    expected = summary(reference)
    result = summary(layout_runs[layout])
    assert (result.trainable_params, result.frozen_params) == (expected.trainable_params,
                                                                   expected.frozen_params)


def test_activation_checkpointing_changes_no_loss(reference, trained_runs):
    run_dir = trained_runs.trained(["speed.activation_checkpointing=true"])
    assert losses_by_step(run_dir) == losses_by_step(reference)


def test_single_process_state_and_frozen_split(reference):
    result = summary(reference)
    assert result.allocated_by_rank[0]["optimizer_state_elements"] == 2 * result.trainable_params
    assert result.allocated_by_rank[0]["gradient_bytes"] == 4 * result.trainable_params
    assert result.final_test_loss is not None and result.tokens_seen == 6 * 8 * 32
