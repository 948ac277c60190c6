"""paper_cost: GPU-hours of a spec's runs at paper scale from the speed plan's step time, and the memory
plan's verdict.

Compute times come from `compute_double` (a fixed rate): the test holds paper_cost's arithmetic over the
speed plan, not the step-time model's figures."""

from __future__ import annotations

import json

import pytest

from pretrain.research import paper_cost
from pretrain.research.speed.gpus import H200
from pretrain.research.speed_plan import ComputeModel, SpeedPlanner

# 1 ms per 1,000 tokens of a micro-batch, 1 ns per stepped element
compute_double = ComputeModel(micro_batch_s=lambda cfg, gpu: cfg.train.micro_batch_size
                              * cfg.model.seq_length * 1e-6,
                              optimizer_s=lambda gpu, stepped, gradients: stepped * 1e-9)


@pytest.mark.slow  # the memory plan builds each distinct model on the meta device: seconds
def test_core_costs_its_steps_times_the_speed_plan_s_step(capsys):
    assert paper_cost.main(["--specs", "core", "--gpu", "h200", "--json"], compute=compute_double) == 0
    report = json.loads(capsys.readouterr().out)
    (core,) = report["specs"]
    tokens = 100_000 * 128 * 512  # the Small preset: steps × global batch × sequence length
    assert (core["runs"], core["gpus_per_run"], core["tokens_per_run"]) == (15, 8, [tokens, tokens])
    assert core["runs_that_fit"] == 15  # Small on 8 × 141 GB

    spec = paper_cost.load_spec(paper_cost.EXPERIMENTS / "core.yaml")
    runs = paper_cost.expand(spec, "paper", None, [], paper_cost.Path("unused"))
    planner = SpeedPlanner(H200, compute=compute_double)
    steps = [planner.plan(run.cfg, 8)["step_s"]["total"] for run in runs]
    assert core["gpu_hours"] == pytest.approx(sum(100_000 * s * 8 / 3600 for s in steps))
    assert core["step_s"] == pytest.approx([min(steps), max(steps)])
    assert core["node_days"] == pytest.approx(core["gpu_hours"] / 8 / 24)


def test_an_unknown_gpu_kind_is_refused(capsys):
    with pytest.raises(SystemExit):
        paper_cost.main(["--specs", "core", "--gpu", "v100"], compute=compute_double)
    assert "--gpu" in capsys.readouterr().err
