"""`ora_megatron.summary` on the Base preset, and config errors that name their key."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from pretrain_runs import REPO

from ora_megatron.config_io import ConfigError
from ora_megatron.model_config import load_model_section

BASE = str(REPO / "pretrain/configs/base.yaml")
BASE_FROZEN_QK = 2 * 12 * 768 * 768  # 14,155,776


def summary_json(*overrides: str) -> dict:
    args = [sys.executable, "-m", "ora_megatron.summary", "--config", BASE, "--json"]
    for o in overrides:
        args += ["--set", o]
    out = subprocess.run(args, cwd=REPO, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def base_summaries():
    return summary_json(), summary_json("model.attention.type=vanilla")


@pytest.mark.slow
def test_base_ora_counts(base_summaries):
    ora, vanilla = base_summaries
    assert ora["frozen_params"] == BASE_FROZEN_QK == 14_155_776
    qk_bias = 2 * 12 * 768
    assert ora["trainable_params"] == vanilla["trainable_params"] - BASE_FROZEN_QK - qk_bias
    assert vanilla["frozen_params"] == 0
    assert ora["params_by_component"]["attention_qk"] == {"trainable": 0, "frozen": BASE_FROZEN_QK}
    for key in ("total_params", "trainable_params", "frozen_params", "train_flops_per_token",
                "train_state_bytes"):
        assert ora[key] > 0


@pytest.mark.slow
def test_base_flops_and_state(base_summaries):
    ora, vanilla = base_summaries
    d, layers, tokens_frozen_wgrad = 768, 12, 2 * 2 * 768 * 768
    assert vanilla["train_flops_per_token"] - ora["train_flops_per_token"] == layers * tokens_frozen_wgrad
    assert ora["train_flops_ratio_to_vanilla"] < 1.0
    # bf16: 2-byte grads + fp32 master + two fp32 Adam moments per trainable parameter.
    assert ora["train_state_bytes"] == 14 * ora["trainable_params"]
    assert vanilla["train_state_bytes"] - ora["train_state_bytes"] == 14 * (BASE_FROZEN_QK + 2 * layers * d)


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("yaml_text, overrides, key", [
    ("model: {hidden_size: 100, num_attention_heads: 3}", [], "model.num_attention_heads"),
    ("model: {num_attention_heads: 6, hidden_size: 96}\nparallel: {tensor: 4}", [], "parallel.tensor"),
    ("model: {hidden_size: 64, num_attention_heads: 4, kv_channels: 128, attention: {type: ora}}",
     [], "model.kv_channels"),
    ("model: {attention: {type: ora, joint_heads: true}, hidden_size: 64, num_attention_heads: 8, kv_channels: 16}",
     [], "model.attention.joint_heads"),
    ("model: {hidden_sise: 64}", [], "model.hidden_sise"),
    ("model: {attention: {type: flash}}", [], "model.attention.type"),
    ("model: {num_layers: two}", [], "model.num_layers"),
    ("model: {}", ["model.attention.train_q=true"], "model.attention.train_q"),
    ("model: {num_layers: 3}\nparallel: {pipeline: 2}", [], "parallel.pipeline"),
    ("model: {make_vocab_size_divisible_by: 6}\nparallel: {tensor: 4}", [], "model.make_vocab_size_divisible_by"),
])
def test_config_errors_name_the_key(tmp_path, yaml_text, overrides, key):
    with pytest.raises(ConfigError) as err:
        load_model_section(_write(tmp_path, yaml_text), overrides)
    assert err.value.key == key


def test_overrides_are_typed(tmp_path):
    path = _write(tmp_path, "model: {hidden_size: 64}")
    section = load_model_section(path, ["model.hidden_size=128", "model.attention.type=ora",
                                        "model.attention.init_std=1e-2", "parallel.tensor=2"])
    assert section.model.hidden_size == 128 and section.parallel.tensor == 2
    assert section.model.attention.type == "ora" and section.model.attention.init_std == 0.01


@pytest.mark.slow
def test_summary_cli_reports_config_error(tmp_path):
    path = _write(tmp_path, "model: {hidden_size: 100, num_attention_heads: 3}")
    out = subprocess.run([sys.executable, "-m", "ora_megatron.summary", "--config", path],
                         cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 2
    assert "model.num_attention_heads" in out.stderr
