"""docker/gpu_wheels.py, offline: the GPU set it derives from pyproject.toml's core dependencies, its pins for
the target's Python, the pip it needs, the walk from them through a resolved set (markers for the target, never
into torch, without what the target has), the platform tags it asks pip for, what it says when the index has no
wheel of a package. Fetching from the index is not tested here."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement
from pretrain_runs import REPO

SCRIPT = REPO / "docker" / "gpu_wheels.py"
spec = importlib.util.spec_from_file_location("gpu_wheels", SCRIPT)
gpu_wheels = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_wheels)
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def pins(requirements) -> dict[str, str]:
    return {r.name: str(r.specifier) for r in requirements}


@pytest.mark.parametrize("python, megatron", [("3.12", "==0.19.2"), ("3.11", "==0.16.1")])
def test_gpu_set_at_the_pins_of_pyproject_for_the_target_python(python, megatron):
    """The GPU set's names at pyproject.toml's pins, markers evaluated for the target's Python, whatever
    runs the script."""
    run = gpu_wheels.gpu_requirements(PYPROJECT, gpu_wheels.target_environment(python, "x86_64"))
    assert [r.name for r in run] == gpu_wheels.gpu_names(PYPROJECT)
    assert pins(run)["megatron-core"] == megatron
    declared = [Requirement(text) for text in PYPROJECT["project"]["dependencies"]
                + PYPROJECT["project"]["optional-dependencies"]["test"]]
    for name in ("deepspeed", "pytest", "zstandard"):
        assert pins(run)[name] == next(str(r.specifier) for r in declared if r.name == name)
    assert all(r.marker is None for r in map(Requirement, map(gpu_wheels.without_marker, run)))


def test_gpu_set_leaves_the_heavy_packages_and_torch_behind():
    names = set(gpu_wheels.gpu_names(PYPROJECT))
    assert {"deepspeed", "megatron-core", "numpy", "pyyaml", "zstandard", "pytest"} <= names
    assert not names & {"torch", "datasets", "pyarrow", "scipy", "matplotlib", "wandb", "lm-eval"}


def small_pyproject(dependencies: list[str], left_out: list[str], from_extras: list[str]) -> dict:
    return {"project": {"dependencies": dependencies, "optional-dependencies": {"test": ["pytest==9.2.0"]}},
            "tool": {"ora": {"gpu": {"left-out": left_out, "from-extras": from_extras}}}}


def test_a_new_core_dependency_joins_the_gpu_set_unless_left_out():
    dependencies = ["torch==2.13.0", "small==1.0; python_version < '3.12'", "small==1.1; python_version >= '3.12'",
                    "Big_Package==2.0", "new==3.0"]
    pyproject = small_pyproject(dependencies, ["big-package"], ["pytest"])
    assert gpu_wheels.gpu_names(pyproject) == ["small", "new", "pytest"]
    run = gpu_wheels.gpu_requirements(pyproject, gpu_wheels.target_environment("3.12", "x86_64"))
    assert [str(r.specifier) for r in run] == ["==1.1", "==3.0", "==9.2.0"]
    with pytest.raises(ValueError, match="left-out names gone, which is not a core dependency"):
        gpu_wheels.gpu_names(small_pyproject(dependencies, ["gone"], []))


@pytest.mark.parametrize("dependencies, from_extras, message", [
    (["torch==2.13.0"], ["torch"], "from-extras names torch: the target keeps its own"),
    (["torch==2.13.0"], ["flash-attn"], "flash-attn, which pyproject.toml does not pin for Python 3.12"),
    (["torch==2.13.0", "loose>=1.0"], [], "loose>=1.0 for Python 3.12: the set takes one exact pin"),
])
def test_gpu_set_names_only_exactly_pinned_packages_but_torch(dependencies, from_extras, message):
    pyproject = small_pyproject(dependencies, [], from_extras)
    with pytest.raises(ValueError, match=message):
        gpu_wheels.gpu_requirements(pyproject, gpu_wheels.target_environment("3.12", "x86_64"))


@pytest.mark.parametrize("version", ["23.3", "24.0", "26.3"])
def test_a_pip_that_resolves_for_another_platform_passes(version):
    assert gpu_wheels.old_pip(version) is None


def test_an_older_pip_is_named_with_how_to_upgrade_it(monkeypatch, tmp_path, capsys):
    message = gpu_wheels.old_pip("23.2.1")
    assert message.startswith("error: pip 23.2.1 cannot resolve for another platform")
    assert message.endswith(f"{sys.executable} -m pip install --upgrade 'pip>=23.3'")
    monkeypatch.setattr(gpu_wheels.importlib.metadata, "version", lambda name: "23.2.1")
    with pytest.raises(SystemExit) as exit_:
        gpu_wheels.main(["--out", str(tmp_path / "wheels")])
    assert exit_.value.code == message and not (tmp_path / "wheels").exists()


def test_constraints_are_the_project_pins_without_extras_or_torch():
    pinned = gpu_wheels.constraints(PYPROJECT, gpu_wheels.target_environment("3.11", "x86_64"))
    assert "megatron-core==0.16.1" in pinned and "lm-eval==0.4.13" in pinned and "tqdm==4.70.1" in pinned
    assert not [pin for pin in pinned if pin.startswith("torch") or "[" in pin or ";" in pin]


def package(name: str, version: str, *requires: str):
    return gpu_wheels.Package(name, version, requires)


RESOLVED = {p.name.lower(): p for p in [
    package("app", "1.0", "torch>=2", "small==2.0", "old-backport; python_version < '3.12'",
            "fancy[speed]>=1", "windows-only; sys_platform == 'win32'"),
    package("small", "2.0"),
    package("fancy", "1.5", "core", "accelerator; extra == 'speed'", "docs-tool; extra == 'docs'"),
    package("core", "3.0"),
    package("accelerator", "0.9", "core>=2"),
    package("torch", "2.13.0", "nvidia-cublas", "triton"),
    package("nvidia-cublas", "13.0"),
    package("triton", "3.6"),
    package("old-backport", "1.0"),
]}


def test_walk_follows_target_markers_and_extras_but_not_torch():
    environment = gpu_wheels.target_environment("3.12.3", "x86_64")
    found, unresolved = gpu_wheels.needed([Requirement("app==1.0")], RESOLVED, environment, have=set())
    assert sorted(found) == ["accelerator", "app", "core", "fancy", "small"]  # no torch, CUDA libraries, triton
    assert unresolved == []
    older, _ = gpu_wheels.needed([Requirement("app==1.0")], RESOLVED, gpu_wheels.target_environment("3.11", "x86_64"),
                                 have=set())
    assert "old-backport" in older


def test_walk_leaves_out_what_the_target_has_and_names_what_pip_did_not_resolve():
    environment = gpu_wheels.target_environment("3.12", "x86_64")
    found, _ = gpu_wheels.needed([Requirement("app")], RESOLVED, environment, have={"fancy"})
    assert sorted(found) == ["app", "small"]  # fancy is there, and so what only it needs
    resolved = {name: p for name, p in RESOLVED.items() if name != "small"}
    _, unresolved = gpu_wheels.needed([Requirement("app")], resolved, environment, have=set())
    assert [str(r) for r in unresolved] == ["small==2.0"]


def test_report_and_have_files_are_read_by_canonical_name():
    report = {"install": [{"metadata": {"name": "PyYAML", "version": "6.0.3"}},
                          {"metadata": {"name": "Jinja2", "version": "3.1.6", "requires_dist": ["MarkupSafe>=2.0"]}}]}
    assert gpu_wheels.packages_of_report(report) == {"pyyaml": package("PyYAML", "6.0.3"),
                                                    "jinja2": package("Jinja2", "3.1.6", "MarkupSafe>=2.0")}
    freeze = "# the GPU machine\nPyYAML==6.0.2\ntyping_extensions==4.12.2\nmypkg @ file:///src/mypkg\n"
    assert gpu_wheels.have_names(freeze) == {"pyyaml", "typing-extensions", "mypkg"}
    machine = gpu_wheels.have_names((REPO / "docker" / "gpu_machine.txt").read_text())  # make wheels' --have
    assert {"torch", "transformers", "pytest", "numpy", "pyyaml"} <= machine


def test_platform_tags_newest_glibc_first():
    tags = gpu_wheels.platforms("x86_64", "2.28")
    assert tags[0] == "manylinux_2_28_x86_64" and tags[11] == "manylinux_2_17_x86_64"
    assert tags[12:] == ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
    assert gpu_wheels.platforms("aarch64", "2.17")[-1] == "manylinux1_aarch64"


def test_a_source_only_package_is_named_with_what_to_do():
    output = ("ERROR: Could not find a version that satisfies the requirement sqlitedict (from lm-eval) (from "
              "versions: none)\nERROR: No matching distribution found for sqlitedict\n")
    message = gpu_wheels.pip_error(gpu_wheels.PipFailed("pip install", output), "3.12", "x86_64")
    assert message.startswith("error: the index has no wheel of sqlitedict for CPython 3.12 on x86_64")
    assert "BUILT_HERE" in message and "[tool.ora.gpu]" in message
    other = gpu_wheels.pip_error(gpu_wheels.PipFailed("pip download", "a\nb\nERROR: disk full\n"), "3.12", "x86_64")
    assert other == "error: pip download failed:\na\nb\nERROR: disk full"


def test_script_answers_help():
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--have" in out.stdout and "--python-version" in out.stdout
    assert "--limit-mib" in out.stdout
