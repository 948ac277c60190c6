"""The revision a run records: the checkout's HEAD, marked dirty, or what a copy without .git was told."""

import subprocess

from pretrain.job import environment


def git(cwd, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                   capture_output=True)


def committed_repository(path) -> str:
    """A git repository at `path` with one commit; its HEAD."""
    path.mkdir(parents=True, exist_ok=True)
    git(path, "init", "-q")
    (path / "a.txt").write_text("1\n")
    git(path, "add", "a.txt")
    git(path, "commit", "-q", "-m", "one")
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=path, capture_output=True, text=True).stdout.strip()


def test_git_revision_is_head_and_says_dirty(tmp_path, monkeypatch):
    head = committed_repository(tmp_path)
    monkeypatch.setenv("ORA_GIT_REVISION", "recorded")  # a checkout's own HEAD wins over it
    assert environment.git_revision(tmp_path) == head
    (tmp_path / "a.txt").write_text("2\n")
    assert environment.git_revision(tmp_path) == head + "-dirty"


def test_git_revision_without_git_is_the_recorded_one(tmp_path, monkeypatch):
    # No .git here or above: a Docker image, the GPU machine's copy.
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    monkeypatch.setenv("ORA_GIT_REVISION", "abc123")
    assert environment.git_revision(tmp_path) == "abc123"
    monkeypatch.delenv("ORA_GIT_REVISION")
    assert environment.git_revision(tmp_path) == ""


def test_a_copy_inside_another_repository_does_not_take_its_head(tmp_path, monkeypatch):
    """A copy of the project without .git of its own, in a folder of another repository (tracked there or not):
    that repository's HEAD is not the project's revision; the repository's own root still gets it."""
    outer = tmp_path / "outer"
    committed_repository(outer)
    project = outer / "vendored" / "ora"
    project.mkdir(parents=True)
    (project / "pyproject.toml").write_text("[project]\n")
    monkeypatch.setenv("ORA_GIT_REVISION", "recorded")
    assert environment.git_revision(project) == "recorded"
    git(outer, "add", "vendored")
    git(outer, "commit", "-q", "-m", "the copy")
    outer_head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=outer, capture_output=True, text=True).stdout.strip()
    assert environment.git_revision(project) == "recorded"
    monkeypatch.delenv("ORA_GIT_REVISION")
    assert environment.git_revision(project) == ""
    assert environment.git_revision(outer) == outer_head
