"""Before launch, a manifest's data is checked against the files and the config: the tokenizer is the
one the shards were built with, every shard has the sizes and document count the manifest records,
a split shorter than one sample is warned about (pretrain.runtime.data.check_data), and data_tools.inspect_shards
reports a damaged shard instead of crashing on it."""

from __future__ import annotations

import json
import shutil

import pytest
from pretrain_runs import write_config

from data_tools import inspect_shards as inspect_tool
from data_tools import train_tokenizer
from pretrain import pretrain_ora


def check_only(tmp_path, *overrides: str) -> int:
    """pretrain_ora.py --check-only on the tiny config reading `overrides`' data; its exit status."""
    args = ["--config", str(write_config(tmp_path)), "--run-dir", str(tmp_path / "never"), "--check-only",
            "--set", "data.mock=false", "--set", "model.vocab_size=400"]
    for item in overrides:
        args += ["--set", item]
    return pretrain_ora.main(args)


def manifest_of(shards) -> str:
    return f"data.manifest={shards / 'manifest.json'}"


@pytest.fixture
def shards_copy(shards, tmp_path):
    """A copy of the built shards to damage (the manifest's prefixes are relative to its directory)."""
    return shutil.copytree(shards, tmp_path / "shards")


def train_other_tokenizer(shards, prefix, *options: str) -> str:
    train_tokenizer.main(["--input", str(shards.parent / "corpus"), "--model-prefix", str(prefix),
                          "--num-threads", "1", *options])
    return f"{prefix}.model"


# ---------------------------------------------------------------------------- the tokenizer
@pytest.mark.parametrize("options, differs", [
    (["--vocab-size", "350"], "vocab size 350 vs 400"),  # ids of the shards past its vocabulary
    (["--vocab-size", "400", "--model-type", "unigram"], "sha256"),  # same size: would train silently
])
def test_another_tokenizer_than_the_shards_were_built_with_is_refused(shards, tmp_path, capsys, options, differs):
    other = train_other_tokenizer(shards, tmp_path / "other", *options)
    assert check_only(tmp_path, manifest_of(shards), f"data.tokenizer={other}") == 2
    err = capsys.readouterr().err
    built_with = json.loads((shards / "manifest.json").read_text())["tokenizer"]["path"]
    assert "'data.tokenizer'" in err and other in err and built_with in err and differs in err, err
    assert "config ok" not in err


def test_a_copy_of_the_tokenizer_is_accepted(shards, tmp_path, capsys):
    copy = shutil.copy(json.loads((shards / "manifest.json").read_text())["tokenizer"]["path"], tmp_path / "sp.model")
    assert check_only(tmp_path, manifest_of(shards), f"data.tokenizer={copy}") == 0
    assert "config ok" in capsys.readouterr().out


def test_missing_tokenizer_of_the_manifest_names_the_key(shards_copy, tmp_path, capsys):
    manifest = json.loads((shards_copy / "manifest.json").read_text())
    manifest["tokenizer"]["path"] = str(tmp_path / "moved" / "sp.model")
    (shards_copy / "manifest.json").write_text(json.dumps(manifest))
    assert check_only(tmp_path, manifest_of(shards_copy)) == 2
    assert f"'data.tokenizer': no tokenizer model at {tmp_path / 'moved' / 'sp.model'}" in capsys.readouterr().err


# ---------------------------------------------------------------------------- the manifest and its shards
def test_missing_manifest_names_the_key(tmp_path, capsys):
    assert check_only(tmp_path, f"data.manifest={tmp_path / 'nowhere' / 'manifest.json'}") == 2
    err = capsys.readouterr().err
    assert "'data.manifest'" in err and str(tmp_path / "nowhere" / "manifest.json") in err


def truncate_first_train_bin(shards) -> tuple[str, int, int]:
    """Halve the first train shard's .bin; (its path, bytes left, bytes recorded)."""
    entry = next(e for e in json.loads((shards / "manifest.json").read_text())["datasets"] if e["split"] == "train")
    path = shards / f"{entry['prefix']}.bin"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return str(path), len(data) // 2, entry["bin_bytes"]


def test_truncated_shard_is_refused_naming_the_file_and_both_sizes(shards_copy, tmp_path, capsys):
    path, size, recorded = truncate_first_train_bin(shards_copy)
    assert check_only(tmp_path, manifest_of(shards_copy)) == 2
    err = capsys.readouterr().err
    assert "'data.manifest'" in err and f"{path} has {size:,} bytes, {recorded:,} recorded" in err, err


def test_other_document_count_than_the_manifest_is_refused(shards_copy, tmp_path, capsys):
    manifest = json.loads((shards_copy / "manifest.json").read_text())
    entry = manifest["datasets"][0]
    entry["documents"] += 1
    (shards_copy / "manifest.json").write_text(json.dumps(manifest))
    assert check_only(tmp_path, manifest_of(shards_copy)) == 2
    assert (f"{shards_copy / entry['prefix']}.idx indexes {entry['documents'] - 1:,} documents, "
            f"{entry['documents']:,} recorded") in capsys.readouterr().err


def test_inspect_reports_a_truncated_shard(shards_copy, capsys):
    path, size, recorded = truncate_first_train_bin(shards_copy)
    with pytest.raises(SystemExit) as exit_info:
        inspect_tool.main([str(shards_copy)])
    assert exit_info.value.code == 1
    out = capsys.readouterr().out
    assert f"MISMATCH: {path} has {size:,} bytes, {recorded:,} recorded" in out
    assert "total:" in out, "the rest of the report is printed"


# ---------------------------------------------------------------------------- splits and the sample length
def test_split_shorter_than_one_sample_is_warned_about(shards, tmp_path, capsys):
    manifest = json.loads((shards / "manifest.json").read_text())
    valid_tokens = sum(e["tokens"] for e in manifest["datasets"] if e["split"] == "valid")
    assert check_only(tmp_path, manifest_of(shards), f"model.seq_length={valid_tokens}") == 0
    err = capsys.readouterr().err
    assert (f"warning: the valid split holds {valid_tokens} tokens, fewer than one sample "
            f"(model.seq_length + 1 = {valid_tokens + 1})") in err
    assert "the train split" not in err
