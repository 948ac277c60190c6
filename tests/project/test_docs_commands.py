"""The documentation's commands and links work as written: every `python -m MODULE` that README.md
or a page under docs/ (and the other READMEs) names answers `--help`, and every relative link points
to a file that exists."""

from __future__ import annotations

import importlib.util
import os
import re
import runpy
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest
from pretrain_runs import REPO

PROJECT_PACKAGES = ("pretrain", "data_tools", "ora_megatron")
# Folders that hold no documentation of ours (environments, run outputs, caches).
NOT_DOCS = {".git", ".venv", "runs", "__pycache__", ".pytest_cache", ".ruff_cache"}

MODULE_COMMAND = re.compile(r"\bpython3? -m ([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*$", re.MULTILINE)


def documents() -> list[Path]:
    """README.md and every other Markdown file of the repository (docs/ and its results included)."""
    found = []
    for folder, subfolders, files in os.walk(REPO):
        subfolders[:] = sorted(d for d in subfolders if d not in NOT_DOCS and not d.endswith(".egg-info"))
        found += [Path(folder) / name for name in sorted(files) if name.endswith(".md")]
    return found


def relative(path: Path) -> str:
    return str(path.relative_to(REPO))


def documented_modules() -> dict[str, list[str]]:
    """Module → the documents naming it in a `python -m` command (code blocks included)."""
    modules: dict[str, list[str]] = {}
    for doc in documents():
        for name in MODULE_COMMAND.findall(doc.read_text()):
            modules.setdefault(name, []).append(relative(doc))
    return modules


def exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package that does not exist
        return False


def anchors(doc: Path) -> set[str]:
    """GitHub's anchors for the headings of a Markdown file (code blocks left out)."""
    text = FENCE.sub("", doc.read_text())
    return {re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-") for title in HEADING.findall(text)}


def relative_links(doc: Path) -> list[str]:
    targets = LINK.findall(FENCE.sub("", doc.read_text()))
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t)]  # http:, https:, mailto: ...


DOCUMENTED = documented_modules()


def test_the_documents_name_commands():
    assert "README.md" in {relative(d) for d in documents()}
    for module in ("pretrain.pretrain_ora", "pretrain.export.convert_to_hf", "pretrain.research.sweep"):
        assert module in DOCUMENTED, f"no document shows `python -m {module}`"


@pytest.fixture
def keep_environment():
    """Entry points set variables of their own (offline modes); the test process keeps its own."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.parametrize("module", sorted(DOCUMENTED))
def test_documented_module_answers_help(module, monkeypatch, capsys, keep_environment):
    where = ", ".join(sorted(set(DOCUMENTED[module])))
    assert exists(module), f"{where}: `python -m {module}`: no such module"
    if module.split(".")[0] not in PROJECT_PACKAGES:
        return  # a tool's own command (pip, venv, ...): that it exists is all we check
    for name in (module, f"{module}.__main__"):  # as in a fresh `python -m`
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(sys, "argv", [module, "--help"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    out = capsys.readouterr().out
    assert exit_.value.code in (0, None), f"{where}: `python -m {module} --help` exited {exit_.value.code}"
    assert "usage:" in out, f"{where}: `python -m {module} --help` printed no usage"


@pytest.mark.parametrize("doc", documents(), ids=relative)
def test_relative_links_point_to_existing_files(doc):
    broken = []
    for target in relative_links(doc):
        path_part, _, anchor = unquote(target).partition("#")
        path = (doc.parent / path_part).resolve() if path_part else doc
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}: no heading #{anchor} in {relative(path)}")
    assert not broken, f"{relative(doc)}: " + "; ".join(broken)


def cells(row: str) -> int:
    """The cells of a Markdown table row: its `|` separators, not those escaped or inside `code`."""
    separators, in_code, escaped = 0, False, False
    for char in row.strip():
        if char == "`" and not escaped:
            in_code = not in_code
        elif char == "|" and not in_code and not escaped:
            separators += 1
        escaped = char == "\\" and not escaped
    return separators - 1


def ragged_rows(text: str) -> list[str]:
    """Rows of the text's Markdown tables (code blocks left out) whose cells differ from their header's."""
    ragged, header = [], None
    for number, line in enumerate(FENCE.sub("", text).splitlines(), 1):
        if not line.startswith("|"):
            header = None
        elif header is None:
            header = cells(line)
        elif cells(line) != header:
            ragged.append(f"line {number}: {cells(line)} cells, the header has {header}")
    return ragged


@pytest.mark.parametrize("doc", documents(), ids=relative)
def test_tables_rows_have_their_headers_cells(doc):
    """A row that lost or gained a cell (two rows merged by an edit) renders as a broken table."""
    ragged = ragged_rows(doc.read_text())
    assert not ragged, f"{relative(doc)}: " + "; ".join(ragged)


def test_a_ragged_table_is_caught():
    table = "| a | b |\n|---|---|\n| `x|y` | 2 |\n| 1 | 2 | 3 |\n\ntext\n| c |\n|---|\n"
    assert ragged_rows(table) == ["line 4: 3 cells, the header has 2"]


def test_a_module_that_does_not_exist_is_caught():
    """The check above fails for a misspelt or removed module."""
    assert not exists("pretrain.no_such_module") and not exists("no_such_package.module")
    assert not exists("pretrain.convert_to_hf")  # a module's place before the stages had folders
    assert MODULE_COMMAND.findall("run `python -m pretrain.research.report DIR…`.") == ["pretrain.research.report"]
