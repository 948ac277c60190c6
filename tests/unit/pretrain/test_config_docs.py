"""The config documents itself (docs/config.md is current, every field described) and presets
inherit from a shared `base:` file."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ora_megatron.config_io import ConfigError, load_yaml, to_dict
from pretrain.config.docs import DOC_PATH, REGENERATE, main, render, sections, undocumented
from pretrain.config.run_config import RunConfig, load_run_config
from pretrain.paths import PRESETS

CONFIGS = PRESETS


# ------------------------------------------------------------------ docs/config.md


def test_every_config_field_has_a_description():
    assert undocumented(RunConfig) == [], "add a docstring line after each of these fields"


def test_docs_are_current():
    assert DOC_PATH.read_text() == render(RunConfig), f"docs/config.md is stale: run `{REGENERATE}`"
    assert main(["--check"]) == 0


def test_every_section_is_documented():
    names = set(sections(RunConfig).values())
    assert {"model", "model.attention", "parallel", "train", "eval", "eval.early_stopping", "speed", "freeze",
            "freeze.schedule entries", "optimizer", "data", "data.blend entries", "deepspeed",
            "logging", "checkpoint"} <= names
    text = render(RunConfig)
    for name in names - {""}:
        assert f"## {name}\n" in text


@dataclass
class Leaf:
    documented: int = 1
    """Has a description."""
    bare: float = 0.5


@dataclass
class Root:
    leaves: list[Leaf] = field(default_factory=list)
    """Nested entries."""


def test_undocumented_field_is_detected():
    assert undocumented(Root) == ["Leaf.bare"]


def test_types_and_defaults_are_readable():
    rows = {line.split(" | ")[0]: line for line in render(RunConfig).splitlines() if line.startswith("| `")}
    assert "| optional int | `null` |" in rows["| `decay_steps`"]
    styles = "cosine, linear, constant, cosine_restarts, polynomial, wsd"
    assert f"| one of: {styles} | `cosine` |" in rows["| `decay_style`"]
    assert "| list of [faults entries](#faults-entries) | `[]` |" in rows["| `faults`"]
    assert any(line.startswith("| `path` | str | required |") for line in render(RunConfig).splitlines())
    assert "[model.attention](#modelattention)" in rows["| `attention`"]


# ------------------------------------------------------------------ presets


@pytest.mark.parametrize("name, layers, width, heads, ffn, steps, lr, min_lr_ratio, warmup, schedule", [
    ("small", 6, 512, 8, 2048, 100_000, 5e-4, 0.1, 4000, ("cosine", None, 1.0, 1.0)),
    ("base", 12, 768, 12, 3072, 300_000, 3e-4, 0.1, 8000, ("cosine_restarts", 73_000, 1.0, 1.0)),
    ("large", 24, 1024, 16, 4096, 500_000, 2e-4, 0.05, 12000, ("polynomial", None, 1.0, 1.0)),
])
def test_paper_presets(name, layers, width, heads, ffn, steps, lr, min_lr_ratio, warmup, schedule):
    cfg = to_dict(load_run_config(str(CONFIGS / f"{name}.yaml")))
    model, opt = cfg["model"], cfg["optimizer"]
    assert (model["num_layers"], model["hidden_size"], model["num_attention_heads"], model["ffn_hidden_size"]) == \
        (layers, width, heads, ffn)
    assert (cfg["train"]["steps"], opt["lr"], opt["min_lr_ratio"], opt["warmup_steps"]) == \
        (steps, lr, min_lr_ratio, warmup)
    # What the three share (shared/paper_common.yaml).
    assert model["family"] == "gpt2" and model["seq_length"] == 512 and model["vocab_size"] == 32000
    assert (model["hidden_dropout"], model["attention_dropout"], model["seed"]) == (0.1, 0.1, 42)
    assert model["attention"]["type"] == "ora" and model["attention"]["orthogonal_method"] == "qr"
    assert cfg["parallel"] == {"tensor": 1, "pipeline": 1}
    train = cfg["train"]
    # Global batch 128 everywhere; the micro-batch is each recipe's (README: 1, 2 and 4 nodes, no accumulation).
    assert (train["micro_batch_size"], train["global_batch_size"]) == ({"small": 16, "base": 8, "large": 4}[name], 128)
    assert (train["log_interval"], train["eval_interval"], cfg["eval"]["iters"]) == (10, 1000, 50)
    assert cfg["eval"]["early_stopping"] == {"enabled": False, "patience": 10, "min_delta": 0.001}
    assert (opt["decay_style"], opt["restart_cycle_steps"], opt["restart_peak_decay"], opt["decay_power"]) == schedule
    assert (opt["decay_steps"], opt["beta1"], opt["beta2"], opt["eps"]) == (None, 0.9, 0.98, 1e-8)
    assert (opt["weight_decay"], opt["clip_grad"]) == (0.01, 1.0)
    assert cfg["data"]["manifest"] == "runs/data/shards/manifest.json"
    assert cfg["deepspeed"] == {"zero_stage": 1, "precision": "bf16", "zero_with_one_rank": False}
    assert cfg["logging"]["wandb_mode"] == "offline"
    # Every 20 minutes (the Young/Daly interval for Base on 16 nodes), 20,000 steps as a backstop.
    assert cfg["checkpoint"] == {"save_interval": 20000, "save_interval_s": 1200.0, "keep_last": 3}
    # Unattended: restarts, the hang watchdog below the collective timeout, skip-step and rewinds.
    supervision, stability = cfg["supervision"], cfg["stability"]
    assert (supervision["max_restarts"], supervision["hang_timeout_s"], supervision["collective_timeout_s"]) == (
        3, 300.0, 600)
    assert stability["spike_skip"] == {"enabled": True, "window": 128, "sigma": 6.0}
    assert stability["rewind"] == {"enabled": True, "skip_batches": 200, "max_rewinds": 3}
    assert cfg["faults"] == []


def test_overrides_apply_after_the_base():
    cfg = load_run_config(str(CONFIGS / "small.yaml"), ["optimizer.lr=1e-3", "model.seq_length=256"])
    assert cfg.optimizer.lr == 1e-3 and cfg.model.seq_length == 256
    assert cfg.optimizer.warmup_steps == 4000 and cfg.model.vocab_size == 32000


# ------------------------------------------------------------------ the `base:` key


def _write(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_child_wins_and_mappings_merge(tmp_path):
    _write(tmp_path, "root.yaml", "model: {num_layers: 2, hidden_size: 64, attention: {type: ora, joint_heads: true}}\n"
                                  "data: {blend: [{path: a}, {path: b}]}\ntrain: {steps: 10}")
    _write(tmp_path, "mid.yaml", "base: root.yaml\nmodel: {num_layers: 4, attention: {type: vanilla}}")
    child = _write(tmp_path, "sub/child.yaml", "base: ../mid.yaml\ndata: {blend: [{path: c}]}\ntrain: {steps: 20}")
    assert load_yaml(child) == {
        "model": {"num_layers": 4, "hidden_size": 64, "attention": {"type": "vanilla", "joint_heads": True}},
        "data": {"blend": [{"path": "c"}]},  # lists are replaced, not concatenated
        "train": {"steps": 20},
    }


def test_missing_base_names_key_and_file(tmp_path):
    child = _write(tmp_path, "child.yaml", "base: nowhere.yaml\ntrain: {steps: 20}")
    with pytest.raises(ConfigError, match="child.yaml.*nowhere.yaml") as err:
        load_yaml(child)
    assert err.value.key == "base"


def test_base_cycle_names_key_and_file(tmp_path):
    _write(tmp_path, "a.yaml", "base: b.yaml\ntrain: {steps: 1}")
    b = _write(tmp_path, "b.yaml", "base: a.yaml\ntrain: {steps: 2}")
    with pytest.raises(ConfigError, match="cycle.*b.yaml") as err:
        load_yaml(b)
    assert err.value.key == "base"
    self_loop = _write(tmp_path, "self.yaml", "base: self.yaml")
    with pytest.raises(ConfigError, match="cycle"):
        load_yaml(self_loop)
