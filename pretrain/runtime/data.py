"""Datasets through megatron-core (GPTDataset / BlendedMegatronDatasetBuilder / mock) and a
deterministic micro-batch order that depends only on (seed, step), so a resumed run sees
exactly the batches the uninterrupted one would have."""

from __future__ import annotations

import dataclasses
import sys
from concurrent.futures import Future, ThreadPoolExecutor
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

from data_tools.manifest import blend_per_split_from_manifest, load_manifest, manifest_path
from data_tools.shard_writer import manifest_shard_problems, sha256_file
from ora_megatron.config_io import ConfigError
from pretrain.config.run_config import RunConfig
from pretrain.config.runtime_sections import BlendEntry, DataConfig

SPLITS = ("train", "valid", "test")


def tokenizer_path(data: DataConfig) -> Optional[str]:
    if data.tokenizer:
        return data.tokenizer
    if data.manifest:
        return load_manifest(data.manifest)["tokenizer"]["path"]
    return None


def build_tokenizer(data: DataConfig, vocab_size: int):
    """megatron-core's tokenizer: sentencepiece when a model is given, else its null tokenizer
    (mock data) of `vocab_size` (model.vocab_size) ids, the last one the end of document."""
    path = tokenizer_path(data)
    if path is None:
        # megatron-core 0.17+ renamed its null tokenizer library "null" -> "null-text", and its vocab_size
        # now counts the end-of-document id (the last one) where the old one's added it.
        from megatron.core.tokenizers.text.text_tokenizer import TOKENIZER_MAPPING_LIBRARIES

        library = "null-text" if "null-text" in TOKENIZER_MAPPING_LIBRARIES else "null"
        ids = vocab_size if library == "null-text" else vocab_size - 1
        return MegatronTokenizer.from_pretrained(metadata_path={"library": library}, vocab_size=ids)
    return MegatronTokenizer.from_pretrained(tokenizer_path=path, metadata_path={"library": "sentencepiece"})


def _blend(entries: list[BlendEntry]):
    if not entries:
        return None
    return [e.path for e in entries], [e.weight for e in entries]


def dataset_config(data: DataConfig, seq_length: int, tokenizer, cache_dir: Path) -> GPTDatasetConfig:
    blend, blend_per_split, split = None, None, None
    if data.blend:
        blend, split = _blend(data.blend), data.split
    elif data.train_blend:
        blend_per_split = [_blend(data.train_blend), _blend(data.valid_blend), _blend(data.test_blend)]
    elif data.manifest:
        per_split = blend_per_split_from_manifest(data.manifest)
        if per_split[1] is None and per_split[2] is None:  # built without --split: cut by ratio
            blend, split = per_split[0], data.split
        else:
            blend_per_split = per_split
    else:
        split = data.split
    # Document masking travels as document ids, read off megatron-core's reset positions (`document_ids`):
    # its dense [s, s] mask per sample is never made.
    return GPTDatasetConfig(
        random_seed=data.seed, sequence_length=seq_length, blend=blend,
        blend_per_split=blend_per_split, split=split, tokenizer=tokenizer,
        reset_position_ids=data.reset_position_ids or data.reset_attention_mask,
        reset_attention_mask=data.reset_attention_mask, eod_mask_loss=data.eod_mask_loss,
        create_attention_mask=False, path_to_cache=str(cache_dir))


def _datasets_and_splits(config: GPTDatasetConfig) -> list[tuple[str, list]]:
    """(prefix, split matrix) for every indexed dataset the run reads."""
    if config.blend is not None:
        matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(config.split))
        return [(prefix, matrix) for prefix in config.blend[0]]
    entries = []
    for i, blend in enumerate(config.blend_per_split or []):
        whole_split = [(0.0, 1.0) if j == i else None for j in range(3)]
        entries += [(prefix, whole_split) for prefix in (blend[0] if blend else [])]
    return entries


def read_manifest(data: DataConfig) -> dict:
    """The run's data_tools manifest; a missing or unreadable one is a config error at data.manifest."""
    try:
        return load_manifest(data.manifest)
    except (OSError, ValueError) as e:
        raise ConfigError("data.manifest", f"cannot read {manifest_path(data.manifest)}: {e}") from None


