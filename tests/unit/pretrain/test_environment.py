"""The revision a run records: the checkout's HEAD, marked dirty, or what a copy without .git was told."""

import subprocess

from pretrain import environment


def git(cwd, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                   capture_output=True)


def test_git_revision_is_head_and_says_dirty(tmp_path, monkeypatch):
    git(tmp_path, "init", "-q")
    (tmp_path / "a.txt").write_text("1\n")
    git(tmp_path, "add", "a.txt")
    git(tmp_path, "commit", "-q", "-m", "one")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    monkeypatch.setattr(environment, "REPO", tmp_path)
    monkeypatch.setenv("ORA_GIT_REVISION", "recorded")  # a checkout's own HEAD wins over it
    assert environment.git_revision() == head
    (tmp_path / "a.txt").write_text("2\n")
    assert environment.git_revision() == head + "-dirty"


def test_git_revision_without_git_is_the_recorded_one(tmp_path, monkeypatch):
    monkeypatch.setattr(environment, "REPO", tmp_path)  # no .git: a Docker image, the GPU machine's copy
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    monkeypatch.setenv("ORA_GIT_REVISION", "abc123")
    assert environment.git_revision() == "abc123"
    monkeypatch.delenv("ORA_GIT_REVISION")
    assert environment.git_revision() == ""
