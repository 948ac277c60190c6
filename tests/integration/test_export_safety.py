"""pretrain.export.convert_to_hf never writes over the run it reads, the current directory or a user's
files; it replaces only what an export of ours wrote (or anything, with --force); it never
reaches the network."""

from __future__ import annotations

import json

import pytest
from network_guard import no_network
from pretrain_runs import write_config

from ora_megatron.config_io import to_dict
from pretrain.config.run_config import load_run_config
from pretrain.export.convert_to_hf import main
from pretrain.export.export_record import EXPORT_RECORD
from pretrain.run_files.run_dir import RunDir


@pytest.fixture
def run_dir(tmp_path):
    """A run dir as the trainer starts it (config only, no checkpoint yet), plus a file of the user's."""
    run = RunDir(tmp_path / "runs" / "mine")
    run.write_config(to_dict(load_run_config(str(write_config(tmp_path)))))
    (run.path / "notes.txt").write_text("mine")
    return run


def files(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def export_error(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return captured.err


@pytest.mark.parametrize("where", ["the run dir", "inside it", "its parent"])
@pytest.mark.parametrize("force", [[], ["--force"]])
def test_the_run_dir_is_never_written_over_or_into(run_dir, capsys, where, force):
    output = {"the run dir": run_dir.path, "inside it": run_dir.path / "hf", "its parent": run_dir.path.parent}[where]
    before = files(run_dir.path.parent)
    err = export_error(["--run-dir", str(run_dir.path), "--output", str(output), *force], capsys)
    assert f"would be written over or into the run dir {run_dir.path}" in err
    assert files(run_dir.path.parent) == before


@pytest.mark.parametrize("output", [".", "..", ""])
def test_the_current_directory_is_refused(run_dir, tmp_path, monkeypatch, capsys, output):
    here = tmp_path / "work" / "here"
    here.mkdir(parents=True)
    (here / "mine.txt").write_text("mine")
    monkeypatch.chdir(here)
    err = export_error(["--run-dir", str(run_dir.path), "--output", output, "--force"], capsys)
    assert f"--output {output or '.'}:" in err and "is the current directory or one above it" in err
    assert (here / "mine.txt").read_text() == "mine"


@pytest.mark.parametrize("taken", ["", ".partial", ".unverified"])
def test_a_directory_of_the_users_is_not_replaced_without_force(run_dir, tmp_path, capsys, taken):
    """DIR, or the DIR.partial / DIR.unverified it may replace, holding files no export wrote."""
    users = tmp_path / f"hf{taken}"
    users.mkdir()
    (users / "thesis.tex").write_text("mine")
    err = export_error(["--run-dir", str(run_dir.path), "--output", str(tmp_path / "hf")], capsys)
    assert f"{users} exists and holds files no earlier export wrote" in err and "--force" in err
    assert (users / "thesis.tex").read_text() == "mine"


def test_an_output_that_is_a_file_is_refused(run_dir, tmp_path, capsys):
    (tmp_path / "hf").write_text("mine")
    err = export_error(["--run-dir", str(run_dir.path), "--output", str(tmp_path / "hf"), "--force"], capsys)
    assert f"{tmp_path / 'hf'} exists and is not a directory" in err
    assert (tmp_path / "hf").read_text() == "mine"


@pytest.mark.distributed
def test_exports_replace_earlier_exports_of_ours_only(reference, tmp_path, capsys):
    """Rerunning an export replaces the earlier one (and a .partial an interrupted one left); a file a
    user added to the export makes it theirs: refused, unless --force. No step reaches the network.
    The run itself, checkpoints and all, is never the output."""
    before = files(reference)
    err = export_error(["--run-dir", str(reference), "--output", str(reference), "--force"], capsys)
    assert "would be written over or into the run dir" in err and files(reference) == before

    argv = ["--run-dir", str(reference), "--output", str(tmp_path / "hf")]
    with no_network() as attempts:
        assert main(argv) == 0
    assert attempts == []
    record = json.loads((tmp_path / "hf" / EXPORT_RECORD).read_text())
    assert record["verification"]["passed"] and "model.safetensors" in record["files"]
    assert sorted(files(tmp_path / "hf")) == sorted([EXPORT_RECORD, *record["files"]])

    interrupted = tmp_path / "hf.partial"
    interrupted.mkdir()
    (interrupted / EXPORT_RECORD).write_text(json.dumps({"files": []}))
    (interrupted / "model.safetensors").write_text("half written")
    assert main(argv) == 0
    assert not interrupted.exists() and (tmp_path / "hf" / "model.safetensors").stat().st_size > 1000

    (tmp_path / "hf" / "eval_notes.md").write_text("mine")
    assert "holds files no earlier export wrote" in export_error(argv, capsys)
    assert (tmp_path / "hf" / "eval_notes.md").read_text() == "mine"
    assert main([*argv, "--force"]) == 0
    assert not (tmp_path / "hf" / "eval_notes.md").exists()
