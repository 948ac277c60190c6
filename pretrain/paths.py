"""Where the repository's own files are: its root, the training entry, DeepSpeed's JSON pieces and the
run-config presets."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
ENTRY_MODULE = "pretrain.pretrain_ora"  # the training entry, for `python -m` (run from REPO)
DS_CONFIG_DIR = REPO / "ds_configs"
# Run configs by name (tiny, small, base, large); configs/shared/ holds what presets inherit.
PRESETS = REPO / "pretrain" / "configs"


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS.glob("*.yaml"))


def preset_path(name: str) -> Optional[Path]:
    """pretrain/configs/NAME.yaml when `name` is a preset's name (not a path), else None."""
    if "/" in name or name.endswith((".yaml", ".yml")):
        return None
    path = PRESETS / f"{name}.yaml"
    return path if path.is_file() else None
