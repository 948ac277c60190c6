"""Old module names keep working after the modules moved: `python -m OLD` runs the new module
(with a note naming it) and `import OLD` is the new module itself."""

from __future__ import annotations

import importlib
import runpy
import subprocess
import sys

import pytest
from pretrain_runs import REPO

import data_tools
import pretrain
from ora_megatron.module_aliases import MovedModules


def moved() -> dict[str, str]:
    tables = [f.moved for f in sys.meta_path if isinstance(f, MovedModules)]
    return {old: new for table in tables for old, new in table.items()}


def test_both_packages_install_their_tables():
    assert pretrain and data_tools  # imported: their tables are installed
    names = moved()
    assert names["pretrain.convert_to_hf"] == "pretrain.export.convert_to_hf"
    assert names["data_tools.inspect"] == "data_tools.inspect_shards"


@pytest.mark.parametrize("old", sorted(moved()))
def test_old_name_runs_the_new_module(old, monkeypatch, capsys):
    new = moved()[old]
    assert importlib.import_module(old) is importlib.import_module(new)
    assert importlib.import_module(new).__spec__.name == new  # its own spec, not the alias's
    monkeypatch.delitem(sys.modules, old)  # as in a fresh `python -m OLD`
    monkeypatch.setattr(sys, "argv", [old, "--help"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module(old, run_name="__main__", alter_sys=True)
    assert exit_.value.code == 0
    out = capsys.readouterr()
    assert f"note: {old} is now {new}" in out.err and "usage:" in out.out


@pytest.mark.slow
def test_a_moved_package_runs_its_main_as_a_command():
    out = subprocess.run([sys.executable, "-m", "pretrain.report", "--help"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "usage: python -m pretrain.research.report" in out.stdout
    assert "note: pretrain.report is now pretrain.research.report" in out.stderr
