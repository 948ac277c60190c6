"""Wheels of the GPU set, for a machine without network access that has its own CUDA torch (a GPU machine cut
off from the package index), fetched on a machine that has the index.

    python docker/gpu_wheels.py --out WHEELS [--python-version 3.12] [--machine x86_64] [--glibc 2.28]
        [--have HAVE.txt] [--limit-mib 64]

then, on the GPU machine, from the repository root (its torch stays; the virtualenv sees it):
    docker/gpu_bringup.sh WHEELS OUT

1. The requirements: the GPU set, pyproject.toml's [tool.ora.gpu]: the core dependencies but torch and its
   `left-out`, plus its `from-extras`, each at its pin in the dependencies or an optional-dependencies group,
   markers evaluated for the target's Python, not this one (pip would evaluate them for the Python running
   it). Not the whole project: the GPU report and the gpu-marked tests need far less, and the rest would not
   travel.
2. What the index has no wheel of (DeepSpeed, whose ops compile on first use) is built here with
   `pip wheel --no-deps`.
3. pip resolves the set for the target (`pip install --dry-run --report`, binary wheels only). From its
   report the packages needed are walked from the requirements, markers evaluated for the target, never
   through torch: torch's own dependencies (the CUDA libraries, triton) come with the target's torch.
   --have takes `python3 -m pip list --format=freeze` of the target (docker/gpu_machine.txt: the GPU
   machine's): what it has already is left out, with what only that needs (the target's version is used
   then, whatever pyproject.toml pins). A package the index has only as source stops it, by name: build it
   here as DeepSpeed is (BUILT_HERE), or leave what needs it out of the GPU set. pip resolves for another
   platform (--platform, --python-version) with --dry-run from 23.3 on (an older one asks for --target):
   the script checks the pip it runs first (PIP_NEEDED), and an older one stops it, saying how to upgrade.
4. `pip download --no-deps --only-binary=:all:` fetches the wheels into WHEELS (its earlier wheels are
   removed first); WHEELS/requirements.txt pins them all (name==version).
5. The wheels and the repository's files (git ls-files: tracked, and untracked but not ignored) are what
   goes to the GPU machine: their total is printed, and over --limit-mib (64 MiB) it fails.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import NamedTuple

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
KEPT_BY_TARGET = "torch"
BUILT_HERE = ("deepspeed",)  # published as a source distribution only
RESOLVE_ROUNDS = 3
MIB = 2**20
NO_WHEEL = re.compile(r"No matching distribution found for (\S+)")
PIP_NEEDED = Version("23.3")  # the first pip whose `install --dry-run` takes --platform and --python-version


class Package(NamedTuple):
    name: str
    version: str
    requires: tuple[str, ...]


def target_environment(python_version: str, machine: str) -> dict[str, str]:
    """PEP 508 marker variables of CPython `python_version` (3.12 or 3.12.3) on Linux on `machine`."""
    parts = python_version.split(".")
    full = ".".join((parts + ["0"])[:3])
    return {"python_version": ".".join(parts[:2]), "python_full_version": full, "implementation_version": full,
            "implementation_name": "cpython", "platform_python_implementation": "CPython", "os_name": "posix",
            "sys_platform": "linux", "platform_system": "Linux", "platform_machine": machine}


def applies(marker: Marker | None, environment: dict[str, str], extras: frozenset[str] = frozenset()) -> bool:
    """Whether a requirement with this marker holds on the target, with these extras of its requirer asked for."""
    return marker is None or any(marker.evaluate({**environment, "extra": extra}) for extra in {"", *extras})


def pins_of(pyproject: dict, environment: dict[str, str]) -> dict[str, list[Requirement]]:
    """pyproject.toml's requirements (dependencies and every optional-dependencies group) whose marker holds on
    the target, by canonical name."""
    project = pyproject["project"]
    texts = list(project["dependencies"])
    for group in project.get("optional-dependencies", {}).values():
        texts += group
    pins: dict[str, list[Requirement]] = {}
    for requirement in map(Requirement, texts):
        if applies(requirement.marker, environment):
            pins.setdefault(canonicalize_name(requirement.name), []).append(requirement)
    return pins


def gpu_names(pyproject: dict) -> list[str]:
    """The GPU set's names: the core dependencies (pyproject.toml's dependencies, once each) but torch and
    [tool.ora.gpu] left-out, then its from-extras. ValueError names what is amiss."""
    gpu = pyproject["tool"]["ora"]["gpu"]
    core = {canonicalize_name(r.name): r.name for r in map(Requirement, pyproject["project"]["dependencies"])}
    for name in gpu["left-out"]:
        if canonicalize_name(name) not in core:
            raise ValueError(f"[tool.ora.gpu] left-out names {name}, which is not a core dependency")
    left_out = {KEPT_BY_TARGET, *map(canonicalize_name, gpu["left-out"])}
    return [name for key, name in core.items() if key not in left_out] + list(gpu["from-extras"])


def gpu_requirements(pyproject: dict, environment: dict[str, str]) -> list[Requirement]:
    """The GPU set on the target: each of gpu_names at its one exact pin (==) in pyproject.toml (pins_of).
    ValueError names what is amiss."""
    pins = pins_of(pyproject, environment)
    chosen = []
    for name in gpu_names(pyproject):
        found = pins.get(canonicalize_name(name), [])
        if canonicalize_name(name) == KEPT_BY_TARGET:
            raise ValueError(f"[tool.ora.gpu] from-extras names {name}: the target keeps its own")
        python = environment["python_version"]
        if not found:
            raise ValueError(f"the GPU set has {name}, which pyproject.toml does not pin for Python {python}")
        if len(found) != 1 or [spec.operator for spec in found[0].specifier] != ["=="]:
            raise ValueError(f"the GPU set has {name}, which pyproject.toml requires as "
                             f"{', '.join(map(str, found))} for Python {python}: the set takes one exact pin (==)")
        chosen.append(found[0])
    return chosen


def constraints(pyproject: dict, environment: dict[str, str]) -> list[str]:
    """pyproject.toml's pins on the target as pip constraints (no extras, no markers, torch left out): a
    dependency of the GPU set that the project pins (tqdm, say) gets the version the project is tested with."""
    pins = pins_of(pyproject, environment)
    return [f"{name}{found[0].specifier}" for name, found in sorted(pins.items()) if name != KEPT_BY_TARGET]


def without_marker(requirement: Requirement) -> str:
    """The requirement for pip to resolve: its marker already evaluated for the target."""
    plain = Requirement(str(requirement))
    plain.marker = None
    return str(plain)


def packages_of_report(report: dict) -> dict[str, Package]:
    """What `pip install --dry-run --report` would install, by canonical name."""
    found = {}
    for item in report["install"]:
        meta = item["metadata"]
        found[canonicalize_name(meta["name"])] = Package(meta["name"], meta["version"],
                                                         tuple(meta.get("requires_dist", ())))
    return found


def needed(requirements: list[Requirement], packages: dict[str, Package], environment: dict[str, str],
           have: set[str]) -> tuple[dict[str, Package], list[Requirement]]:
    """(packages needed, requirements pip did not resolve) walking from `requirements` through the packages'
    own requirements that hold on the target; never into torch or what the target has (`have`)."""
    found: dict[str, Package] = {}
    unresolved: list[Requirement] = []
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = list(requirements)
    while todo:
        requirement = todo.pop()
        name = canonicalize_name(requirement.name)
        key = (name, frozenset(requirement.extras))
        if name == KEPT_BY_TARGET or name in have or key in seen:
            continue
        seen.add(key)
        package = packages.get(name)
        if package is None:
            unresolved.append(requirement)
            continue
        found[name] = package
        for text in package.requires:
            dependency = Requirement(text)
            if applies(dependency.marker, environment, frozenset(requirement.extras)):
                todo.append(dependency)
    return found, unresolved


def have_names(freeze: str) -> set[str]:
    """Canonical names of `pip list --format=freeze` (or `pip freeze`) lines."""
    names = set()
    for line in freeze.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            names.add(canonicalize_name(Requirement(line.split(" @ ")[0]).name))
    return names


def platforms(machine: str, glibc: str) -> list[str]:
    """pip's --platform values of a Linux target with this glibc, newest first (pip matches each exactly)."""
    major, minor = (int(part) for part in glibc.split("."))
    tags = [f"manylinux_{major}_{m}_{machine}" for m in range(minor, 16, -1)]
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    return tags + [f"{name}_{machine}" for m, name in legacy.items() if minor >= m]


