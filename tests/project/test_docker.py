"""docker/: the GPU image's Dockerfile, entrypoint and build context, checked without a Docker engine; the
bring-up script of a GPU machine without network, run here without a GPU.

Linters (hadolint, shellcheck), the build context against .dockerignore, the pins against pyproject.toml (the
Dockerfile's own pin-reading snippet is run here), the base image tag and the user the image runs as.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from pretrain_runs import REPO

DOCKERFILE = REPO / "docker" / "Dockerfile"
ENTRYPOINT = REPO / "docker" / "entrypoint.sh"
BRINGUP = REPO / "docker" / "gpu_bringup.sh"
HEREDOC = re.compile(r"<<-?(['\"]?)(\w+)\1")


def tool(name: str) -> str:
    """A linter from the test extra: beside this interpreter (the venv) or on PATH (the image)."""
    found = shutil.which(name, path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    assert found, f"{name} not found: install the test extra (pip install -e '.[test]')"
    return found


def instructions(text: str) -> list[tuple[str, str, str]]:
    """(KEYWORD, arguments, heredoc body) per instruction: comments dropped, continuation lines joined."""
    result, lines = [], iter(text.splitlines())
    for line in lines:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        while line.endswith("\\"):
            line = line[:-1] + " " + next(lines).strip()
        keyword, _, args = line.strip().partition(" ")
        body = []
        if (marker := HEREDOC.search(args)) is not None:
            for body_line in lines:
                if body_line == marker.group(2):
                    break
                body.append(body_line)
        result.append((keyword.upper(), args.strip(), "\n".join(body) + "\n" if body else ""))
    return result


def of(keyword: str) -> list[tuple[str, str]]:
    return [(args, body) for kw, args, body in instructions(DOCKERFILE.read_text()) if kw == keyword]


def env_settings() -> dict[str, str]:
    settings = {}
    for args, _ in of("ENV"):
        for item in shlex.split(args):
            key, _, value = item.partition("=")
            settings[key] = value
    return settings


def dockerignore_excludes(path: str) -> bool:
    """Docker's rule: the last matching pattern decides ("!" re-includes); a pattern matching a parent
    directory excludes everything below it; `**` spans directories, `*` stays within one."""
    excluded = False
    for line in (REPO / ".dockerignore").read_text().splitlines():
        pattern = line.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = os.path.normpath(pattern.lstrip("!").strip("/"))
        regex = "".join(".*" if part == "**" else re.escape(part).replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
                        for part in re.split(r"(\*\*)", pattern))
        regex = regex.replace(".*/", "(.*/)?")
        parts = path.split("/")
        if any(re.fullmatch(regex, "/".join(parts[:n])) for n in range(1, len(parts) + 1)):
            excluded = not negate
    return excluded


def ci_extras() -> list[str]:
    """The extras CI installs: the Makefile's EXTRAS (its `install` target, which .ci/run goes through)."""
    (line,) = [line for line in (REPO / "Makefile").read_text().splitlines() if line.startswith("EXTRAS :=")]
    return line.partition(":=")[2].strip().split(",")


def pin_snippet() -> str:
    """The Python program the Dockerfile runs to turn pyproject.toml into the image's pin files."""
    (body,) = [body for args, body in of("RUN") if args.startswith("python3 -")]
    return body


