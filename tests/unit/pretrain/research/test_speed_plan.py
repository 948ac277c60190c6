"""pretrain/research/speed_plan.py: a step's parts add up, ZeRO-1 sends the trainable parameters only,
the ranking holds exactly the layouts that fit, fastest first; the CLI's output and its errors.

Compute times come from `compute_double` (a fixed rate), not from the step-time model: these tests hold
the plan's arithmetic, not its compute figures."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from pretrain_runs import TINY_RUN

from ora_megatron.config_io import ConfigError
from ora_megatron.stages import build_staged_gpt
from pretrain.checkpoint.consolidate import tp1_parallel_state
from pretrain.config.run_config import load_run_config
from pretrain.research import memory_model, speed_plan
from pretrain.research.speed import comms
from pretrain.research.speed.gpus import H100
from pretrain.runtime.optimizer import param_groups

# TINY_RUN as the plans read it: a global batch of 32 (accumulation to share out), bf16
BASE = ["train.global_batch_size=32", "train.steps=1000", "deepspeed.precision=bf16", "deepspeed.zero_stage=1"]
SET = [flag for item in BASE for flag in ("--set", item)]


# 1 ms per 1,000 tokens of a micro-batch over TP, 1 ns per stepped element
compute_double = speed_plan.ComputeModel(
    micro_batch_s=lambda cfg, gpu: cfg.train.micro_batch_size * cfg.model.seq_length / cfg.parallel.tensor
    * 1e-6,
    optimizer_s=lambda gpu, stepped, gradients: stepped * 1e-9)


@pytest.fixture
def planner() -> speed_plan.SpeedPlanner:
    return speed_plan.SpeedPlanner(H100, compute=compute_double)


@pytest.fixture(scope="module")
def run_config(tmp_path_factory) -> str:
    """TINY_RUN as a file, as the plans read a config (a preset's name or a file)."""
    path = tmp_path_factory.mktemp("speed_plan") / "tiny.yaml"
    path.write_text(TINY_RUN)
    return str(path)


def test_zero1_sends_the_trainable_parameters_only(planner, run_config):
    cfg = load_run_config(run_config, [*BASE, "train.micro_batch_size=2"])
    with tp1_parallel_state(), torch.device("meta"):
        model = build_staged_gpt(cfg.model, cfg.parallel)
    params = list(model.parameters())
    trainable = sum(p.numel() for p in params if p.requires_grad)
    frozen = sum(p.numel() for p in params if not p.requires_grad)
    assert frozen == 2 * 2 * 64 * 64  # Q and K of both layers
    result = planner.plan(cfg, 16)  # DP 16
    n, e = 16, 2
    groups = {}
    for p_group in param_groups(model, cfg.optimizer.weight_decay):
        groups[p_group["name"]] = sum(p.numel() for p in p_group["params"])
    padded = sum(-(-g // (2 * n)) * 2 * n for g in groups.values())
    assert sum(groups.values()) == trainable
    assert result["data_parallel"]["bytes"] == pytest.approx(2 * (n - 1) / n * e * trainable + (n - 1) / n * e * padded)


def test_the_optimizer_stretch_gets_each_stages_gradient_work(run_config):
    """The optimizer's stretch is priced on every pipeline stage with that stage's trainable tensors, the
    step's accumulation and the ZeRO stage; the longest stage's is the step's."""
    seen = []

    def optimizer_s(gpu, stepped, gradients):
        seen.append(gradients)
        return len(gradients.tensor_sizes) * 1e-3

    compute = speed_plan.ComputeModel(compute_double.micro_batch_s, optimizer_s)
    cfg = load_run_config(run_config, [*BASE, "parallel.pipeline=2", "train.micro_batch_size=2",
                                       "stability.spike_skip.enabled=false"])
    result = speed_plan.SpeedPlanner(H100, compute=compute).plan(cfg, 8)  # PP 2 × DP 4: accumulation 4
    assert len(seen) == 2 and {(g.micro_batches, g.zero_stage) for g in seen} == {(4, 1)}
    with tp1_parallel_state():
        shards = memory_model.stage_shards(cfg, memory_model.pipeline_stages(cfg.model, cfg.parallel))
    # Each stage's trainable tensors (both end stages hold the tied embedding: each reduces its gradient).
    assert [g.tensor_sizes for g in seen] == [tuple(s.numel for s in held if s.trainable) for held in shards]
    assert result["step_s"]["optimizer"] == pytest.approx(max(len(g.tensor_sizes) for g in seen) * 1e-3)


def test_a_step_is_its_micro_batches_communication_and_optimizer(planner, run_config):
    cfg = load_run_config(run_config, [*BASE, "parallel.tensor=2", "train.micro_batch_size=2"])
    result = planner.plan(cfg, 8)  # TP 2 × DP 4: accumulation 32 / (2 · 4) = 4
    step, lay = result["step_s"], result["layout"]
    assert (lay["data"], lay["grad_accum"]) == (4, 4)
    micro_batch = 2 * 32 / 2 * 1e-6
    assert step["compute"] == pytest.approx(4 * micro_batch)
    one_all_reduce = comms.all_reduce_s(2 * 32 * 64 * 2, H100, comms.Group(2))
    assert step["tensor_parallel"] == pytest.approx(4 * 10 * one_all_reduce)  # 2 layers × 4 + 2, 4 micro-batches
    assert step["bubble"] == step["pipeline_p2p"] == 0
    assert step["total"] == pytest.approx(sum(v for k, v in step.items() if k != "total"))
    assert result["tokens_per_s"] == pytest.approx(32 * 32 / step["total"])
    assert result["days"] == pytest.approx(1000 * step["total"] / 86400)
    assert result["gpu_hours"] == pytest.approx(1000 * step["total"] * 8 / 3600)


def test_the_pipeline_bubble_is_p_minus_1_slots_of_m_plus_p_minus_1(planner, run_config):
    cfg = load_run_config(run_config, [*BASE, "parallel.pipeline=2", "train.micro_batch_size=2"])
    step = planner.plan(cfg, 8)["step_s"]  # DP 4, 4 micro-batches through 2 stages
    pipeline = step["compute"] + step["tensor_parallel"] + step["pipeline_p2p"] + step["bubble"]
    assert step["bubble"] / pipeline == pytest.approx(comms.pipeline_bubble_fraction(2, 4))
    assert step["pipeline_p2p"] > 0


def _memory_totals(run_config: str, world: int) -> dict[int, int]:
    """memory_model.plan's total for every micro-batch at TP 1, PP 1, ZeRO-1."""
    totals = {}
    for mb in (1, 2, 4):
        cfg = load_run_config(run_config, [*BASE, f"train.micro_batch_size={mb}"])
        totals[mb] = memory_model.plan(cfg, world)["bytes"]["total"]
    return totals


def test_the_ranking_holds_the_layouts_that_fit_fastest_first(run_config, capsys):
    with tp1_parallel_state():
        totals = _memory_totals(run_config, 8)
    # a GPU on which the smaller micro-batches fit and micro-batch 4 does not (10% kept free)
    limit = (totals[2] + totals[4]) / 2
    assert totals[1] < totals[2] < limit < totals[4]
    small = dataclasses.replace(H100, memory_gb=limit / 0.9 / memory_model.GIB)
    planner = speed_plan.SpeedPlanner(small, compute=compute_double)
    args = speed_plan.parse_args(["--config", run_config, *SET, "--gpu", "h100", "--rank", "--tp", "1", "--pp", "1",
                                   "--zero-stage", "1"])
    ranking = speed_plan.ranked(planner, args, [1])
    assert sorted(r["layout"]["micro_batch_size"] for r in ranking["layouts"]) == [1, 2]
    assert ranking["do_not_fit"] == 1  # micro-batch 4
    speeds = [r["tokens_per_s"] for r in ranking["layouts"]]
    assert speeds == sorted(speeds, reverse=True)
    assert all(r["memory"]["verdict"] == "fits" for r in ranking["layouts"])


def test_zero3_is_ranked_on_request_only_and_never_compiled(planner, run_config):
    def stages(*flags: str) -> tuple[set[int], int]:
        args = speed_plan.parse_args(["--config", run_config, *SET, "--gpu", "h100", "--rank", "--tp", "1", "--pp", "1",
                                      "--micro-batch", "2", *flags])
        ranking = speed_plan.ranked(planner, args, [1])
        return {r["layout"]["zero_stage"] for r in ranking["layouts"]}, ranking["refused_by_config"]

    assert stages() == ({0, 1, 2}, 0)  # ZeRO-3's hook time is not modelled: not ranked beside the others
    assert stages("--zero-stage", "3") == ({3}, 0)
    with pytest.raises(ConfigError, match="speed.compile"):  # the config refuses compiled ZeRO-3
        stages("--zero-stage", "3", "--compiled")


def test_the_cli_prints_a_plan_and_a_ranking(run_config, capsys):
    assert speed_plan.main(["--config", run_config, *SET, "--gpu", "a100", "--nodes", "2", "--micro-batch", "2",
                            "--json"],
                           compute=compute_double) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["layout"]["world_size"], result["layout"]["nodes"], result["gpu"]) == (16, 2, "A100 SXM 80GB")
    assert speed_plan.main(["--config", run_config, *SET, "--gpu", "h200", "--rank", "--nodes", "1", "--tp", "2",
                            "--top", "3"], compute=compute_double) == 0
    out = capsys.readouterr().out
    assert "layouts fit" in out and out.count("\n| 1 | 2 |") == 3


@pytest.mark.parametrize("flags, named", [(["--nodes", "0"], "--nodes"), (["--nodes", "1", "2"], "--nodes"),
                                          (["--nodes", "1", "--tp", "3"], "parallel.tensor")])
def test_bad_flags_exit_2_naming_them(run_config, capsys, flags, named):
    assert speed_plan.main(["--config", run_config, *SET, "--gpu", "h100", *flags], compute=compute_double) == 2
    assert named in capsys.readouterr().err


@pytest.mark.slow  # traces the tiny model's CUDA ops on CPU once (seconds; cached under runs/speed_traces)
def test_the_step_time_model_supplies_the_compute(run_config):
    from pretrain.research.speed.code_versions import GradientWork
    from pretrain.research.speed.step_time import micro_batch_time, optimizer_step_time

    cfg = load_run_config(run_config, [*BASE, "train.micro_batch_size=2"])
    result = speed_plan.SpeedPlanner(H100, compute=speed_plan.STEP_TIME_MODEL).plan(cfg, 8)
    with tp1_parallel_state():
        shards = memory_model.stage_shards(cfg, memory_model.pipeline_stages(cfg.model, cfg.parallel))
    stepped = memory_model.optimizer_elements(shards[0], memory_model.layout_of(cfg, 8))
    assert result["layout"]["grad_accum"] == 2
    assert result["step_s"]["compute"] == pytest.approx(2 * micro_batch_time(cfg, H100, 2).seconds)
    gradients = GradientWork(tuple(s.numel for s in shards[0] if s.trainable), 2, 1)
    assert result["step_s"]["optimizer"] == pytest.approx(optimizer_step_time(H100, stepped,
                                                                              gradients=gradients).seconds)