def check_data(cfg: RunConfig) -> None:
    """The tokenizer is the one the manifest's shards were built with and fits the embedding; every
    dataset exists, matches its manifest entry (byte sizes, document count) and gives each of its
    splits at least one document. A split holding fewer tokens than one sample is warned about.

    Runs in the launching process, before any worker: megatron-core raises deep inside worker
    startup for a missing or truncated file, and loops forever on a split that rounds to zero
    documents; a token id past the embedding fails in the first forward (CPU) or as a device-side
    assert (GPU), and another tokenizer of the same size trains on ids that mean other pieces.
    """
    data = cfg.data
    if data.mock:
        return
    key = "data." + data.sources[0]
    manifest = read_manifest(data) if data.manifest else None
    path = tokenizer_path(data)
    if path is None:
        raise ConfigError("data.tokenizer", "a sentencepiece model is needed to read indexed datasets")
    if not Path(path).is_file():
        moved = "" if data.tokenizer else f" (the path {data.manifest} records): set data.tokenizer to its copy"
        raise ConfigError("data.tokenizer", f"no tokenizer model at {path}{moved}")
    tokenizer = build_tokenizer(data, cfg.model.vocab_size)
    if manifest is not None:
        _check_manifest_tokenizer(data, manifest, path, tokenizer.vocab_size)
    config = dataset_config(data, cfg.model.seq_length, tokenizer, cache_dir=Path("."))
    if manifest is not None:  # a stat and the .idx header of each file: a truncated or replaced shard fails here
        problems = manifest_shard_problems(manifest, str(Path(manifest_path(data.manifest)).resolve().parent))
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise ConfigError("data.manifest", f"the shards do not match {data.manifest}: {problems[0]}{more}")
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError("model.vocab_size", f"{cfg.model.vocab_size} is smaller than the tokenizer's "
                                              f"{tokenizer.vocab_size} ids ({path})")
    split_tokens = dict.fromkeys(SPLITS, 0)
    for prefix, matrix in _datasets_and_splits(config):
        if not (Path(prefix + ".idx").exists() and Path(prefix + ".bin").exists()):
            raise ConfigError(key, f"no indexed dataset at {prefix} (.bin/.idx)")
        dataset = IndexedDataset(prefix)
        starts = dataset.document_indices  # each document's first sequence, then the end
        documents = len(starts) - 1
        for split, bounds in zip(SPLITS, matrix):
            if bounds is None:
                continue
            first, end = round(bounds[0] * documents), round(bounds[1] * documents)  # as megatron-core cuts
            if first == end:
                raise ConfigError(key, f"{prefix}: the {split} split {bounds} holds none of its {documents} "
                                       "documents; use fewer/larger datasets or another data.split")
            split_tokens[split] += int(dataset.sequence_lengths[starts[first]:starts[end]].sum())
    sample = cfg.model.seq_length + 1  # a sample's inputs and its labels shifted by one
    for split, tokens in split_tokens.items():
        if 0 < tokens < sample:
            print(f"warning: the {split} split holds {tokens} tokens, fewer than one sample (model.seq_length + 1 "
                  f"= {sample}): each of its samples repeats the same tokens", file=sys.stderr)


def _check_manifest_tokenizer(data: DataConfig, manifest: dict, path: str, vocab_size: int) -> None:
    """The tokenizer the run uses (data.tokenizer, or the manifest's own path) is the file the shards
    were built with: the manifest records its sha256 and vocabulary size."""
    built = manifest["tokenizer"]
    differs = []
    if vocab_size != built["vocab_size"]:
        differs.append(f"vocab size {vocab_size} vs {built['vocab_size']}")
    digest = sha256_file(path)
    if digest != built["sha256"]:
        differs.append(f"sha256 {digest[:12]}… vs {built['sha256'][:12]}…")
    if differs:
        raise ConfigError("data.tokenizer", f"{path} is not the tokenizer the shards of {data.manifest} were "
                                            f"built with ({built['path']}): {', '.join(differs)}")


def build_datasets(cfg: RunConfig, tokenizer, cache_dir: Path) -> dict[str, Optional[GPTDataset]]:
    """Train/valid/test datasets sized for the run (valid and test: a fixed set of eval batches), and
    with eval.per_source each source's valid and test datasets, as `source_split(split, source)`."""
    sizes = [cfg.train.train_samples, cfg.eval_samples, cfg.eval_samples]
    config = dataset_config(cfg.data, cfg.model.seq_length, tokenizer, cache_dir)
    cls = MockGPTDataset if cfg.data.mock else GPTDataset
    datasets = dict(zip(SPLITS, BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, config).build()))
    for source, per_split in eval_sources(cfg.data, cfg.eval.per_source, config).items():
        # Built as a run whose valid/test blends were this source's entries alone would build them.
        single = dataclasses.replace(config, blend=None, split=None, blend_per_split=[None, *per_split])
        valid, test = BlendedMegatronDatasetBuilder(cls, [None, *sizes[1:]], lambda: True, single).build()[1:]
        datasets[source_split("valid", source)], datasets[source_split("test", source)] = valid, test
    return datasets


def source_split(split: str, source: str) -> str:
    """The key of one source's part of an evaluation split in build_datasets' result."""
    return f"{split}:{source}"


