"""The GPU set (pyproject.toml's [tool.ora.gpu]) is enough for the GPU report: the report's module loads none
of the heavy packages the set leaves behind; with everything the set and the GPU machine do not provide made
unimportable, what the report runs imports (`gpu_report --check-imports`) and `pytest -m gpu` collects every
gpu-marked test of the suite. Each in a fresh interpreter, where nothing is imported yet."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import subprocess
import sys
import tomllib

import pytest
from packaging.utils import canonicalize_name
from pretrain_runs import REPO

spec = importlib.util.spec_from_file_location("gpu_wheels", REPO / "docker" / "gpu_wheels.py")
gpu_wheels = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_wheels)
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
HEAVY = ("datasets", "pyarrow", "scipy", "matplotlib", "wandb", "lm_eval")  # import names
GPU_MACHINE = gpu_wheels.have_names((REPO / "docker" / "gpu_machine.txt").read_text())


def python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)


def left_behind() -> set[str]:
    """What pyproject.toml pins for this Python that neither the GPU set (with what it needs, walked through
    the installed packages' requirements) nor the GPU machine provides, by canonical name."""
    environment = gpu_wheels.target_environment(f"{sys.version_info.major}.{sys.version_info.minor}", "x86_64")
    installed = {canonicalize_name(d.metadata["Name"]): gpu_wheels.Package(d.metadata["Name"], d.version,
                                                                         tuple(d.requires or ()))
                 for d in importlib.metadata.distributions()}
    found, unresolved = gpu_wheels.needed(gpu_wheels.gpu_requirements(PYPROJECT, environment), installed,
                                          environment, GPU_MACHINE)
    assert unresolved == []
    return set(gpu_wheels.pins_of(PYPROJECT, environment)) - set(found) - GPU_MACHINE - {"torch"}


def blocked_imports() -> list[str]:
    """Top-level import names that only packages left behind provide."""
    left = left_behind()
    return sorted(name for name, dists in importlib.metadata.packages_distributions().items()
                  if {canonicalize_name(d) for d in dists} <= left)


def blocking(names: list[str]) -> str:
    """Python code that makes these modules unimportable, as if they were not installed."""
    return f"import sys\nfor name in {names!r}:\n    sys.modules[name] = None\n"


def test_the_heavy_packages_are_left_behind():
    assert {"datasets", "pyarrow", "scipy", "matplotlib", "wandb", "lm-eval"} <= left_behind()
    assert set(HEAVY) <= set(blocked_imports())


@pytest.mark.slow  # a fresh interpreter that imports torch: seconds
def test_the_report_module_loads_no_heavy_package():
    out = python("import sys\nimport pretrain.research.gpu_report\n"
                 f"print(sorted(name for name in sys.modules if name.split('.')[0] in {HEAVY!r}))")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.slow
def test_what_the_report_runs_imports_without_what_the_set_leaves_behind():
    out = python(blocking(blocked_imports()) + "from pretrain.research import gpu_report\n"
                 "sys.exit(gpu_report.main(['--check-imports']))")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("the GPU report's imports: ok (torch ")


COLLECT = """
import json, pytest
class Collected:
    def pytest_collection_finish(self, session):
        self.gpu = [item.nodeid for item in session.items if item.get_closest_marker("gpu")]
collected = Collected()
code = pytest.main([*{args!r}, "--collect-only", "-q", "-p", "no:cacheprovider"], plugins=[collected])
print(json.dumps({{"code": int(code), "gpu": collected.gpu}}))
"""


def collect(args: list[str], prefix: str = "") -> list[str]:
    out = python(prefix + COLLECT.format(args=args))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["code"] == 0, out.stdout[-3000:]
    return result["gpu"]


@pytest.mark.slow
def test_pytest_m_gpu_collects_every_gpu_test_without_what_the_set_leaves_behind():
    """tests/conftest.py lets `-m gpu` skip the files that mark no test gpu: those collected whole, with every
    package installed, hold the same gpu tests as `-m gpu` over the whole suite with the set alone."""
    marking = sorted(str(path.relative_to(REPO)) for path in (REPO / "tests").rglob("test_*.py")
                     if "mark.gpu" in path.read_text())
    everything = collect(marking)
    assert len(everything) >= 4
    # pytest marks every installed plugin's modules for rewriting, and fails on one made unimportable
    # (pytest-xdist, left behind), so this collection autoloads none: the gpu tests need no plugin.
    no_plugins = "import os\nos.environ['PYTEST_DISABLE_PLUGIN_AUTOLOAD'] = '1'\n"
    assert collect(["-m", "gpu", "tests"], prefix=blocking(blocked_imports()) + no_plugins) == everything