def old_pip(version: str) -> str | None:
    """What to say when the pip of this version cannot run the commands below, else None."""
    if Version(version) >= PIP_NEEDED:
        return None
    return (f"error: pip {version} cannot resolve for another platform (`pip install --dry-run` with --platform "
            f"and --python-version, from pip {PIP_NEEDED} on): upgrade it with\n"
            f"  {sys.executable} -m pip install --upgrade 'pip>={PIP_NEEDED}'")


class PipFailed(Exception):
    """pip exited with an error; the exception holds its output."""


def pip(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)
    if done.returncode:
        raise PipFailed(f"pip {args[0]}", done.stdout + done.stderr)


def pip_error(failure: PipFailed, python_version: str, machine: str) -> str:
    """What to tell of a pip failure: the packages the index has no wheel of for the target, if that is
    it, and what to do about them; else pip's last lines."""
    command, output = failure.args
    missing = sorted(set(NO_WHEEL.findall(output)))
    if missing:
        return (f"error: the index has no wheel of {', '.join(missing)} for CPython {python_version} on {machine} "
                "(a source distribution only, or none for that Python). Build it here as DeepSpeed is (BUILT_HERE "
                "in docker/gpu_wheels.py), or leave what needs it out of the GPU set ([tool.ora.gpu] in "
                "pyproject.toml).")
    tail = "\n".join(output.strip().splitlines()[-15:])
    return f"error: {command} failed:\n{tail}"


