"""Imports flow one way, stage by stage: the training runtime (and the checkpointing it uses) never
imports export or research code; ora_megatron never imports pretrain or data_tools; data_tools
never imports pretrain. Every import counts, module-level or inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from pretrain_runs import REPO

FORBIDDEN = {  # folder: the packages nothing under it may import
    "pretrain/runtime": ("pretrain.export", "pretrain.research"),
    "pretrain/checkpoint": ("pretrain.export", "pretrain.research"),
    "ora_megatron": ("pretrain", "data_tools"),
    "data_tools": ("pretrain",),
}


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)  # from pkg import module
    return names


def violations(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    found = []
    for path in sorted((REPO / folder).rglob("*.py")):
        for name in sorted(imported_modules(path)):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                found.append(f"{path.relative_to(REPO)} imports {name}")
    return found


@pytest.mark.parametrize("folder", FORBIDDEN)
def test_imports_flow_one_way(folder):
    assert violations(folder, FORBIDDEN[folder]) == []


def test_the_check_sees_imports_inside_functions(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from pretrain.export import convert_to_hf\n")
    assert "pretrain.export.convert_to_hf" in imported_modules(module)
