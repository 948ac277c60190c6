"""The build manifest: what build_shards wrote, and the blends the training side reads from it.

Training-side API (the only data_tools functions `pretrain` needs):

    blend_from_manifest(path) -> dict[str, tuple[list[str], list[float]]]
    blend_per_split_from_manifest(path) -> list[tuple[list[str], list[float]] | None]

The second is exactly megatron-core's `BlendedMegatronDatasetConfig.blend_per_split`
(`List[Optional[Tuple[List[str], Optional[List[float]]]]]`, ordered like
`megatron.core.datasets.utils.Split`: train, valid, test).
"""

import json
import os

MANIFEST_NAME = "manifest.json"
SPLITS = ("train", "valid", "test")  # the order of megatron.core.datasets.utils.Split


def write_json_atomic(path: str, data) -> None:
    """Write JSON through a temporary file and a rename, so readers never see half a file."""
    temporary = path + ".tmp"
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2, sort_keys=True)
        handle.write("\n")
    os.replace(temporary, path)


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
