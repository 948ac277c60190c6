"""data_tools.build_shards / inspect_shards / manifest: megatron-core indexed datasets from a
SlimPajama-format corpus, their manifest, splits, blends, determinism, resume and --strict."""

import contextlib
import dataclasses
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy
import pytest
import sentencepiece
import torch
from data_fixtures import SOURCES, build_slimpajama
from megatron.core.datasets.indexed_dataset import IndexedDataset
from pretrain_runs import REPO

from data_tools import build_shards, readers, train_tokenizer
from data_tools import inspect_shards as inspect_tool
from data_tools.build_options import BuildOptionError, BuildOptions
from data_tools.manifest import blend_from_manifest, blend_per_split_from_manifest
from data_tools.split_plan import SplitPlan

SPLIT = "train=0.8,valid=0.1,test=0.1"
FRACTIONS = (0.8, 0.1, 0.1)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_slimpajama(str(tmp_path_factory.mktemp("slimpajama")))


@pytest.fixture(scope="module")
def tokenizer_path(corpus, tmp_path_factory):
    prefix = tmp_path_factory.mktemp("tokenizer") / "sp"
    train_tokenizer.main(
        ["--input", corpus.root, "--model-prefix", str(prefix), "--vocab-size", "400",
         "--num-threads", "1"]
    )
    return f"{prefix}.model"


@pytest.fixture(scope="module")
def tokenizer(tokenizer_path):
    return sentencepiece.SentencePieceProcessor(model_file=tokenizer_path)


def build_args(corpus_root, tokenizer_path, out_dir, *extra):
    return ["--input", corpus_root, "--tokenizer", tokenizer_path, "--output-dir", str(out_dir),
            "--quiet", *extra]


def build(corpus, tokenizer_path, out_dir, *extra):
    build_shards.main(build_args(corpus.root, tokenizer_path, out_dir, *extra))
    return json.loads((Path(out_dir) / "manifest.json").read_text())


