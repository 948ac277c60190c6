"""The build manifest: what build_shards wrote, and the blends the training side reads from it.

Build side: `blend_weights` (per split, each shard's weight) and `assemble_manifest` give
build_shards the manifest it writes last.

Training-side API (the only data_tools functions `pretrain` needs):

    blend_from_manifest(path) -> dict[str, tuple[list[str], list[float]]]
    blend_per_split_from_manifest(path) -> list[tuple[list[str], list[float]] | None]

The second is exactly megatron-core's `BlendedMegatronDatasetConfig.blend_per_split`
(`List[Optional[Tuple[List[str], Optional[List[float]]]]]`, ordered like
`megatron.core.datasets.utils.Split`: train, valid, test).
"""

import dataclasses
import json
import os
from collections import Counter
from typing import TYPE_CHECKING

from data_tools.readers import DataError, InputFile, input_summary

# For annotations only: importing shard_writer would load megatron-core's dataset code into every
# module that reads SPLITS or a manifest from here (build_options, split_plan).
if TYPE_CHECKING:
    from data_tools.shard_writer import ShardInfo

MANIFEST_NAME = "manifest.json"
SPLITS = ("train", "valid", "test")  # the order of megatron.core.datasets.utils.Split


def _check_weights(weights: dict[str, float], shards: list["ShardInfo"]) -> None:
    sources = sorted({info.source for info in shards})
    missing = [source for source in sources if source not in weights]
    unknown = sorted(set(weights) - set(sources))
    if missing or unknown:
        raise DataError(
            f"--weights must name exactly the built sources {sources}; "
            f"missing {missing}, unknown {unknown}"
        )


def blend_weights(shards: list["ShardInfo"], weights: dict[str, float] | None) -> dict:
    """Per split: prefixes and weights (token share, or the given per-source weights, which
    must name exactly the built sources, shared among a source's shards by tokens), summing
    to 1."""
    if weights is not None:
        _check_weights(weights, shards)
    blend = {}
    for split in SPLITS:
        in_split = [info for info in shards if info.split == split and info.tokens > 0]
        if not in_split:
            continue
        source_tokens = Counter()
        for info in in_split:
            source_tokens[info.source] += info.tokens
        if weights is None:
            source_weight = dict(source_tokens)
        else:
            source_weight = {source: weights[source] for source in source_tokens}
        total_weight = sum(source_weight.values())
        if total_weight <= 0:
            raise DataError(f"--weights gives the {split} split a total weight of 0")
        blend[split] = {
            "prefixes": [info.prefix for info in in_split],
            "weights": [
                source_weight[info.source] / total_weight * info.tokens / source_tokens[info.source]
                for info in in_split
            ],
        }
    return blend


def assemble_manifest(
    options: dict,
    tokenizer: dict,
    files: list[InputFile],
    shards: list["ShardInfo"],
    skipped: dict,
    blend: dict,
) -> dict:
    """The manifest of a finished build. options: the build options by name; tokenizer: its
    path, sha256, vocabulary size, eod id and token dtype; skipped: the SkipLog summary."""
    documents = sum(info.documents for info in shards)
    return {
        "format": "ora-data-manifest/1",
        "options": options,
        "tokenizer": tokenizer,
        "inputs": [input_summary(file) for file in files],
        "datasets": [
            {
                key: value
                for key, value in dataclasses.asdict(info).items()
                if key not in ("build_key", "first_ordinal", "last_ordinal")
            }
            for info in shards
        ],
        "blend": blend,
        "totals": {
            "records": documents + skipped["total"],
            "documents": documents,
            "tokens": sum(info.tokens for info in shards),
            "text_bytes": sum(info.text_bytes for info in shards),
            "shards": len(shards),
        },
        "skipped": skipped,
    }


def manifest_path(path: str) -> str:
    """Accept the build output directory or the manifest file itself."""
    return os.path.join(path, MANIFEST_NAME) if os.path.isdir(path) else path


def load_manifest(path: str) -> dict:
    with open(manifest_path(path), encoding="utf-8") as handle:
        return json.load(handle)


def blend_from_manifest(path: str) -> dict[str, tuple[list[str], list[float]]]:
    """Per split present in the build ("train", "valid", "test"): (absolute dataset prefixes,
    weights), the weights summing to 1 within the split. Each pair is one entry of megatron-core's
    `blend_per_split`; prefixes carry no .bin/.idx suffix.

    path: the build output directory or its manifest.json.
    """
    manifest_file = manifest_path(path)
    root = os.path.dirname(os.path.abspath(manifest_file))
    manifest = load_manifest(manifest_file)
    return {
        split: (
            [os.path.join(root, prefix) for prefix in blend["prefixes"]],
            list(blend["weights"]),
        )
        for split, blend in manifest["blend"].items()
    }


def blend_per_split_from_manifest(path: str) -> list[tuple[list[str], list[float]] | None]:
    """`BlendedMegatronDatasetConfig(blend_per_split=...)` for the build: [train, valid, test],
    None for a split the build does not have."""
    blends = blend_from_manifest(path)
    return [blends.get(split) for split in SPLITS]