def run_pin_snippet(pyproject: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess, Path]:
    (tmp_path / "pyproject.toml").write_text(pyproject)
    out = tmp_path / "etc-ora"
    done = subprocess.run([sys.executable, "-", str(out)], input=pin_snippet(), cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    return done, out


def test_hadolint_reports_nothing_and_every_ignore_says_why():
    out = subprocess.run([tool("hadolint"), "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = DOCKERFILE.read_text().splitlines()
    for number, line in enumerate(lines):
        if "hadolint ignore" in line:
            before = lines[number - 1].strip()
            assert before.startswith("#") and "hadolint" not in before, f"line {number + 1}: say why above it"


def test_entrypoint_is_executable_and_shellcheck_clean():
    assert os.access(ENTRYPOINT, os.X_OK)
    out = subprocess.run([tool("shellcheck"), str(ENTRYPOINT)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    (entrypoint,) = of("ENTRYPOINT")
    (workdir,) = of("WORKDIR")
    # Exec form (signals reach the command), naming the script that `COPY . .` puts under WORKDIR.
    script = Path(shlex.split(entrypoint[0].strip("[]").replace(",", " "))[0])
    assert script.relative_to(workdir[0]) == ENTRYPOINT.relative_to(REPO)


def test_entrypoint_without_a_command_prints_the_dockerfile_header():
    out = subprocess.run(["bash", str(ENTRYPOINT)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    header = DOCKERFILE.read_text().split("\n\n")[0].splitlines()[1:]
    assert out.stdout.splitlines() == [re.sub(r"^# ?", "", line) for line in header]
    for needed in ("docker build", "--ipc=host", "--network host", "NODE_RANK", "MASTER_ADDR",
                   "launch/pretrain_ora.sh"):
        assert needed in out.stdout
    (cmd,) = of("CMD")
    assert cmd[0] == '["--help"]'


def test_entrypoint_runs_the_command_with_a_writable_home(tmp_path):
    command = 'echo "$HOME"; test -w "$HOME"; exit 7'
    env = {**os.environ, "HOME": "/nonexistent", "TMPDIR": str(tmp_path)}
    out = subprocess.run(["bash", str(ENTRYPOINT), "sh", "-c", command], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 7  # exec: the command's status is the container's
    assert out.stdout.splitlines()[-1] == str(tmp_path / "ora-home")
    env["HOME"] = str(tmp_path)
    out = subprocess.run(["bash", str(ENTRYPOINT), "sh", "-c", command], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.stdout.splitlines()[-1] == str(tmp_path)


def test_copy_sources_exist_and_reach_the_build_context():
    copies = of("COPY")
    assert copies
    needed = ["pyproject.toml", str(ENTRYPOINT.relative_to(REPO)), "launch", "ds_configs"]
    needed += tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    for args, _ in copies:
        assert not args.startswith("--from"), "single-stage image: every COPY comes from the context"
        *sources, _destination = shlex.split(args)
        for source in sources:
            assert (REPO / source).exists(), source
            assert source == "." or not dockerignore_excludes(os.path.normpath(source)), source
            if source == ".":
                for path in needed:
                    path = path.rstrip("*")
                    assert (REPO / path).exists() and not dockerignore_excludes(path), path
    if (REPO / ".git").exists():  # not inside the image, which has no .git
        tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True)
        assert [path for path in tracked.stdout.splitlines() if dockerignore_excludes(path)] == []


def test_dockerignore_keeps_local_state_and_secrets_out():
    for path in (".git/HEAD", ".venv/bin/python", "runs/demo/run/config.yaml", ".whl/x.whl", ".gpu/dev.sh",
                 "pretrain/__pycache__/config.cpython-312.pyc", "ora.egg-info/PKG-INFO", ".pytest_cache/v",
                 ".env", "launch/.env"):
        assert dockerignore_excludes(path), path
    assert not dockerignore_excludes("pretrain/run_files/run_dir.py")
    assert not dockerignore_excludes("launch/environment.sh")


def test_pins_are_read_from_pyproject_not_written_in_the_dockerfile(tmp_path):
    pyproject = (REPO / "pyproject.toml").read_text()
    project = tomllib.loads(pyproject)["project"]
    names = {re.match(r"[A-Za-z0-9._-]+", r).group().lower() for r in project["dependencies"]}
    # No pin typed by hand: no "<package><op><digit>" in any instruction or heredoc (comments may cite versions).
    code = "\n".join(f"{args}\n{body}" for _, args, body in instructions(DOCKERFILE.read_text()))
    for name in names:
        assert not re.search(rf"(?i)\b{re.escape(name)}\s*(==|>=|<=|~=|!=|<|>)\s*\d", code), name
    # The installs take their packages from the generated files or from the project itself, nothing else.
    installs = [args for args, _ in of("RUN") if "pip install" in args]
    assert installs and all("--requirement /etc/ora/requirements.txt --constraint /etc/ora/constraints.txt" in a
                            or "--no-deps --editable ." in a for a in installs)
    assert env_settings()["PIP_CONSTRAINT"] == ""  # NGC's /etc/pip/constraint.txt would veto pyproject's pins

    done, out = run_pin_snippet(pyproject, tmp_path)
    assert done.returncode == 0, done.stderr
    # What CI installs, torch aside: the dependencies and the extras the Makefile names, which are all of them.
    extras = ci_extras()
    assert extras == list(project["optional-dependencies"])
    installed = project["dependencies"] + [r for extra in extras for r in project["optional-dependencies"][extra]]
    expected = [r for r in installed if not r.startswith("torch")]
    assert (out / "requirements.txt").read_text().splitlines() == expected
    assert (out / "constraints.txt").read_text() == f"torch=={importlib.metadata.version('torch')}\n"


def test_pin_snippet_refuses_a_base_image_with_another_torch_minor(tmp_path):
    pyproject = (REPO / "pyproject.toml").read_text()
    (pin,) = [r for r in tomllib.loads(pyproject)["project"]["dependencies"] if r.startswith("torch")]
    done, out = run_pin_snippet(pyproject.replace(f'"{pin}"', '"torch==2.99.0"'), tmp_path)
    assert done.returncode != 0
    assert "torch==2.99.0" in done.stderr and "NGC tag" in done.stderr
    assert not out.exists()


@pytest.mark.parametrize("line", ["FROM", "# syntax="])
def test_images_are_pinned(line):
    text = DOCKERFILE.read_text()
    if line == "FROM":
        ((image, _),) = of("FROM")
        # NVIDIA's PyTorch container, by release (YY.MM), Python 3 flavour.
        assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3", image), image
    else:
        (syntax,) = [s for s in text.splitlines()[:1] if s.startswith(line)]
        assert re.fullmatch(r"# syntax=docker/dockerfile:\d+\.\d+", syntax), syntax
    assert "latest" not in text


def test_runs_as_a_non_root_user():
    users = of("USER")
    assert users, "no USER: the image would run as root"
    user, _, group = users[-1][0].partition(":")
    # Numeric, so that the host and Kubernetes' runAsNonRoot can tell it is not root.
    assert user.isdigit() and int(user) != 0 and group.isdigit() and int(group) != 0
    creates = [args for args, _ in of("RUN") if "useradd" in args]
    assert any(f"--uid {user}" in args for args in creates)


# ---------------------------------------------------------------------------- the GPU machine's bring-up
def test_bringup_is_executable_and_shellcheck_clean():
    assert os.access(BRINGUP, os.X_OK)
    out = subprocess.run([tool("shellcheck"), str(BRINGUP)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def hand_made_wheel(folder: Path, module: str = "ora_probe", version: str = "1.0") -> None:
    """A wheel of one module, written here: no index, no build."""
    info = f"{module}-{version}.dist-info"
    files = {f"{module}.py": "VALUE = 1\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {module}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    digest = {path: base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
              for path, text in files.items()}
    files[f"{info}/RECORD"] = "".join(f"{path},sha256={digest[path]},{len(text)}\n" for path, text in files.items())
    files[f"{info}/RECORD"] += f"{info}/RECORD,,\n"
    with zipfile.ZipFile(folder / f"{module}-{version}-py3-none-any.whl", "w") as wheel:
        for path, text in files.items():
            wheel.writestr(path, text)


@pytest.mark.slow
def test_bringup_installs_offline_checks_the_imports_and_exits_with_the_report(tmp_path):
    """This interpreter plays the GPU machine's Python (a virtualenv's, whose packages --system-site-packages
    would miss), a hand-made wheel the GPU set: the virtualenv gets the wheel with --no-index and sees the
    machine's torch, the imports pass, the report refuses without CUDA (the suite hides GPUs): status 2, on a
    second run too. A wheel missing from WHEELS stops it before the report: status 3, naming the log."""
    wheels, report, venv = tmp_path / "wheels", tmp_path / "report", tmp_path / "venv"
    wheels.mkdir()
    hand_made_wheel(wheels)
    (wheels / "requirements.txt").write_text("ora_probe==1.0\n")
    env = {**os.environ, "PYTHON": sys.executable, "ORA_GPU_VENV": str(venv)}

    def bringup() -> subprocess.CompletedProcess:
        return subprocess.run([str(BRINGUP), str(wheels), str(report)], env=env, capture_output=True, text=True,
                              timeout=300)

    for _ in range(2):
        out = bringup()
        assert out.returncode == 2, out.stderr[-3000:]
        assert "the GPU report's imports: ok (torch " in out.stderr and "no CUDA device" in out.stderr
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import ora_probe, torch; print(ora_probe.__file__)"],
                           capture_output=True, text=True, timeout=120)
    assert where.returncode == 0 and where.stdout.startswith(str(venv)), where.stderr[-2000:]
    assert (report / "logs" / "bringup-install.log").is_file() and not (report / "gpu_report.md").exists()

    (wheels / "requirements.txt").write_text("ora_missing==1.0\n")
    out = bringup()
    assert out.returncode == 3 and f"{report}/logs/bringup-install.log" in out.stderr
