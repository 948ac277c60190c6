"""`pip install .` without extras trains, converts, exports and builds data: none of those commands imports
what only the extras research and eval install, and a command that needs one of them says which. Each in a
fresh interpreter in which the extras' modules are made unimportable, as if not installed."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from pretrain_runs import REPO

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
TOOL_EXTRAS = ("research", "eval")  # the test extra is the suite's own
CORE_COMMANDS = ("pretrain.pretrain_ora", "pretrain.export.convert_to_hf", "pretrain.export.generate",
                 "pretrain.checkpoint.consolidate", "data_tools.build_shards", "data_tools.train_tokenizer")
EXTRA_COMMANDS = {"pretrain.research.report": "research", "pretrain.research.analyze": "research",
                  "pretrain.research.lr_schedule_plot": "research"}


def extras_only_imports() -> list[str]:
    """Top-level import names that only the extras' own packages provide (not their dependencies)."""
    core = {canonicalize_name(Requirement(text).name) for text in PYPROJECT["dependencies"]}
    extra = {canonicalize_name(Requirement(text).name) for name in TOOL_EXTRAS
             for text in PYPROJECT["optional-dependencies"][name]} - core
    return sorted(name for name, dists in importlib.metadata.packages_distributions().items()
                  if {canonicalize_name(d) for d in dists} <= extra)


def without_extras(code: str) -> subprocess.CompletedProcess:
    blocked = f"import sys\nfor name in {extras_only_imports()!r}:\n    sys.modules[name] = None\n"
    return subprocess.run([sys.executable, "-c", blocked + code], cwd=REPO, capture_output=True, text=True,
                          timeout=300)


def test_the_extras_hold_scipy_matplotlib_and_lm_eval():
    assert {"scipy", "matplotlib", "lm_eval"} <= set(extras_only_imports())


@pytest.mark.slow  # a fresh interpreter that imports torch, DeepSpeed and megatron-core: seconds
def test_the_core_commands_import_without_the_extras():
    out = without_extras("import importlib\n" + "".join(f"importlib.import_module({name!r})\n"
                                                         for name in CORE_COMMANDS))
    assert out.returncode == 0, out.stderr[-3000:]


def names_its_extra(out: subprocess.CompletedProcess, extra: str) -> bool:
    last = out.stderr.splitlines()[-1] if out.stderr else ""
    return out.returncode == 1 and last.endswith(f"pip install 'ora[{extra}]' (from a checkout: "
                                                 f"pip install -e '.[{extra}]')")


@pytest.mark.slow
@pytest.mark.parametrize("module, extra", sorted(EXTRA_COMMANDS.items()))
def test_a_command_that_needs_an_extra_names_it(module, extra):
    out = without_extras(f"import runpy\nsys.argv = [{module!r}, '--help']\n"
                         f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")
    assert names_its_extra(out, extra), out.stderr[-3000:]


@pytest.mark.slow
def test_downstream_evaluation_names_its_extra(tmp_path):
    """lm-eval loads only once the export is found (its --help needs none)."""
    (tmp_path / "config.json").write_text("{}")
    out = without_extras("from pretrain.export import evaluate\n"
                         f"evaluate.main(['--hf', {str(tmp_path)!r}, '--out', {str(tmp_path / 'r.json')!r}])")
    assert names_its_extra(out, "eval"), out.stderr[-3000:]
