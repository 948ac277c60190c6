"""Datasets through megatron-core (GPTDataset / BlendedMegatronDatasetBuilder / mock) and a
deterministic micro-batch order that depends only on (seed, step), so a resumed run sees
exactly the batches the uninterrupted one would have."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.tokenizers import MegatronTokenizer

from data_tools.manifest import blend_per_split_from_manifest, load_manifest
from ora_megatron.config_io import ConfigError
from pretrain.config import BlendEntry, RunConfig

SPLITS = ("train", "valid", "test")


def tokenizer_path(cfg: RunConfig) -> Optional[str]:
    if cfg.data.tokenizer:
        return cfg.data.tokenizer
    if cfg.data.manifest:
        return load_manifest(cfg.data.manifest)["tokenizer"]["path"]
    return None


def build_tokenizer(cfg: RunConfig):
    """megatron-core's tokenizer: sentencepiece when a model is given, else its null tokenizer
    (mock data), sized so that ids stay below model.vocab_size."""
    path = tokenizer_path(cfg)
    if path is None:
        # megatron-core renamed its null tokenizer library "null" -> "null-text" (0.17+).
        from megatron.core.tokenizers.text.text_tokenizer import TOKENIZER_MAPPING_LIBRARIES

        library = "null-text" if "null-text" in TOKENIZER_MAPPING_LIBRARIES else "null"
        return MegatronTokenizer.from_pretrained(metadata_path={"library": library},
                                                 vocab_size=cfg.model.vocab_size - 1)
    return MegatronTokenizer.from_pretrained(tokenizer_path=path, metadata_path={"library": "sentencepiece"})


def _blend(entries: list[BlendEntry]):
    if not entries:
        return None
    return [e.path for e in entries], [e.weight for e in entries]


def dataset_config(cfg: RunConfig, tokenizer, cache_dir: Path) -> GPTDatasetConfig:
    data = cfg.data
    blend, blend_per_split, split = None, None, None
    if data.manifest:
        per_split = blend_per_split_from_manifest(data.manifest)
        if per_split[1] is None and per_split[2] is None:  # built without --split: cut by ratio
            blend, split = per_split[0], data.split
        else:
            blend_per_split = per_split
    elif data.blend:
        blend, split = _blend(data.blend), data.split
    elif data.train_blend:
        blend_per_split = [_blend(data.train_blend), _blend(data.valid_blend), _blend(data.test_blend)]
    else:
        split = data.split
    return GPTDatasetConfig(
        random_seed=data.seed, sequence_length=cfg.model.seq_length, blend=blend,
        blend_per_split=blend_per_split, split=split, tokenizer=tokenizer,
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=data.eod_mask_loss,
        create_attention_mask=False, path_to_cache=str(cache_dir))


def _datasets_and_splits(cfg: RunConfig, config: GPTDatasetConfig) -> list[tuple[str, list]]:
    """(prefix, split matrix) for every indexed dataset the run reads."""
    if config.blend is not None:
        matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(config.split))
        return [(prefix, matrix) for prefix in config.blend[0]]
    entries = []
    for i, blend in enumerate(config.blend_per_split or []):
        whole_split = [(0.0, 1.0) if j == i else None for j in range(3)]
        entries += [(prefix, whole_split) for prefix in (blend[0] if blend else [])]
    return entries


def check_data(cfg: RunConfig) -> None:
    """The tokenizer fits the embedding, and every dataset exists and gives each of its splits at
    least one document.

    Runs in the launching process, before any worker: megatron-core raises deep inside worker
    startup for a missing file, and loops forever on a split that rounds to zero documents; a token
    id past the embedding fails in the first forward (CPU) or as a device-side assert (GPU).
    """
    if cfg.data.mock:
        return
    key = "data." + cfg.data.sources[0]
    path = tokenizer_path(cfg)
    if path is None:
        raise ConfigError("data.tokenizer", "a sentencepiece model is needed to read indexed datasets")
    tokenizer = build_tokenizer(cfg)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError("model.vocab_size", f"{cfg.model.vocab_size} is smaller than the tokenizer's "
                                              f"{tokenizer.vocab_size} ids ({path})")
    config = dataset_config(cfg, tokenizer, cache_dir=Path("."))
    for prefix, matrix in _datasets_and_splits(cfg, config):
        if not (Path(prefix + ".idx").exists() and Path(prefix + ".bin").exists()):
            raise ConfigError(key, f"no indexed dataset at {prefix} (.bin/.idx)")
        documents = IndexedDataset(prefix).sequence_lengths.shape[0]
        for split, bounds in zip(SPLITS, matrix):
            if bounds is not None and round(bounds[0] * documents) == round(bounds[1] * documents):
                raise ConfigError(key, f"{prefix}: the {split} split {bounds} holds none of its {documents} "
                                       "documents; use fewer/larger datasets or another data.split")


def build_datasets(cfg: RunConfig, tokenizer, cache_dir: Path) -> dict[str, Optional[GPTDataset]]:
    """Train/valid/test datasets sized for the run (valid and test: a fixed set of eval batches)."""
    sizes = [cfg.train.steps * cfg.train.global_batch_size,
             cfg.train.eval_iters * cfg.train.global_batch_size,
             cfg.train.eval_iters * cfg.train.global_batch_size]
    config = dataset_config(cfg, tokenizer, cache_dir)
    cls = MockGPTDataset if cfg.data.mock else GPTDataset
    datasets = BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, config).build()
    return dict(zip(SPLITS, datasets))


@dataclass
class BatchOrder:
    """Which samples form micro-batch `micro` of global step `step` on data-parallel rank `dp_rank`.

    Global batch g of step s covers samples [s·G, (s+1)·G) of the (already shuffled) dataset;
    it is cut micro-batch-major, then by DP rank, like Megatron-LM's pretraining sampler.
    """

    micro_batch_size: int
    grad_accum: int
    dp_rank: int
    dp_size: int

    def indices(self, step: int, micro: int) -> range:
        global_batch = self.micro_batch_size * self.grad_accum * self.dp_size
        start = step * global_batch + (micro * self.dp_size + self.dp_rank) * self.micro_batch_size
        return range(start, start + self.micro_batch_size)


def collate(dataset, indices) -> dict[str, torch.Tensor]:
    samples = [dataset[i % len(dataset)] for i in indices]
    keys = ("tokens", "labels", "loss_mask")
    return {k: torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in keys}


class StepBatches:
    """The micro-batches of a step, for any split: as tensors, or as DeepSpeed's pipeline engine
    takes them (an iterator of (inputs, (labels, loss_mask)))."""

    def __init__(self, datasets: dict[str, Optional[GPTDataset]], order: BatchOrder):
        self.datasets, self.order = datasets, order

    def has(self, split: str) -> bool:
        return self.datasets.get(split) is not None

    def micro_batch(self, split: str, step: int, micro: int) -> dict[str, torch.Tensor]:
        return collate(self.datasets[split], self.order.indices(step, micro))

    def pipeline_iter(self, split: str, step: int):
        batches = [self.micro_batch(split, step, m) for m in range(self.order.grad_accum)]
        return iter([(b["tokens"], (b["labels"], b["loss_mask"])) for b in batches])
