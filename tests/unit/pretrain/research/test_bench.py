"""pretrain.research.benchmarks.compare_arms: arm names, the JSON report and its ratio table, on a tiny
config (one process)."""

from __future__ import annotations

import json

import pytest

from ora_megatron.config_io import ConfigError
from ora_megatron.hadamard import kronecker_split
from pretrain.research.benchmarks.compare_arms import RATIO_KEYS, SCHEMA, arm_overrides, main, ratios

TINY = """\
model:
  num_layers: 2
  hidden_size: 32
  num_attention_heads: 2
  ffn_hidden_size: 64
  seq_length: 16
  vocab_size: 64
  make_vocab_size_divisible_by: 8
  hidden_dropout: 0.0
  attention_dropout: 0.0
train:
  micro_batch_size: 2
  global_batch_size: 4
deepspeed:
  zero_stage: 1
  precision: fp32
"""
LAYERS, D, TOKENS_PER_STEP = 2, 32, 4 * 16


def test_arm_names():
    assert arm_overrides("vanilla") == ["model.attention.type=vanilla"]
    assert arm_overrides("synthesizer_factorized") == ["model.attention.type=synthesizer_factorized"]
    assert arm_overrides("ora_hadamard") == ["model.attention.type=ora", "model.attention.orthogonal_method=hadamard"]
    for bad in ("ora_givens", "dense", "vanilla_qr"):
        with pytest.raises(ConfigError, match="unknown arm"):
            arm_overrides(bad)


def test_ratios_divide_by_the_first_arm():
    def arm(name, scale):
        return {"arm": name, "step_time_s": {"median": 2.0 * scale}, "step_cpu_time_s": {"median": 3.0 * scale},
                "tokens_per_s": 10.0 / scale, "inference_tokens_per_s": 20.0 / scale,
                "analytic_flops_per_token": 5.0 * scale, "measured_flops_per_token": 4.0 * scale,
                "grad_and_optimizer_state_bytes": 8 * scale, "memory": {"saved_activation_bytes": 0}}

    table = ratios([arm("a", 1.0), arm("b", 0.5)])
    assert table[0] == {"arm": "a", **{k: (None if k == "saved_activation_bytes" else 1.0) for k in RATIO_KEYS}}
    assert table[1]["step_time"] == 0.5 and table[1]["tokens_per_s"] == 2.0 and table[1]["analytic_flops"] == 0.5


@pytest.mark.slow
def test_bench_report_on_a_tiny_config(tmp_path, capsys):
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY)
    out = tmp_path / "bench.json"
    assert main(["--config", str(config), "--arms", "vanilla,ora_hadamard", "--steps", "3", "--warmup", "1",
                 "--set", "model.seed=3", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["schema"] == SCHEMA and report["steps"] == 3 and report["warmup"] == 1
    assert report["shape"]["tokens_per_step"] == TOKENS_PER_STEP and report["shape"]["zero_stage"] == 1
    assert report["command"][-2:] == ["--json", str(out)]
    vanilla, hadamard = report["arms"]
    assert [vanilla["arm"], hadamard["arm"]] == ["vanilla", "ora_hadamard"]
    assert hadamard["attention"] == {"type": "ora", "orthogonal_method": "hadamard"}
    for arm in report["arms"]:
        assert len(arm["step_time_s"]["samples"]) == len(arm["inference_time_s"]["samples"]) == 3
        assert arm["tokens_per_s"] == pytest.approx(TOKENS_PER_STEP / arm["step_time_s"]["median"])
        assert len(arm["losses"]) == 3 and all(0 < loss < 10 for loss in arm["losses"])
        # fp32 Adam: two moments of 4 bytes per trainable parameter; fp32 gradients, read live.
        memory = arm["memory"]
        assert memory["optimizer_state_bytes"] == 8 * arm["trainable_params"]
        assert memory["gradient_bytes"] == 4 * arm["trainable_params"]
        assert memory["trainable_parameter_bytes"] == 4 * arm["trainable_params"]
        assert memory["saved_activation_bytes"] > 0
        assert "tflops" not in arm  # CPU: no peak table entry, no MFU
    # Frozen Q/K: 2 d×d per layer, out of the optimizer, and no Q/K biases (gpt2 has them in vanilla).
    assert vanilla["frozen_params"] == 0 and hadamard["frozen_params"] == 2 * LAYERS * D * D
    assert vanilla["trainable_params"] - hadamard["trainable_params"] == 2 * LAYERS * (D * D + D)
    # Counted FLOPs per token: the Q/K GEMMs (forward, input and weight gradient: 12·d² per layer)
    # are gone; the Kronecker contractions add 2·d·(a + b) per role, forward and backward.
    a, b = kronecker_split(D)
    saved = vanilla["measured_flops_per_token"] - hadamard["measured_flops_per_token"]
    assert saved == LAYERS * (12 * D * D - 2 * 2 * 2 * D * (a + b))
    assert vanilla["analytic_flops_per_token"] - hadamard["analytic_flops_per_token"] == saved
    first, second = report["ratios"]
    assert all(first[k] == 1.0 for k in RATIO_KEYS)
    assert second["arm"] == "ora_hadamard"
    assert second["step_time"] == hadamard["step_time_s"]["median"] / vanilla["step_time_s"]["median"]
    assert second["grad_and_optimizer_state_bytes"] == pytest.approx(
        hadamard["trainable_params"] / vanilla["trainable_params"])
    printed = capsys.readouterr().out
    assert "ratios to vanilla:" in printed and printed.count("ora_hadamard") == 2


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage,precision", [(0, "bf16"), (2, "fp32"), (3, "fp32"), (3, "bf16")])
def test_state_and_gradient_bytes_in_other_layouts(tmp_path, zero_stage, precision):
    """Adam keeps two fp32 moments per trainable parameter in every layout (in bf16 without ZeRO they
    belong to DeepSpeed's fp32 copies of the weights); gradients are held once, in the weights' dtype
    (ZeRO-3's fp32 view of its partition is the same memory), or in fp32 where bf16 ZeRO-3 accumulates
    the two micro-batches' gradients in fp32."""
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY)
    out = tmp_path / "bench.json"
    assert main(["--config", str(config), "--arms", "vanilla", "--steps", "1", "--warmup", "0", "--json", str(out),
                 "--set", f"deepspeed.zero_stage={zero_stage}", "--set", f"deepspeed.precision={precision}"]) == 0
    (arm,) = json.loads(out.read_text())["arms"]
    assert arm["memory"]["optimizer_state_bytes"] == 8 * arm["trainable_params"]
    fp32_accumulation = precision == "bf16" and zero_stage == 3  # micro-batch 2 of 4: accumulation 2
    assert arm["memory"]["gradient_bytes"] == (2 if precision == "bf16" and not fp32_accumulation else 4) * (
        arm["trainable_params"])


def test_bench_refuses_bad_arms_and_parallel_configs(tmp_path, capsys):
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY)
    assert main(["--config", str(config), "--arms", "vanilla,ora_givens"]) == 2
    assert "unknown arm 'ora_givens'" in capsys.readouterr().err
    assert main(["--config", str(config), "--set", "parallel.tensor=2"]) == 2
    assert "one process" in capsys.readouterr().err