@pytest.fixture(scope="module")
def baseline(corpus, tokenizer_path, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("baseline")
    manifest = build(corpus, tokenizer_path, out_dir, "--split-by-source", "--split", SPLIT,
                     "--max-shard-tokens", "800", "--workers", "1")
    return out_dir, manifest


def stored_documents(out_dir, manifest) -> dict[tuple[str, str], list[list[int]]]:
    """Per (source, split), the token lists of its documents over its shards, in order."""
    families = defaultdict(list)
    for entry in sorted(manifest["datasets"], key=lambda e: (e["source"], e["split"], e["shard"])):
        dataset = IndexedDataset(str(Path(out_dir) / entry["prefix"]))
        families[(entry["source"], entry["split"])].extend(
            dataset[i].tolist() for i in range(len(dataset))
        )
    return dict(families)


def document_split(corpus, document, mode_plan):
    name = os.path.relpath(document.path, corpus.root)
    return mode_plan.split_of(name, document.line, document.source, None)


def shard_files(out_dir) -> dict[str, bytes]:
    return {
        p.name: p.read_bytes()
        for p in sorted(Path(out_dir).iterdir())
        if p.suffix in (".bin", ".idx")
    }


def test_documents_round_trip_per_source_and_split(corpus, tokenizer, baseline):
    out_dir, manifest = baseline
    plan = SplitPlan(FRACTIONS, "documents", 1234)
    expected = defaultdict(list)
    for document in corpus.documents:
        expected[(document.source, document_split(corpus, document, plan))].append(document.text)
    stored = stored_documents(out_dir, manifest)

    assert set(stored) == set(expected)
    assert {source for source, _ in stored} == set(SOURCES)
    eod = tokenizer.eos_id()
    for family, texts in expected.items():
        documents = stored[family]
        assert [tokens[:-1] for tokens in documents] == [tokenizer.encode(t) for t in texts]
        assert all(tokens[-1] == eod and eod not in tokens[:-1] for tokens in documents)
        # identity normalization + byte fallback: decoding gives the input text back exactly
        assert [tokenizer.decode(tokens[:-1]) for tokens in documents] == texts


def test_counts_equal_inputs_minus_reported_skips(corpus, tokenizer, baseline):
    _, manifest = baseline
    totals, skipped = manifest["totals"], manifest["skipped"]
    assert totals["documents"] == len(corpus.documents)
    assert totals["tokens"] == sum(len(tokenizer.encode(d.text)) + 1 for d in corpus.documents)
    assert totals["text_bytes"] == sum(len(d.text.encode()) for d in corpus.documents)
    assert totals["records"] == len(corpus.documents) + len(corpus.skips)
    assert skipped["total"] == len(corpus.skips)
    by_file = defaultdict(lambda: defaultdict(int))
    for reason, path, _ in corpus.skips:
        by_file[path][reason] += 1
    assert skipped["by_file"] == {path: dict(reasons) for path, reasons in by_file.items()}
    examples = [example for group in skipped["examples"].values() for example in group]
    for _, path, line in corpus.skips:
        assert any(example.startswith(f"{path}:{line}:") for example in examples)
    assert sum(e["documents"] for e in manifest["datasets"]) == totals["documents"]
    assert sum(e["tokens"] for e in manifest["datasets"]) == totals["tokens"]


def test_manifest_describes_shards_tokenizer_and_inputs(corpus, tokenizer_path, baseline):
    out_dir, manifest = baseline
    for entry in manifest["datasets"]:
        dataset = IndexedDataset(str(out_dir / entry["prefix"]))
        assert len(dataset) == entry["documents"]
        assert int(dataset.sequence_lengths.sum()) == entry["tokens"]
        assert dataset.index.dtype == numpy.uint16  # vocab 400 < 65500
        assert entry["tokens"] <= 800 or entry["documents"] == 1
        assert entry["prefix"] == f"{entry['source']}-{entry['split']}-{entry['shard']:05d}"
    assert manifest["tokenizer"]["path"] == os.path.abspath(tokenizer_path)
    assert len(manifest["tokenizer"]["sha256"]) == 64
    assert [i["path"] for i in manifest["inputs"]] == sorted(corpus.files)
    assert all(i["size"] == os.path.getsize(i["path"]) for i in manifest["inputs"])
    assert manifest["options"]["max_shard_tokens"] == 800
    assert not list(out_dir.glob("*.tmp"))
    assert len(list(out_dir.glob("*.done.json"))) == len(manifest["datasets"])


def test_token_share_blend_and_training_side_api(baseline):
    out_dir, manifest = baseline
    blends = blend_from_manifest(str(out_dir))
    assert set(blends) == {"train", "valid", "test"}
    for split, (prefixes, weights) in blends.items():
        entries = {e["prefix"]: e for e in manifest["datasets"] if e["split"] == split}
        total = sum(e["tokens"] for e in entries.values())
        assert sorted(os.path.basename(p) for p in prefixes) == sorted(entries)
        for prefix, weight in zip(prefixes, weights):
            assert os.path.isabs(prefix) and os.path.exists(prefix + ".bin")
            assert weight == pytest.approx(entries[os.path.basename(prefix)]["tokens"] / total)
        assert sum(weights) == pytest.approx(1.0)
    assert blend_per_split_from_manifest(str(out_dir / "manifest.json")) == [
        blends["train"], blends["valid"], blends["test"],
    ]


def test_user_weights_per_source(corpus, tokenizer_path, tmp_path):
    weights = {source: float(i + 1) for i, source in enumerate(SOURCES)}
    text = ",".join(f"{source}={weight}" for source, weight in weights.items())
    build(corpus, tokenizer_path, tmp_path, "--split-by-source", "--max-shard-tokens", "800",
          "--weights", text)
    prefixes, shares = blend_from_manifest(str(tmp_path))["train"]
    per_source = defaultdict(float)
    for prefix, share in zip(prefixes, shares):
        per_source[os.path.basename(prefix).split("-")[0]] += share
    for source, weight in weights.items():
        assert per_source[source] == pytest.approx(weight / sum(weights.values()))

    with pytest.raises(SystemExit):
        build(corpus, tokenizer_path, tmp_path / "bad", "--split-by-source",
              "--weights", "RedPajamaC4=1")


@pytest.mark.slow
def test_contiguous_split_is_ordered_disjoint_and_covering(corpus, tokenizer_path, tokenizer,
                                                          tmp_path):
    manifest = build(corpus, tokenizer_path, tmp_path, "--split-by-source",
                     "--split", SPLIT, "--split-mode", "contiguous", "--workers", "2")
    stored = stored_documents(tmp_path, manifest)
    for source in SOURCES:
        texts = [d.text for d in corpus.documents if d.source == source]
        first_valid, first_test = round(len(texts) * 0.8), round(len(texts) * 0.9)
        parts = {
            split: [tokenizer.decode(t[:-1]) for t in stored.get((source, split), [])]
            for split in ("train", "valid", "test")
        }
        assert parts["train"] == texts[:first_valid]
        assert parts["valid"] == texts[first_valid:first_test]
        assert parts["test"] == texts[first_test:]


def test_document_split_is_disjoint_and_covering(corpus, tokenizer, baseline):
    out_dir, manifest = baseline
    stored = stored_documents(out_dir, manifest)
    decoded = {
        family: [tokenizer.decode(tokens[:-1]) for tokens in documents]
        for family, documents in stored.items()
    }
    for source in SOURCES:
        texts = [d.text for d in corpus.documents if d.source == source]
        parts = [decoded.get((source, split), []) for split in ("train", "valid", "test")]
        assert sorted(sum(parts, [])) == sorted(texts)
        assert sum(len(part) for part in parts) == len(texts)
    counts = {split: sum(e["documents"] for e in manifest["datasets"] if e["split"] == split)
              for split in ("train", "valid", "test")}
    assert counts["train"] > 4 * counts["valid"] > 0 and counts["test"] > 0


def test_two_workers_write_byte_identical_datasets(corpus, tokenizer_path, baseline, tmp_path,
                                                  monkeypatch):
    out_dir, manifest = baseline
    # many small chunks so that the two workers really interleave (chunk size changes nothing)
    monkeypatch.setattr(build_shards, "iter_chunks",
                        functools.partial(readers.iter_chunks, max_items=3))
    other = build(corpus, tokenizer_path, tmp_path, "--split-by-source", "--split", SPLIT,
                  "--max-shard-tokens", "800", "--workers", "2")
    assert shard_files(tmp_path) == shard_files(out_dir)
    assert other["datasets"] == manifest["datasets"]
    assert other["blend"] == manifest["blend"]


def test_library_build_without_argparse_matches_the_command_line(corpus, tokenizer_path, baseline,
                                                                  tmp_path):
    out_dir, manifest = baseline
    options = BuildOptions(input=[corpus.root], tokenizer=tokenizer_path, output_dir=str(tmp_path),
                           workers=1, split_by_source=True, split=FRACTIONS,
                           max_shard_tokens=800, quiet=True)
    stats = build_shards.build(options)
    library_manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert stats["documents_tokenized"] == manifest["totals"]["documents"]
    assert shard_files(tmp_path) == shard_files(out_dir)
    assert library_manifest["datasets"] == manifest["datasets"]
    assert library_manifest["options"] == {**manifest["options"], "output_dir": str(tmp_path)}


@pytest.mark.parametrize("change, message", [
    ({"workers": 0}, "--workers must be >= 1"),
    ({"max_shard_tokens": 0}, "--max-shard-tokens must be >= 1"),
    ({"weights": {"RedPajamaC4": 1.0}}, "--weights needs --split-by-source"),
    ({"weights": {"RedPajamaC4": -1.0}, "split_by_source": True}, "--weights must be >= 0"),
    ({"split_mode": "by_file"}, "--split-mode must be one of documents, contiguous"),
    ({"split": (0.8, 0.2)}, "--split must be 3 fractions"),
    ({"split": (8.0, 1.0, 1.0)}, "--split must be 3 fractions"),
])
def test_invalid_build_options_raise_naming_the_option(change, message, tmp_path):
    valid = BuildOptions(input=["corpus"], tokenizer="sp.model", output_dir=str(tmp_path))
    with pytest.raises(BuildOptionError, match=re.escape(message)):
        BuildOptions(input=["corpus"], tokenizer="sp.model", output_dir=str(tmp_path), **change)
    with pytest.raises(BuildOptionError, match=re.escape(message)):
        dataclasses.replace(valid, **change)


def test_command_line_reports_invalid_options_as_usage_errors(capsys):
    for flags, message in ((["--workers", "0"], "--workers must be >= 1"),
                           (["--weights", "a=1"], "--weights needs --split-by-source")):
        with pytest.raises(SystemExit) as exit_info:
            build_shards.parse_args(["--input", "corpus", "--tokenizer", "sp.model",
                                     "--output-dir", "out", *flags])
        assert exit_info.value.code == 2
        assert f"error: {message}" in capsys.readouterr().err


@contextlib.contextmanager
def single_process_group():
    """megatron-core's BlendedDataset asks torch.distributed for the rank when it caches."""
    if torch.distributed.is_initialized():
        yield
        return
    torch.distributed.init_process_group(
        "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1
    )
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


def test_gpt_dataset_reads_the_blend(baseline, tokenizer_path, tmp_path):
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.tokenizers import MegatronTokenizer

    out_dir, manifest = baseline
    tokenizer = MegatronTokenizer.from_pretrained(
        tokenizer_path, metadata_path={"library": "sentencepiece", "model_type": "gpt"}
    )
    assert tokenizer.eod == manifest["tokenizer"]["eod_id"]
    config = GPTDatasetConfig(
        random_seed=1, sequence_length=32, blend_per_split=blend_per_split_from_manifest(out_dir),
        tokenizer=tokenizer, reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, path_to_cache=str(tmp_path / "cache"),
    )
    with single_process_group():
        train, valid, test = BlendedMegatronDatasetBuilder(
            GPTDataset, [64, 8, 8], lambda: True, config
        ).build()
    documents = [d for family in stored_documents(out_dir, manifest).values() for d in family]
    for dataset, size in ((train, 64), (valid, 8), (test, 8)):
        assert len(dataset) >= size
        for index in range(size):
            sample = dataset[index]
            tokens, labels = sample["tokens"].tolist(), sample["labels"].tolist()
            assert len(tokens) == 32 and tokens[1:] == labels[:-1]
            window = tokens + labels[-1:]
            if tokenizer.eod in window:  # the tokens up to the first EOD end a stored document
                head = window[: window.index(tokenizer.eod) + 1]
                assert any(d[-len(head):] == head for d in documents)


@pytest.mark.slow
def test_strict_stops_at_first_bad_record_and_leaves_nothing(corpus, tokenizer_path, tmp_path,
                                                             capsys):
    for mode in ("documents", "contiguous"):
        out_dir = tmp_path / mode
        with pytest.raises(SystemExit) as exit_info:
            build(corpus, tokenizer_path, out_dir, "--strict", "--split-by-source",
                  "--split", SPLIT, "--split-mode", mode, "--max-shard-tokens", "300")
        assert exit_info.value.code == 1
        message = capsys.readouterr().err
        first_bad = os.path.join(corpus.root, "train", "chunk2", "example_train_2.jsonl.zst")
        assert f"{first_bad}:2: invalid_json" in message
        assert sorted(p.name for p in out_dir.iterdir()) == []


def test_inspect_reports_and_detects_damage(corpus, tokenizer_path, tmp_path, capsys):
    build(corpus, tokenizer_path, tmp_path, "--max-shard-tokens", "5000")
    inspect_tool.main([str(tmp_path), "--verify", "--chars", "80"])
    report = capsys.readouterr().out
    assert "all-train-00000" in report and "document 0" in report
    assert f"total: {len(corpus.documents):,} documents" in report

    bin_path = tmp_path / "all-train-00001.bin"
    damaged = bytearray(bin_path.read_bytes())
    damaged[0] ^= 0xFF
    bin_path.write_bytes(bytes(damaged))
    with pytest.raises(SystemExit):
        inspect_tool.main([str(tmp_path), "--verify"])
    assert "MISMATCH: bin sha256" in capsys.readouterr().out


@pytest.mark.slow
def test_rerun_with_other_options_rebuilds(corpus, tokenizer_path, tmp_path):
    first_manifest = build(corpus, tokenizer_path, tmp_path, "--split", SPLIT,
                           "--max-shard-tokens", "2000")
    first = json.loads((tmp_path / "build_stats.json").read_text())
    assert first["shards_reused"] == 0
    build(corpus, tokenizer_path, tmp_path, "--split", SPLIT, "--max-shard-tokens", "2000")
    rerun = json.loads((tmp_path / "build_stats.json").read_text())
    assert rerun["shards_reused"] == first_manifest["totals"]["shards"] > 1
    assert rerun["documents_tokenized"] == 0
    manifest = build(corpus, tokenizer_path, tmp_path, "--split", SPLIT, "--seed", "7",
                     "--max-shard-tokens", "2000")
    changed = json.loads((tmp_path / "build_stats.json").read_text())
    assert changed["shards_reused"] == 0
    assert changed["documents_tokenized"] == len(corpus.documents)
    on_disk = {p.name.split(".")[0] for p in tmp_path.glob("*.bin")}
    assert on_disk == {e["prefix"] for e in manifest["datasets"]}


@pytest.fixture(scope="module")
def large_corpus(tmp_path_factory):
    """Big enough that a build is still running when its first shard completes."""
    return build_slimpajama(str(tmp_path_factory.mktemp("large")), chunks=3, files_per_chunk=3,
                            documents_per_file=250, words=(100, 300), seed=1)


@pytest.mark.slow
def test_kill_mid_build_then_rerun_gives_the_uninterrupted_result(large_corpus, tokenizer_path,
                                                                  tmp_path):
    out_dir = tmp_path / "out"
    args = build_args(large_corpus.root, tokenizer_path, out_dir, "--split-by-source",
                      "--split", SPLIT, "--max-shard-tokens", "4000", "--workers", "1")
    build_shards.main(args)
    uninterrupted_manifest = (out_dir / "manifest.json").read_bytes()
    uninterrupted_shards = shard_files(out_dir)
    shutil.rmtree(out_dir)

    process = subprocess.Popen([sys.executable, "-m", "data_tools.build_shards", *args],
                               cwd=REPO, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not list(out_dir.glob("*.done.json")):
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    process.wait()
    done_before = len(list(out_dir.glob("*.done.json")))
    assert not (out_dir / "manifest.json").exists()
    assert list(out_dir.glob("*.tmp"))  # killed with shards half written
    assert 0 < done_before < len(json.loads(uninterrupted_manifest)["datasets"])

    build_shards.main(args)
    stats = json.loads((out_dir / "build_stats.json").read_text())
    assert stats["shards_reused"] >= done_before
    assert (out_dir / "manifest.json").read_bytes() == uninterrupted_manifest
    assert shard_files(out_dir) == uninterrupted_shards
    assert not list(out_dir.glob("*.tmp"))
