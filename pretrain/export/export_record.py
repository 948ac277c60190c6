"""The record every Hugging Face export holds (`ora_export.json`): the run and checkpoint it was made
from, its verification figures and the files it wrote. pretrain.export.convert_to_hf writes it and reads it
to tell an earlier export of its own (safe to replace) from a directory of someone else's; the
quickstart reads it to know the export is all there. Standard library only, so reading it is cheap.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

EXPORT_RECORD = "ora_export.json"


def write_export_record(directory: Path, record: dict) -> None:
    (directory / EXPORT_RECORD).write_text(json.dumps(record, indent=1) + "\n")


def read_export_record(directory: Path) -> Optional[dict]:
    """The export record in `directory`, or None where there is none (not an export of ours)."""
    try:
        record = json.loads((directory / EXPORT_RECORD).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def files_under(directory: Path) -> set[str]:
    """Every file below `directory`, as paths relative to it."""
    return {str(p.relative_to(directory)) for p in directory.rglob("*") if not p.is_dir()}


def recorded_files(directory: Path) -> list[Path]:
    """The record and every file it lists: what a complete export in `directory` consists of."""
    record = read_export_record(directory) or {}
    return [directory / EXPORT_RECORD, *(directory / name for name in record.get("files", []))]


def holds_only_an_export(directory: Path) -> bool:
    """An earlier export nobody added to: every file in it is one its record lists."""
    record = read_export_record(directory)
    return record is not None and files_under(directory) <= {EXPORT_RECORD, *record.get("files", [])}