def test_hadamard_chunks_benchmark_times_every_chunk_size(tmp_path, capsys):
    """pretrain/research/benchmarks/hadamard_chunks.py: a row per chunk size, one chunk of all tokens among them."""
    from pretrain.research.benchmarks.hadamard_chunks import main as chunks_main

    out = tmp_path / "chunks.json"
    argv = ["--d-model", "24", "--tokens", "10", "--chunks", "4,3", "--repeats", "2", "--json", str(out)]
    assert chunks_main(argv) == 0
    report = json.loads(out.read_text())
    assert [r["chunk_tokens"] for r in report["rows"]] == [10, 4, 3]
    whole = report["rows"][0]
    assert whole["forward_speedup"] == whole["input_grad_speedup"] == 1.0
    assert all(r["forward_ms"] > 0 and r["input_grad_ms"] > 0 for r in report["rows"])
    assert report["default_chunk_tokens"] > 10 and not any(r["default"] for r in report["rows"])
    assert "input grad ms" in capsys.readouterr().out


def test_orthogonal_draws_benchmark_times_every_method_and_measures_orthogonality(tmp_path, capsys):
    """pretrain/research/benchmarks/orthogonal_draws.py on the tiny preset (2 layers, d 64, 4 heads of 16)."""
    import torch

    from pretrain.research.benchmarks.orthogonal_draws import main as draws_main
    from pretrain.research.benchmarks.orthogonal_draws import orthogonality_error

    # two heads of d_k 2 in d 3: head 0 orthonormal, head 1 twice a unit vector and a unit one (error 4 − 1)
    weight = torch.tensor([[1.0, 0, 0], [0, 1, 0], [0, 0, 2], [1, 0, 0]])
    assert orthogonality_error(weight, 2) == 3.0
    out, table = tmp_path / "draws.json", tmp_path / "draws.md"
    assert draws_main(["--presets", "tiny", "--repeats", "2", "--layers", "1", "--json", str(out),
                       "--markdown", str(table)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["method"] for r in rows] == ["qr", "svd", "householder", "cayley", "hadamard"]
    for row in rows:
        assert (row["layers"], row["d_model"], row["heads"], row["d_k"], row["layers_drawn"]) == (2, 64, 4, 16, 1)
        assert len(row["draw_s_all"]) == 2 and row["model_draw_s"] == pytest.approx(2 * row["draw_s_median"])
        assert row["orthogonality_error"] < 1e-5
    assert "1 of 2 (scaled)" in table.read_text() and "| tiny | 2, 64, 4, 16 | cayley |" in capsys.readouterr().out


def test_a_profiled_step_names_its_stretches(tmp_path):
    """The GPU report's profile splits a step by compare_arms' ranges: with 2 micro-batches, one plain
    micro-batch, one last micro-batch and a DeepSpeed step call after each, each found with its host time."""
    from torch.profiler import ProfilerActivity, profile

    from ora_megatron.parallel import destroy_distributed, init_distributed
    from pretrain.research.benchmarks.compare_arms import PROFILED_STRETCHES, Arm, arm_config, synthetic_batches
    from pretrain.research.trace_breakdown import breakdown, load_events
    from pretrain.runtime.engine import build_engine

    config = tmp_path / "tiny.yaml"
    config.write_text(TINY)
    cfg, grad_accum = arm_config(str(config), [], "ora")
    init_distributed(1, 1, backend="gloo")
    try:
        runner = Arm("ora", cfg, grad_accum, build_engine(cfg, grad_accum))
        batches = synthetic_batches(cfg.model, cfg.train.micro_batch_size, count=2)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            runner.train_step(batches, 0)
    finally:
        destroy_distributed()
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    events = load_events(trace)
    ranges = [e["name"] for e in events if e.get("cat") == "user_annotation" and e["name"] in PROFILED_STRETCHES]
    assert sorted(ranges) == ["last_micro_batch", "micro_batch", "optimizer_step", "optimizer_step"]
    where = breakdown(events, 1, PROFILED_STRETCHES)["ops"]
    for name in PROFILED_STRETCHES:  # no kernels on CPU: a stretch's wall time is its host time
        assert where[name]["host_ms"] > 0 and where[name]["wall_ms"] == pytest.approx(where[name]["host_ms"]), name
