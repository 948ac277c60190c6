"""Training on real (tokenized) data: the conftest `shards` corpus read through its manifest."""

from __future__ import annotations

from pathlib import Path

from pretrain_runs import RunCache


def manifest_overrides(shards: Path) -> list[str]:
    """TINY_RUN reading `shards`' manifest instead of mock data (its sentencepiece vocabulary is 400)."""
    return [f"data.manifest={shards}/manifest.json", "data.mock=false", "model.vocab_size=400"]


# One model for every test that needs a run on real data: a llama whose frozen Q/K are Hadamard
# transforms (the export writes them as dense matrices), trained past its last evaluation interval.
MANIFEST_RUN_MODEL = ["model.family=llama", "model.num_query_groups=2", "model.attention.orthogonal_method=hadamard",
                      "train.steps=8"]


def manifest_run(trained_runs: RunCache, shards: Path) -> Path:
    """TINY_RUN with MANIFEST_RUN_MODEL, 8 steps on two processes from `shards`' manifest; trained
    once per session, read only (its config: TINY_RUN, the overrides in its config.yaml)."""
    return trained_runs.trained([*manifest_overrides(shards), *MANIFEST_RUN_MODEL], nproc=2)
