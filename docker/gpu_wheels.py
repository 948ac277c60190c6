"""Wheels of everything this project needs but torch, for a machine without network access that has its own
CUDA torch (a GPU machine cut off from the package index), fetched on a machine that has the index.

    python docker/gpu_wheels.py --out WHEELS [--python-version 3.12] [--machine x86_64] [--glibc 2.28]
        [--have HAVE.txt] [--extra test]

then, on the GPU machine, from the repository root (its torch stays; .venv sees it):
    python3 -m venv --system-site-packages .venv
    .venv/bin/python -m pip install --no-index --find-links WHEELS -r WHEELS/requirements.txt
    .venv/bin/python -m pip install --no-index --find-links WHEELS --no-deps -e .

1. The requirements: pyproject.toml's dependencies (and the extras asked for) with their markers evaluated
   for the target's Python, not this one (pip would evaluate them for the Python running it), torch left out;
   and the build system's requirements, for the editable install.
2. What the index has no wheel of (DeepSpeed, whose ops compile on first use) is built here with
   `pip wheel --no-deps`.
3. pip resolves the set for the target (`pip install --dry-run --report`, binary wheels only). From its
   report the packages needed are walked from the requirements, markers evaluated for the target, never
   through torch: torch's own dependencies (the CUDA libraries, triton) come with the target's torch.
   --have takes `python3 -m pip list --format=freeze` of the target: what it has already is left out, with
   what only that needs (the target's version is used then, whatever pyproject.toml pins).
4. `pip download --no-deps --only-binary=:all:` fetches the wheels; WHEELS/requirements.txt pins what the
   project runs with (name==version), the build requirements apart.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import NamedTuple

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
KEPT_BY_TARGET = "torch"
BUILT_HERE = ("deepspeed",)  # published as a source distribution only
RESOLVE_ROUNDS = 3


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


def top_requirements(pyproject: dict, environment: dict[str, str], extras: list[str]) -> tuple[list, list]:
    """(run requirements, build requirements) of the project on the target, torch left out."""
    project = pyproject["project"]
    texts = list(project["dependencies"])
    for extra in extras:
        texts += project["optional-dependencies"][extra]

    def kept(items):
        requirements = [Requirement(text) for text in items]
        return [r for r in requirements
                if canonicalize_name(r.name) != KEPT_BY_TARGET and applies(r.marker, environment)]

    return kept(texts), kept(pyproject["build-system"]["requires"])


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


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def resolve(requirements: list[str], target: list[str], find_links: Path) -> dict[str, Package]:
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.json"
        pip("install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report), "--only-binary=:all:",
            "--find-links", str(find_links), *target, *requirements)
        return packages_of_report(json.loads(report.read_text()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for the wheels and requirements.txt")
    parser.add_argument("--python-version", default="3.12", help="the target's Python (default 3.12)")
    parser.add_argument("--machine", default="x86_64", help="the target's CPU architecture (default x86_64)")
    parser.add_argument("--glibc", default="2.28", help="the target's glibc, `ldd --version` (default 2.28)")
    parser.add_argument("--have", type=Path, help="the target's `python3 -m pip list --format=freeze`")
    parser.add_argument("--extra", action="append", default=[], help="an optional-dependencies group too")
    parser.add_argument("--pyproject", type=Path, default=REPO / "pyproject.toml", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    environment = target_environment(args.python_version, args.machine)
    run, build = top_requirements(tomllib.loads(args.pyproject.read_text()), environment, args.extra)
    have = have_names(args.have.read_text()) if args.have else set()
    target = ["--python-version", args.python_version, "--implementation", "cp",
              *(f"--platform={tag}" for tag in platforms(args.machine, args.glibc))]
    args.out.mkdir(parents=True, exist_ok=True)
    for requirement in run:
        if canonicalize_name(requirement.name) in BUILT_HERE and canonicalize_name(requirement.name) not in have:
            pip("wheel", "--no-deps", "--quiet", "--wheel-dir", str(args.out), without_marker(requirement))

    asked = [without_marker(r) for r in run + build if canonicalize_name(r.name) not in have]
    for _ in range(RESOLVE_ROUNDS):  # pip evaluates its dependencies' markers for this Python: add what it left out
        packages = resolve(asked, target, args.out)
        run_packages, unresolved = needed(run, packages, environment, have)
        build_packages, unresolved_build = needed(build, packages, environment, have)
        missing = [without_marker(r) for r in unresolved + unresolved_build]
        if not missing:
            break
        asked += missing
    else:
        sys.exit(f"error: pip did not resolve {', '.join(missing)} for Python {args.python_version}")

    wanted = {**build_packages, **run_packages}
    fetched = [f"{p.name}=={p.version}" for name, p in sorted(wanted.items()) if name not in BUILT_HERE]
    pip("download", "--no-deps", "--quiet", "--only-binary=:all:", "--dest", str(args.out), *target, *fetched)
    pins = [f"{p.name}=={p.version}" for _, p in sorted(run_packages.items())]
    (args.out / "requirements.txt").write_text("".join(f"{pin}\n" for pin in pins))
    size = sum(f.stat().st_size for f in args.out.glob("*.whl"))
    print(f"{len(wanted)} wheels ({size / 2**20:,.0f} MiB) for Python {args.python_version} on {args.machine} "
          f"in {args.out}; {len(pins)} pinned in {args.out / 'requirements.txt'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