def resolve(requirements: list[str], pinned: list[str], target: list[str], find_links: Path) -> dict[str, Package]:
    with tempfile.TemporaryDirectory() as scratch:
        report, constraint = Path(scratch) / "report.json", Path(scratch) / "constraints.txt"
        constraint.write_text("".join(f"{pin}\n" for pin in pinned))
        pip("install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report), "--only-binary=:all:",
            "--constraint", str(constraint), "--find-links", str(find_links), *target, *requirements)
        return packages_of_report(json.loads(report.read_text()))


def shipped_bytes(repo: Path) -> int:
    """The size of the repository's files that travel: tracked, and untracked but not ignored."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                            capture_output=True, check=True).stdout.decode()
    return sum((repo / name).stat().st_size for name in set(listed.split("\0")) if name and (repo / name).is_file())


def wheels(args: argparse.Namespace) -> str:
    """Fill args.out with the GPU set's wheels and requirements.txt; what was made, in a line."""
    environment = target_environment(args.python_version, args.machine)
    pyproject = tomllib.loads(args.pyproject.read_text())
    run = gpu_requirements(pyproject, environment)
    have = have_names(args.have.read_text()) if args.have else set()
    target = ["--python-version", args.python_version, "--implementation", "cp",
              *(f"--platform={tag}" for tag in platforms(args.machine, args.glibc))]
    args.out.mkdir(parents=True, exist_ok=True)
    for stale in [*args.out.glob("*.whl"), args.out / "requirements.txt"]:
        stale.unlink(missing_ok=True)
    for requirement in run:
        if canonicalize_name(requirement.name) in BUILT_HERE and canonicalize_name(requirement.name) not in have:
            print(f"building {without_marker(requirement)} (the index has no wheel of it)", flush=True)
            pip("wheel", "--no-deps", "--quiet", "--wheel-dir", str(args.out), without_marker(requirement))

    asked = [without_marker(r) for r in run if canonicalize_name(r.name) not in have]
    for _ in range(RESOLVE_ROUNDS):  # pip evaluates its dependencies' markers for this Python: add what it left out
        packages = resolve(asked, constraints(pyproject, environment), target, args.out)
        run_packages, unresolved = needed(run, packages, environment, have)
        missing = [without_marker(r) for r in unresolved]
        if not missing:
            break
        asked += missing
    else:
        raise ValueError(f"pip did not resolve {', '.join(missing)} for Python {args.python_version}")

    fetched = [f"{p.name}=={p.version}" for name, p in sorted(run_packages.items()) if name not in BUILT_HERE]
    pip("download", "--no-deps", "--quiet", "--only-binary=:all:", "--dest", str(args.out), *target, *fetched)
    pins = [f"{p.name}=={p.version}" for _, p in sorted(run_packages.items())]
    (args.out / "requirements.txt").write_text("".join(f"{pin}\n" for pin in pins))
    return (f"{len(pins)} wheels for Python {args.python_version} on {args.machine} in {args.out}, "
            f"pinned in {args.out / 'requirements.txt'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for the wheels and requirements.txt")
    parser.add_argument("--python-version", default="3.12", help="the target's Python (default 3.12)")
    parser.add_argument("--machine", default="x86_64", help="the target's CPU architecture (default x86_64)")
    parser.add_argument("--glibc", default="2.28", help="the target's glibc, `ldd --version` (default 2.28)")
    parser.add_argument("--have", type=Path, help="the target's `python3 -m pip list --format=freeze`")
    parser.add_argument("--limit-mib", type=float, default=64.0,
                        help="the most the wheels and the repository may weigh together (default 64 MiB)")
    parser.add_argument("--pyproject", type=Path, default=REPO / "pyproject.toml", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    too_old = old_pip(importlib.metadata.version("pip"))
    if too_old:
        sys.exit(too_old)
    try:
        made = wheels(args)
    except PipFailed as failure:
        sys.exit(pip_error(failure, args.python_version, args.machine))
    except ValueError as error:
        sys.exit(f"error: {error}")
    wheel_bytes = sum(f.stat().st_size for f in args.out.glob("*.whl"))
    repo_bytes = shipped_bytes(REPO)
    total = (wheel_bytes + repo_bytes) / MIB
    print(f"{made}\nwheels {wheel_bytes / MIB:.1f} MiB + repository {repo_bytes / MIB:.1f} MiB (git ls-files) = "
          f"{total:.1f} MiB of {args.limit_mib:g} MiB")
    if total > args.limit_mib:
        sys.exit(f"error: {total:.1f} MiB is over the {args.limit_mib:g} MiB that may go to the GPU machine: "
                 "leave packages it has out (--have) or packages it does not need out of the GPU set ([tool.ora.gpu])")
    return 0


if __name__ == "__main__":
    sys.exit(main())
