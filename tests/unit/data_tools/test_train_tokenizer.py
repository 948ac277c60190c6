"""data_tools.train_tokenizer: sentencepiece training on a deterministic sample."""

import json
import random

import pytest
import sentencepiece
from data_fixtures import build_slimpajama, make_text

from data_tools import train_tokenizer
from data_tools.readers import Document, Skip


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_slimpajama(str(tmp_path_factory.mktemp("corpus")))


def train(corpus, prefix, *extra):
    train_tokenizer.main(
        ["--input", corpus.root, "--model-prefix", str(prefix), "--num-threads", "1", *extra]
    )
    return sentencepiece.SentencePieceProcessor(model_file=f"{prefix}.model")


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_trains_with_byte_fallback_special_ids_and_verbatim_round_trip(corpus, tmp_path,
                                                                       model_type):
    tokenizer = train(
        corpus, tmp_path / "sp", "--vocab-size", "400", "--model-type", model_type,
        "--user-defined-symbols", "<|code|>,<|math|>",
    )
    assert tokenizer.vocab_size() == 400
    assert [tokenizer.id_to_piece(i) for i in range(4)] == ["<unk>", "<s>", "</s>", "<pad>"]
    assert (tokenizer.unk_id(), tokenizer.bos_id(), tokenizer.eos_id(), tokenizer.pad_id()) == (
        0, 1, 2, 3,
    )
    assert len(tokenizer.encode("<|code|>", out_type=str)) <= 2  # "▁" + the symbol at most
    assert "<|code|>" in tokenizer.encode("<|code|>", out_type=str)
    rng = random.Random(7)
    texts = [d.text for d in corpus.documents[:20]] + [
        make_text(rng, 5, 30) for _ in range(20)
    ] + ["  two leading spaces\n\n\tand tabs  ", "unseen: Ω ₪ ж 🚀 ∮", "\nstarts with newline"]
    for text in texts:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.unk_id() not in tokenizer.encode("unseen: Ω ₪ ж 🚀 ∮")

    summary = json.loads((tmp_path / "sp.json").read_text())
    assert summary["model_type"] == model_type
    assert summary["vocab_size"] == 400
    assert summary["documents_seen"] == len(corpus.documents)
    assert summary["documents_sampled"] == len(corpus.documents)
    assert summary["skipped"] == {
        "invalid_json": 1, "missing_text": 3, "invalid_utf8": 2, "empty_document": 2,
        "truncated_file": 2,
    }
    assert [entry["path"] for entry in summary["inputs"]] == sorted(corpus.files)
    assert all(len(entry["sha256"]) == 64 for entry in summary["inputs"])
    assert (tmp_path / "sp.vocab").read_text().count("\n") == 400


def test_char_model(corpus, tmp_path):
    tokenizer = train(corpus, tmp_path / "char", "--vocab-size", "100", "--model-type", "char")
    pieces = tokenizer.encode("café λ", out_type=str)
    assert pieces == ["▁", "c", "a", "f", "é", "▁", "λ"]
    assert json.loads((tmp_path / "char.json").read_text())["byte_fallback"] is False


def test_sample_is_seeded_in_input_order_and_bounded():
    records = [Document(f"doc {i}", "s", "f", i) for i in range(100)]
    records.insert(10, Skip("invalid_json", "x", "f", 999))
    first, seen, skipped = train_tokenizer.sample_documents(records, 10, seed=1)
    again, _, _ = train_tokenizer.sample_documents(records, 10, seed=1)
    other, _, _ = train_tokenizer.sample_documents(records, 10, seed=2)
    assert first == again and first != other
    assert len(first) == 10 and seen == 100 and skipped == {"invalid_json": 1}
    assert first == sorted(first, key=lambda text: int(text.split()[1]))
    everything, _, _ = train_tokenizer.sample_documents(records, 1000, seed=1)
    assert everything == [f"doc {i}" for i in range(100)]


def test_sample_docs_limits_training_and_is_recorded(corpus, tmp_path):
    train(corpus, tmp_path / "small", "--vocab-size", "400", "--sample-docs", "30", "--seed", "3")
    summary = json.loads((tmp_path / "small.json").read_text())
    assert (summary["documents_sampled"], summary["seed"], summary["sample_docs"]) == (30, 3, 30)
    first_model = (tmp_path / "small.model").read_bytes()
    train(corpus, tmp_path / "small", "--vocab-size", "400", "--sample-docs", "30", "--seed", "3")
    assert (tmp_path / "small.model").read_bytes() == first_model


def test_too_large_vocabulary_fails_cleanly(corpus, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train(corpus, tmp_path / "big", "--vocab-size", "50000")
    assert exit_info.value.code == 1
    assert "sentencepiece training failed" in capsys.readouterr().err
