"""init_from.path end to end: an export imported again computes its source's logits at TP1 and TP2,
and a run started from imported weights resumes like an uninterrupted one, without importing again."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from distributed import run_on_ranks
from pretrain_runs import TINY_RUN, command, env, losses_by_step, write_config

from ora_megatron.config_io import to_dict
from ora_megatron.parallel import destroy_distributed
from pretrain.checkpoint import reshard
from pretrain.checkpoint.consolidate import consolidated_state_dict, load_trained_model, tp1_parallel_state
from pretrain.checkpoint.import_plan import plan_import
from pretrain.config.run_config import ParallelConfig, RunConfig, load_run_config, read_run_config, validate_for_world
from pretrain.config.runtime_sections import DeepSpeedConfig
from pretrain.export.convert_to_hf import export
from pretrain.paths import REPO
from pretrain.run_files.run_dir import RunDir, checkpoint_tag, step_of_tag

pytestmark = pytest.mark.distributed

TOKENS = torch.randint(0, 256, (3, 32), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def exported(reference, tmp_path_factory):
    """(the source run's consolidated model's logits on TOKENS, its HF export): TINY_RUN's ORA run."""
    out = tmp_path_factory.mktemp("init_from") / "hf"
    assert export(RunDir(reference), out)["passed"]
    with tp1_parallel_state(), torch.no_grad():
        logits = load_trained_model(reference).model(TOKENS)[..., :256]
    return logits, out


def importing(config_dir, export_dir, *overrides: str) -> RunConfig:
    return load_run_config(str(write_config(config_dir)), [f"init_from.path={export_dir}", *overrides])


def engine_logits(cfg: RunConfig, state: dict) -> torch.Tensor:
    """The run's engine built as a worker builds it, the import loaded, logits of TOKENS gathered over TP."""
    from megatron.core import parallel_state

    from pretrain.runtime.engine import build_engine

    engine = build_engine(cfg, validate_for_world(cfg, torch.distributed.get_world_size()))
    reshard.load_weights(engine, state)
    engine.module.eval()
    with torch.no_grad():
        shard = engine.module(TOKENS)
    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(shard) for _ in range(parallel_state.get_tensor_model_parallel_world_size())]
    torch.distributed.all_gather(parts, shard.contiguous(), group=group)
    return torch.cat(parts, dim=-1)[..., :256]


def _tp2_then_zero3(rank: int, cfg: RunConfig, state: dict) -> list[torch.Tensor]:
    """The import in a TP2 engine, then (the same two processes regrouped as two data-parallel ranks)
    in a ZeRO-3 engine, whose parameters are partitioned."""
    from megatron.core import parallel_state

    tp2 = engine_logits(dataclasses.replace(cfg, parallel=ParallelConfig(tensor=2),
                                            deepspeed=DeepSpeedConfig(zero_stage=1, zero_with_one_rank=True)), state)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    zero3 = engine_logits(dataclasses.replace(cfg, deepspeed=DeepSpeedConfig(zero_stage=3)), state)
    return [tp2, zero3]


@pytest.mark.parametrize("source, target", [
    ("export", ["model.attention.type=vanilla"]), ("export", ["init_from.qk=draw"]),
    ("export", ["init_from.qk=imported"]), ("run dir", ["model.attention.type=vanilla"]),
    ("checkpoint", ["init_from.qk=imported"])],
    ids=["export-vanilla", "export-ora-draw", "export-ora-imported", "run-dir-vanilla", "checkpoint-ora-imported"])
def test_an_import_at_tp1_computes_its_source(exported, reference, tmp_path, source, target):
    """From the export, the run dir, or its last checkpoint: the source model's logits."""
    from ora_megatron.parallel import init_distributed

    logits, export_dir = exported
    path = {"export": export_dir, "run dir": reference,
            "checkpoint": RunDir(reference).checkpoint(RunDir(reference).latest_checkpoint())}[source]
    plan = plan_import(importing(tmp_path, path, *target))
    assert plan.record["kind"] == ("hugging_face" if source == "export" else "run")
    init_distributed(1, 1, backend="gloo")
    try:
        got = engine_logits(plan.cfg, plan.state)
    finally:
        destroy_distributed()
    assert (got - logits).abs().max() <= 1e-5


