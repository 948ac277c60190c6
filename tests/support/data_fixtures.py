"""Synthetic SlimPajama-format corpora for the data_tools tests, with known contents and
deliberately broken records."""

import gzip
import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

import zstandard

SOURCES = (
    "RedPajamaCommonCrawl",
    "RedPajamaC4",
    "RedPajamaGithub",
    "RedPajamaBook",
    "RedPajamaArXiv",
    "RedPajamaWikipedia",
    "RedPajamaStackExchange",
)
# skewed so that token shares differ between sources
SOURCE_WEIGHTS = (7, 5, 4, 3, 2, 2, 1)
WORDS = (
    "the", "model", "attention", "orthogonal", "random", "frozen", "token", "def", "return",
    "x", "=", "+", "(", ")", "{", "}", ":", "1.5", "2024", "café", "naïve", "日本語", "Straße",
    "über", "ελληνικά", "🙂", "—", "'quoted'", '"double"', "back\\slash", "a_b", "λ",
)
SEPARATORS = (" ", " ", " ", "  ", "\t", "\n", "\n\n", " \n    ")


@dataclass(frozen=True)
class FixtureDocument:
    text: str
    source: str
    path: str
    line: int


@dataclass
class Corpus:
    root: str
    documents: list[FixtureDocument] = field(default_factory=list)
    skips: list[tuple[str, str, int]] = field(default_factory=list)  # (reason, path, line)
    files: list[str] = field(default_factory=list)


def make_text(rng: random.Random, min_words: int, max_words: int) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))]
    text = "".join(word + rng.choice(SEPARATORS) for word in words)
    return rng.choice(("", " ", "\n")) + text.rstrip() + rng.choice(("", "\n"))


def json_line(text, source: str | None = None, key: str = "text") -> bytes:
    record = {key: text}
    if source is not None:
        record["meta"] = {"redpajama_set_name": source}
    return json.dumps(record, ensure_ascii=False).encode("utf-8") + b"\n"


def compress(data: bytes, compression: str) -> bytes:
    if compression == "zst":
        return zstandard.ZstdCompressor(level=3).compress(data)
    return gzip.compress(data, mtime=0)


def write_file(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as handle:
        handle.write(data)


def add_good_file(corpus: Corpus, path, rng, documents: int, words: tuple[int, int]) -> None:
    lines = []
    for line in range(1, documents + 1):
        source = rng.choices(SOURCES, SOURCE_WEIGHTS)[0]
        text = make_text(rng, *words)
        corpus.documents.append(FixtureDocument(text, source, path, line))
        lines.append(json_line(text, source))
    write_file(path, compress(b"".join(lines), path.rsplit(".", 1)[1]))
    corpus.files.append(path)


def add_bad_records_file(corpus: Corpus, path: str, rng) -> None:
    """Every kind of bad line between good ones (a blank line is no record at all)."""
    good = lambda: make_text(rng, 5, 20)  # noqa: E731
    lines = [
        ("doc", good()),
        ("invalid_json", b'{"text": "unterminated\n'),
        ("missing_text", json_line(None, "RedPajamaC4", key="body")),
        ("missing_text", b'{"text": 42, "meta": {"redpajama_set_name": "RedPajamaC4"}}\n'),
        ("missing_text", b"[1, 2, 3]\n"),
        ("doc", good()),
        ("blank", b"   \n"),
        ("invalid_utf8", b'{"text": "bad \xff\xfe byte"}\n'),
        ("invalid_utf8", b'{"text": "lone \\ud800 surrogate"}\n'),
        ("empty_document", json_line("", "RedPajamaBook")),
        ("empty_document", json_line(" \n\t ", "RedPajamaBook")),
        ("doc", good()),
    ]
    data = []
    for line, (kind, payload) in enumerate(lines, 1):
        if kind == "doc":
            corpus.documents.append(FixtureDocument(payload, "RedPajamaWikipedia", path, line))
            data.append(json_line(payload, "RedPajamaWikipedia"))
        else:
            if kind != "blank":
                corpus.skips.append((kind, path, line))
            data.append(payload)
    write_file(path, compress(b"".join(data), "zst"))
    corpus.files.append(path)


def add_truncated_file(corpus: Corpus, path: str, rng, documents: int) -> None:
    """A complete first frame/member of good lines, then a second one cut short: the reader
    keeps the first frame's documents and reports truncated_file on the next line."""
    compression = path.rsplit(".", 1)[1]
    lines = []
    for line in range(1, documents + 1):
        text = make_text(rng, 5, 20)
        corpus.documents.append(FixtureDocument(text, "RedPajamaArXiv", path, line))
        lines.append(json_line(text, "RedPajamaArXiv"))
    lost = json_line("x" * 500 + make_text(rng, 50, 60), "RedPajamaArXiv") * 3
    cut = compress(lost, compression)[:20]
    write_file(path, compress(b"".join(lines), compression) + cut)
    corpus.skips.append(("truncated_file", path, documents + 1))
    corpus.files.append(path)


def build_slimpajama(
    root: str,
    chunks: int = 2,
    files_per_chunk: int = 2,
    documents_per_file: int = 30,
    words: tuple[int, int] = (10, 60),
    seed: int = 0,
    bad_records: bool = True,
) -> Corpus:
    """root/train/chunkN/example_train_K.jsonl.zst with documents of all seven source sets,
    plus (bad_records) a file of bad lines and truncated .zst and .gz files. Corpus.documents
    lists the good documents in the readers' (sorted) order."""
    rng = random.Random(seed)
    corpus = Corpus(root)
    for chunk in range(1, chunks + 1):
        for index in range(files_per_chunk):
            path = os.path.join(root, "train", f"chunk{chunk}", f"example_train_{index}.jsonl.zst")
            add_good_file(corpus, path, rng, documents_per_file, words)
    if bad_records:
        last_chunk = os.path.join(root, "train", f"chunk{chunks}")
        add_bad_records_file(
            corpus, os.path.join(last_chunk, f"example_train_{files_per_chunk}.jsonl.zst"), rng
        )
        truncated = os.path.join(root, "train", f"chunk{chunks + 1}")
        add_truncated_file(corpus, os.path.join(truncated, "example_train_0.jsonl.gz"), rng, 4)
        add_truncated_file(corpus, os.path.join(truncated, "example_train_1.jsonl.zst"), rng, 4)
    return corpus


def word_tokenizer(root: Path, words: list[str], vocab_size: int, words_per_line: int) -> Path:
    """A sentencepiece model (data_tools.train_tokenizer) of 200 lines of `words` drawn at random: root/sp.model."""
    from data_tools import train_tokenizer

    rng = random.Random(0)
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": " ".join(rng.choices(words, k=words_per_line))}) + "\n"
                              for _ in range(200)))
    train_tokenizer.main(["--input", str(corpus), "--model-prefix", str(root / "sp"), "--vocab-size", str(vocab_size),
                          "--num-threads", "1"])
    return root / "sp.model"
