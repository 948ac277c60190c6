"""The pretraining entry point trains from data_tools output: a manifest, or explicit blends."""

from __future__ import annotations

import math

import pytest
from manifest_runs import manifest_overrides, manifest_run
from pretrain_runs import TINY_RUN, arguments, losses_by_step, records, run, summary, write_config

from data_tools.manifest import blend_from_manifest, load_manifest
from pretrain import pretrain_ora


def test_trains_from_manifest(trained_runs, shards):
    run_dir = manifest_run(trained_runs, shards)  # 8 steps on two processes
    losses = losses_by_step(run_dir)
    assert losses[8] < losses[1]
    assert [r.step for r in records(run_dir, "valid")] == [3, 6, 8]
    assert summary(run_dir).final_test_loss is not None
    # Every evaluation reports the loss of each source of its split beside the blend's (the small sources
    # of the shards' seven hold no validation or test document).
    for split in ("valid", "test"):
        sources = {entry["source"] for entry in load_manifest(str(shards))["datasets"] if entry["split"] == split}
        assert len(sources) >= 2
        for record in records(run_dir, split):
            assert set(record.sources) == sources and all(math.isfinite(v) for v in record.sources.values())
    final = summary(run_dir)
    assert final.final_valid_loss_by_source == records(run_dir, "valid")[-1].sources
    assert final.final_test_loss_by_source == records(run_dir, "test")[-1].sources


@pytest.mark.distributed
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


def refused(config, run_dir, overrides, capsys) -> str:
    """pretrain_ora's message for a config it refuses (status 2) before any worker starts."""
    assert pretrain_ora.main(arguments(config, run_dir, overrides)) == 2
    return capsys.readouterr().err


def test_split_without_documents_is_a_config_error(tmp_path, shards, capsys):
    """megatron-core would loop forever on a split that rounds to zero documents."""
    prefixes, _ = blend_from_manifest(str(shards))["train"]
    config = write_config(tmp_path, TINY_RUN.replace(
        "data: {mock: true}", f"data: {{blend: [{{path: {prefixes[0]}}}], split: '98,1,1', "
                              f"tokenizer: {shards.parent / 'tok' / 'sp.model'}}}"))
    err = refused(config, tmp_path / "never", ["model.vocab_size=400"], capsys)
    assert "data.blend" in err and "holds none of its" in err
    missing = write_config(tmp_path, TINY_RUN.replace("data: {mock: true}", "data: {blend: [{path: /nope/x}], "
                                                      f"tokenizer: {shards.parent / 'tok' / 'sp.model'}}}"))
    assert "no indexed dataset at /nope/x" in refused(missing, tmp_path / "never", ["model.vocab_size=400"], capsys)


def test_vocab_smaller_than_the_tokenizer_is_a_config_error(tmp_path, shards, capsys):
    """Caught before any worker starts, not as an index error in the first forward."""
    overrides = [*manifest_overrides(shards), "model.vocab_size=300"]
    err = refused(write_config(tmp_path), tmp_path / "never", overrides, capsys)
    assert "model.vocab_size" in err and "smaller than the tokenizer's 400 ids" in err
    assert not (tmp_path / "never" / "metrics.jsonl").exists()