def test_an_export_imported_at_tp2_and_under_zero3_computes_its_source(exported, tmp_path):
    logits, export_dir = exported
    plan = plan_import(importing(tmp_path, export_dir, "init_from.qk=imported"))
    for rank in run_on_ranks(_tp2_then_zero3, 2, plan.cfg, plan.state, tensor=2):
        for got in rank:
            assert (got - logits).abs().max() <= 1e-5


# ---------------------------------------------------------------------------- resume
@pytest.fixture(scope="module")
def hf_gpt2(tmp_path_factory):
    """A random GPT2LMHeadModel of TINY_RUN's sizes, saved by transformers (its Q/K biases zero, as GPT-2
    initialises them; its activation the default gelu_new)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=32))
    path = tmp_path_factory.mktemp("hf_gpt2") / "gpt2"
    model.save_pretrained(path)
    return path, {k: v.clone() for k, v in model.state_dict().items()}


def launch(run_dir, overrides=()) -> str:
    import subprocess

    out = subprocess.run(command(run_dir.parent / "run.yaml", run_dir, overrides), cwd=REPO, env=env(),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stderr


def test_a_run_started_from_imported_weights_resumes_like_an_uninterrupted_one(hf_gpt2, trained_runs, tmp_path):
    """GPT-2's weights under ORA's frozen Q/K (imported): the uninterrupted run and one stopped at step 3
    and resumed (its source gone by then) log the same losses; the frozen Q/K stay the imported ones."""
    source, weights = hf_gpt2
    overrides = [f"init_from.path={source}", "init_from.qk=imported"]
    whole = trained_runs.trained(overrides)
    record = RunDir(whole).read_init_from()
    assert record["qk"] == "imported" and record["taken_over"] == {"model.activation": [None, "gelu_tanh"]}
    assert read_run_config(RunDir(whole)).model.activation == "gelu_tanh"

    write_config(tmp_path, TINY_RUN)
    resumed = tmp_path / "run"
    shutil.copytree(whole, resumed, ignore=shutil.ignore_patterns("tensorboard", "wandb", "summary.json"))
    run = RunDir(resumed)
    for tag in run.checkpoint_tags():
        if step_of_tag(tag) > 3:
            shutil.rmtree(run.checkpoint(tag))
    run.set_latest_checkpoint(checkpoint_tag(3))
    run.metrics.write_text("".join(line + "\n" for line in run.metrics.read_text().splitlines()
                                   if json.loads(line)["step"] <= 3))
    moved = source.with_name("moved")
    source.rename(moved)
    try:
        err = launch(resumed, overrides)
    finally:
        moved.rename(source)
    assert "resumed at step 3" in err and "nothing is imported" in err, err[-3000:]
    assert run.read_init_from() == record
    expected, got = losses_by_step(whole), losses_by_step(resumed)
    assert sorted(got) == list(range(1, 7))
    for step in range(4, 7):
        assert abs(got[step] - expected[step]) <= 1e-6 * abs(expected[step]), step
    cfg = read_run_config(run)
    state = consolidated_state_dict(cfg, run.checkpoint(checkpoint_tag(6))).state_dict
    c_attn = weights["transformer.h.0.attn.c_attn.weight"].t()
    assert torch.equal(state["layer1.layer.self_attention.linear_qkv.q_weight"], c_attn[:64])
    assert torch.equal(state["layer1.layer.self_attention.linear_qkv.k_weight"], c_attn[64:128])
    assert to_dict(cfg)["init_from"]["path"] == str(source)
    # Exported again: the tanh GELU it took over is written as the function it computes, and verified.
    figures = export(run, tmp_path / "hf_again")
    assert figures["passed"], figures
    config = json.loads((tmp_path / "hf_again" / "config.json").read_text())
    assert config["activation_function"] == "gelu_pytorch_tanh"
