"""Imports flow one way, floor by floor, and no modules import each other in a loop.

Each stage of the flow is a floor; a module may import modules of its own unit (a package, or one
top-level module) and of lower floors, never of a higher floor, nor a sibling on its own floor.
Every import counts, module-level or inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from pretrain_runs import REPO

# Lowest first. Units on one floor are siblings: neither imports the other.
FLOORS = [
    ("ora_megatron", "data_tools"),  # the model; corpus tooling (the training side reads its manifest)
    ("pretrain.paths", "pretrain.run_files"),  # the repository's files; a run's files and records
    ("pretrain.job",),  # what a rank knows of its job: attempt, stop signals, exit statuses, layout, faults
    ("pretrain.config",),  # the typed run config, assembled from its sections
    ("pretrain.runtime",),  # engine, data, loss, optimizer, metrics, freeze schedules
    ("pretrain.checkpoint",),  # save, resume, reshard, consolidate, weights in
    ("pretrain.training", "pretrain.export"),  # the worker, the loop and evaluation; checkpoints out
    ("pretrain.launch",),  # a job's start, its supervisor and launchers (the entry's spawn, DeepSpeed's)
    ("pretrain.pretrain_ora",),  # the entry point
    ("pretrain.research", "pretrain.quickstart"),
]
PACKAGES = ("ora_megatron", "data_tools", "pretrain")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted((REPO / package).rglob("*.py"))}


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)  # from pkg import module
    return names


def imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module → the project modules it imports (a name imported from a module counts as that module)."""
    graph = {}
    for name, path in modules.items():
        targets = set()
        for imported in imported_modules(path):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def unit_of(module: str) -> tuple[int, str]:
    """(floor, unit) of a module: the longest unit name it falls under."""
    found = [(floor, unit) for floor, units in enumerate(FLOORS) for unit in units
             if module == unit or module.startswith(unit + ".")]
    return max(found, key=lambda fu: len(fu[1])) if found else (-1, module)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module, targets in graph.items():
        floor, unit = unit_of(module)
        for target in sorted(targets):
            target_floor, target_unit = unit_of(target)
            if target_unit != unit and target_floor >= floor:
                found.append(f"{module} (floor {floor}) imports {target} (floor {target_floor})")
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


GRAPH = imports(project_modules())


def test_every_module_has_a_floor():
    assert [m for m in GRAPH if m != "pretrain" and unit_of(m)[0] < 0] == []


def test_no_import_runs_up_or_sideways():
    assert upward_imports(GRAPH) == []


def test_no_modules_import_each_other_in_a_loop():
    assert cycles(GRAPH) == []


@pytest.mark.parametrize("source, expected", [
    ("def f():\n    from pretrain.export import convert_to_hf\n", "pretrain.export.convert_to_hf"),
    ("import ora_megatron.attention as attention\n", "ora_megatron.attention"),
])
def test_the_check_sees_every_import(tmp_path, source, expected):
    module = tmp_path / "m.py"
    module.write_text(source)
    assert expected in imported_modules(module)


def test_the_checks_catch_an_upward_import_and_a_loop():
    graph = {"pretrain.runtime.engine": {"pretrain.training.trainer"}, "pretrain.training.trainer": set(),
             "data_tools.readers": {"ora_megatron.attention"}, "ora_megatron.attention": set()}
    assert len(upward_imports(graph)) == 2  # up a floor; sideways to a sibling
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
