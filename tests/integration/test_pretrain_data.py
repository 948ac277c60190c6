"""The pretraining entry point trains from data_tools output: a manifest, or explicit blends."""

from __future__ import annotations

import pytest
from pretrain_runs import TINY_RUN, losses_by_step, records, run, summary, write_config

from data_tools.manifest import blend_from_manifest

pytestmark = pytest.mark.distributed


def test_trains_from_manifest(tmp_path, shards):
    run_dir = tmp_path / "manifest_run"
    run(write_config(tmp_path), run_dir, [f"data.manifest={shards}/manifest.json", "data.mock=false",
                                          "train.steps=8", "model.vocab_size=400"], nproc=2)
    losses = losses_by_step(run_dir)
    assert losses[8] < losses[1]
    assert [r.step for r in records(run_dir, "valid")] == [3, 6, 8]
    assert summary(run_dir).final_test_loss is not None


def test_trains_from_explicit_blend_split_by_ratio(tmp_path, shards):
    prefixes, weights = blend_from_manifest(str(shards))["train"]
    blend = ",".join(f"{{path: {p}, weight: {w}}}" for p, w in zip(prefixes, weights))
    config = write_config(tmp_path, TINY_RUN.replace("data: {mock: true}",
                                                     f"data: {{blend: [{blend}], split: '90,5,5', "
                                                     f"tokenizer: {shards.parent / 'tok' / 'sp.model'}}}"))
    run_dir = tmp_path / "blend_run"
    run(config, run_dir, ["model.vocab_size=400", "data.split='50,25,25'"])
    losses = losses_by_step(run_dir)
    assert losses[6] < losses[1]
    assert records(run_dir, "valid")


def test_split_without_documents_is_a_config_error(tmp_path, shards):
    """megatron-core would loop forever on a split that rounds to zero documents."""
    prefixes, _ = blend_from_manifest(str(shards))["train"]
    config = write_config(tmp_path, TINY_RUN.replace(
        "data: {mock: true}", f"data: {{blend: [{{path: {prefixes[0]}}}], split: '98,1,1', "
                              f"tokenizer: {shards.parent / 'tok' / 'sp.model'}}}"))
    out = run(config, tmp_path / "never", ["model.vocab_size=400"], check=False, timeout=60)
    assert out.returncode == 2
    assert "data.blend" in out.stderr and "holds none of its" in out.stderr
    missing = write_config(tmp_path, TINY_RUN.replace("data: {mock: true}", "data: {blend: [{path: /nope/x}], "
                                                      f"tokenizer: {shards.parent / 'tok' / 'sp.model'}}}"))
    out = run(missing, tmp_path / "never", ["model.vocab_size=400"], check=False, timeout=60)
    assert out.returncode == 2 and "no indexed dataset at /nope/x" in out.stderr


def test_vocab_smaller_than_the_tokenizer_is_a_config_error(tmp_path, shards):
    """Caught before any worker starts, not as an index error in the first forward."""
    out = run(write_config(tmp_path), tmp_path / "never",
              [f"data.manifest={shards}/manifest.json", "data.mock=false", "model.vocab_size=300"],
              check=False, timeout=60)
    assert out.returncode == 2
    assert "model.vocab_size" in out.stderr and "smaller than the tokenizer's 400 ids" in out.stderr
    assert not (tmp_path / "never" / "metrics.jsonl").exists()