def eval_sources(data: DataConfig, per_source: bool, config: GPTDatasetConfig) -> dict[str, list]:
    """Source → [valid blend, test blend] of its entries in the run's blends (prefixes and weights as the
    manifest gives them; None where the source has none), for a manifest of two or more sources in its
    valid/test splits and eval.per_source (`per_source`). A manifest built without --split (its
    shards cut by data.split) evaluates the blend only."""
    if not (per_source and data.manifest):
        return {}
    manifest = read_manifest(data)
    root = Path(manifest_path(data.manifest)).resolve().parent
    source_of = {str(root / entry["prefix"]): entry.get("source", "") for entry in manifest["datasets"]}
    if config.blend_per_split is None:  # cut by ratio: a source's valid part is no blend of whole datasets
        return {}
    found: dict[str, list] = {}
    for index, blend in ((1, config.blend_per_split[1]), (2, config.blend_per_split[2])):
        for prefix, weight in zip(*blend) if blend else ():
            entry = found.setdefault(source_of[str(Path(prefix).resolve())], [None, None])
            if entry[index - 1] is None:
                entry[index - 1] = ([], [])
            entry[index - 1][0].append(prefix)
            entry[index - 1][1].append(weight)
    return dict(sorted(found.items())) if len(found) > 1 else {}


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


BATCH_KEYS = ("tokens", "labels", "loss_mask")


def document_keys(data: DataConfig) -> tuple[str, ...]:
    """What a batch carries besides BATCH_KEYS under document masking: megatron's per-sample positions
    (data.reset_position_ids) and each token's document (data.reset_attention_mask, `document_ids`)."""
    return (("position_ids",) if data.reset_position_ids else ()) + (
        ("document_ids",) if data.reset_attention_mask else ())


def document_ids(sample: dict) -> torch.Tensor:
    """[s]: which document of the sample each token is in, 0, 1, ...: a new one starts where megatron-core's
    reset positions restart at 0 (after each end-of-document token), so a token attends exactly where
    megatron's reset_attention_mask lets it."""
    return (torch.as_tensor(sample["position_ids"]) == 0).cumsum(0) - 1


def sample_value(sample: dict, key: str):
    """A sample's entry of batch key `key`: megatron-core's, or its `document_ids`."""
    return document_ids(sample) if key == "document_ids" else sample[key]


def collate(dataset, indices, pin_memory: bool = False, extra_keys: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    samples = [dataset[i % len(dataset)] for i in indices]
    batch = {k: torch.stack([torch.as_tensor(sample_value(s, k)) for s in samples]) for k in BATCH_KEYS + extra_keys}
    # Page-locked, the copy to the device runs asynchronously (`non_blocking=True`).
    return {k: v.pin_memory() for k, v in batch.items()} if pin_memory else batch


class StepBatches:
    """The micro-batches of a step, for any split: as tensors, or as DeepSpeed's pipeline engine
    takes them (an iterator of (inputs, (labels, loss_mask))).

    With `prefetch` (runs on a GPU, whose host is idle while the device computes), the next training
    micro-batch is read and collated in a background thread, into pinned memory, while the current
    one trains. The batch of (step, micro) is a function of those alone, so what is prefetched is
    what would have been read. On CPU the thread would take cores from the model's own threads.
    """

    def __init__(self, datasets: dict[str, Optional[GPTDataset]], order: BatchOrder, prefetch: bool = False,
                 extra_keys: tuple[str, ...] = ()):
        self.datasets, self.order, self.prefetch, self.extra_keys = datasets, order, prefetch, extra_keys
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch") if prefetch else None
        self._ahead: Optional[tuple[tuple[int, int], Future]] = None  # ((step, micro), its batch)

    def has(self, split: str) -> bool:
        return self.datasets.get(split) is not None

    def _read(self, split: str, step: int, micro: int) -> dict[str, torch.Tensor]:
        pin = self.prefetch and torch.cuda.is_available()
        return collate(self.datasets[split], self.order.indices(step, micro), pin_memory=pin,
                       extra_keys=self.extra_keys)

    def micro_batch(self, split: str, step: int, micro: int) -> dict[str, torch.Tensor]:
        if self._reader is None or split != "train":
            return self._read(split, step, micro)
        ahead, self._ahead = self._ahead, None
        batch = ahead[1].result() if ahead is not None and ahead[0] == (step, micro) else None
        if batch is None:
            batch = self._read(split, step, micro)
        following = (step, micro + 1) if micro + 1 < self.order.grad_accum else (step + 1, 0)
        self._ahead = (following, self._reader.submit(self._read, split, *following))
        return batch

    def pipeline_iter(self, split: str, step: int):
        batches = [self.micro_batch(split, step, m) for m in range(self.order.grad_accum)]
        return iter([(b["tokens"], (b["labels"], b["loss_mask"])) for b in batches])
