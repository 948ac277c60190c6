"""JSON files a build writes (shard .done.json markers, stats, the manifest, the tokenizer summary),
written so that a reader never sees half a file."""

import json
import os


def write_json_atomic(path: str, data) -> None:
    """Write JSON through a temporary file and a rename, so readers never see half a file."""
    temporary = path + ".tmp"
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2, sort_keys=True)
        handle.write("\n")
    os.replace(temporary, path)
