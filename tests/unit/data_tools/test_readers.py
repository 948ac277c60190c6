"""data_tools.readers: every input format, ordering, sources, file:line, bad records."""

import hashlib
import os
import sysconfig

import pytest
from data_fixtures import build_slimpajama, compress, json_line, write_file

from data_tools.readers import (
    Document,
    InputError,
    ReaderOptions,
    Skip,
    expand_inputs,
    iter_chunks,
    iter_documents,
)


def read(specs, **options):
    files = expand_inputs(specs)
    records = list(iter_documents(files, ReaderOptions(**options)))
    documents = [(r.text, r.source, r.path, r.line) for r in records if isinstance(r, Document)]
    skips = [(r.reason, r.path, r.line) for r in records if isinstance(r, Skip)]
    return files, documents, skips


def test_slimpajama_layout_documents_sources_lines_and_bad_records(tmp_path):
    corpus = build_slimpajama(str(tmp_path / "SlimPajama"))
    files, documents, skips = read([str(tmp_path / "SlimPajama")])

    assert [file.path for file in files] == sorted(corpus.files)
    assert [file.name for file in files][0] == "train/chunk1/example_train_0.jsonl.zst"
    expected = [(d.text, d.source, d.path, d.line) for d in corpus.documents]
    assert documents == expected  # same texts, sources, files, lines, in sorted-file order
    assert len({source for _, source, _, _ in documents}) == 7
    assert sorted(skips) == sorted(corpus.skips)
    assert {reason for reason, _, _ in skips} == {
        "invalid_json", "missing_text", "invalid_utf8", "empty_document", "truncated_file",
    }


def test_sha256_covers_whole_file_even_when_truncated(tmp_path):
    corpus = build_slimpajama(str(tmp_path), chunks=1, files_per_chunk=1, documents_per_file=3)
    files = expand_inputs([str(tmp_path)])
    list(iter_documents(files))
    for file in files:
        with open(file.path, "rb") as handle:
            assert file.sha256 == hashlib.sha256(handle.read()).hexdigest()
    assert any(reason == "truncated_file" for reason, _, _ in corpus.skips)


def test_globs_and_directories_expand_in_natural_order_and_deduplicated(tmp_path):
    for name in ("b.jsonl", "a.jsonl", "sub/c.jsonl", "notes.md", "chunk10/x.jsonl",
                 "chunk2/x.jsonl", "chunk2/x_10.jsonl", "chunk2/x_9.jsonl"):
        write_file(str(tmp_path / name), json_line(name))
    expected = ["a.jsonl", "b.jsonl", "chunk2/x.jsonl", "chunk2/x_9.jsonl", "chunk2/x_10.jsonl",
                "chunk10/x.jsonl", "sub/c.jsonl"]
    files = expand_inputs([str(tmp_path / "**" / "*.jsonl"), str(tmp_path / "a.jsonl")])
    assert [file.name for file in files] == expected
    assert [file.name for file in expand_inputs([str(tmp_path)])] == expected
    with pytest.raises(InputError, match="unsupported"):
        expand_inputs([str(tmp_path / "notes.md")])
    with pytest.raises(InputError, match="no such file"):
        expand_inputs([str(tmp_path / "missing.jsonl")])


def test_plain_and_gzip_jsonl_take_source_from_file_name_or_option(tmp_path):
    write_file(str(tmp_path / "web.jsonl"), json_line("one") + json_line("two", "RedPajamaC4"))
    write_file(str(tmp_path / "books.jsonl.gz"), compress(json_line("three"), "gz"))
    _, documents, _ = read([str(tmp_path / "web.jsonl"), str(tmp_path / "books.jsonl.gz")])
    assert [(text, source, line) for text, source, _, line in documents] == [
        ("one", "web", 1), ("two", "RedPajamaC4", 2), ("three", "books", 1),
    ]
    _, documents, _ = read([str(tmp_path / "web.jsonl")], source_name="mine")
    assert [source for _, source, _, _ in documents] == ["mine", "RedPajamaC4"]


def test_txt_modes(tmp_path):
    text = "first para\nstill first\n\n\n  \nsecond para\n\nthird\n"
    write_file(str(tmp_path / "book.txt"), text.encode())
    spec = [str(tmp_path / "book.txt")]

    _, whole, _ = read(spec, txt_mode="file")
    assert [(t, s, line) for t, s, _, line in whole] == [(text, "book", 1)]
    _, paragraphs, _ = read(spec, txt_mode="paragraph")
    assert [(t, line) for t, _, _, line in paragraphs] == [
        ("first para\nstill first", 1), ("second para", 6), ("third", 8),
    ]
    _, lines, _ = read(spec, txt_mode="line")
    assert [(t, line) for t, _, _, line in lines] == [
        ("first para", 1), ("still first", 2), ("second para", 6), ("third", 8),
    ]


def test_txt_invalid_utf8_is_skipped_with_its_line(tmp_path):
    write_file(str(tmp_path / "t.txt"), b"good\n\nbad \xff\n\nfine\n")
    _, documents, skips = read([str(tmp_path / "t.txt")])
    assert [t for t, _, _, _ in documents] == ["good", "fine"]
    assert skips == [("invalid_utf8", str(tmp_path / "t.txt"), 3)]


def test_corrupt_zstd_file_is_reported_not_raised(tmp_path):
    write_file(str(tmp_path / "bad.jsonl.zst"), b"this is not zstd data\n")
    _, documents, skips = read([str(tmp_path / "bad.jsonl.zst")])
    assert documents == []
    assert skips == [("corrupt_file", str(tmp_path / "bad.jsonl.zst"), 1)]


@pytest.mark.slow
def test_parquet_rows_with_and_without_meta(tmp_path):
    import pyarrow
    import pyarrow.parquet

    meta = [{"redpajama_set_name": "RedPajamaBook"}, {"redpajama_set_name": "RedPajamaC4"}, None]
    table = pyarrow.table({"text": ["alpha", None, "gamma"], "meta": meta})
    pyarrow.parquet.write_table(table, str(tmp_path / "part.parquet"), row_group_size=2)
    pyarrow.parquet.write_table(pyarrow.table({"text": ["plain"]}), str(tmp_path / "z.parquet"))
    _, documents, skips = read([str(tmp_path)])
    assert [(t, s, line) for t, s, _, line in documents] == [
        ("alpha", "RedPajamaBook", 1), ("gamma", "part", 3), ("plain", "z", 1),
    ]
    assert skips == [("missing_text", str(tmp_path / "part.parquet"), 2)]


def test_hugging_face_dataset_from_local_path_streams(tmp_path):
    import datasets

    meta = [{"redpajama_set_name": "RedPajamaGithub"}] * 3
    rows = {"text": ["hf one", "hf two", ""], "meta": meta}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "saved"))
    write_file(str(tmp_path / "jsondir" / "data.jsonl"), json_line("from json dir"))

    _, documents, skips = read(["hf:" + str(tmp_path / "saved")])
    assert [(t, s, line) for t, s, _, line in documents] == [
        ("hf one", "RedPajamaGithub", 1), ("hf two", "RedPajamaGithub", 2),
    ]
    assert [reason for reason, _, _ in skips] == ["empty_document"]
    _, documents, _ = read(["hf:" + str(tmp_path / "jsondir")], source_name="web")
    assert [(t, s) for t, s, _, _ in documents] == [("from json dir", "web")]


def test_chunks_stay_within_a_file_and_number_records_in_order(tmp_path):
    corpus = build_slimpajama(str(tmp_path), documents_per_file=25, bad_records=False)
    files = expand_inputs([str(tmp_path)])
    chunks = list(iter_chunks(files, ReaderOptions(), max_items=10))
    assert len({chunk.file_index for chunk in chunks}) == len(files)
    ordinal = 0
    for chunk in chunks:
        assert chunk.first_ordinal == ordinal
        assert len(chunk.items) <= 10
        ordinal += len(chunk.items)
        assert chunk.file_bytes_read <= os.path.getsize(files[chunk.file_index].path)
    assert ordinal == len(corpus.documents)


def test_lines_longer_than_a_read_block(tmp_path):
    long_text = "long line " * 250_000  # 2.5 MB: spans several 1 MiB read blocks
    write_file(str(tmp_path / "big.jsonl"), json_line("a") + json_line(long_text) + json_line("b"))
    _, documents, skips = read([str(tmp_path / "big.jsonl")])
    assert [(text, line) for text, _, _, line in documents] == [("a", 1), (long_text, 2), ("b", 3)]
    assert skips == []


def test_sample_corpus_is_deterministic_slimpajama_of_stdlib_sources(tmp_path):
    from data_tools import sample_corpus

    first = sample_corpus.write_corpus(str(tmp_path / "a"), max_files=40, max_file_bytes=60_000)
    second = sample_corpus.write_corpus(str(tmp_path / "b"), max_files=40, max_file_bytes=60_000)
    assert len(first) > 1
    names = [os.path.relpath(path, tmp_path / "a") for path in first]
    assert all(name.startswith("chunk1/example_train_") for name in names)
    assert [open(p, "rb").read() for p in first] == [open(p, "rb").read() for p in second]

    sources = sample_corpus.python_sources(sysconfig.get_paths()["stdlib"], 40)
    assert sources == sorted(sources, key=lambda p: os.path.relpath(p, os.path.dirname(sources[0])))
    assert not any("site-packages" in p or f"{os.sep}test{os.sep}" in p for p in sources)
    _, documents, skips = read([str(tmp_path / "a")])
    texts = [open(p, encoding="utf-8", newline="").read() for p in sources]
    assert [text for text, _, _, _ in documents] == [t for t in texts if t.strip()]
    assert {source for _, source, _, _ in documents} == {"RedPajamaGithub"}
    assert len(skips) == sum(1 for t in texts if not t.strip())


def test_sample_corpus_of_another_folder(tmp_path, capsys):
    from data_tools import sample_corpus

    (tmp_path / "src" / "pkg" / "tests").mkdir(parents=True)
    (tmp_path / "src" / "pkg" / "b.py").write_text("b = 2\n")
    (tmp_path / "src" / "a.py").write_text("a = 1\n")
    (tmp_path / "src" / "pkg" / "tests" / "test_b.py").write_text("left out\n")
    (tmp_path / "src" / "notes.txt").write_text("not Python\n")
    sample_corpus.main(["--output-dir", str(tmp_path / "out"), "--root", str(tmp_path / "src")])
    _, documents, _ = read([str(tmp_path / "out")])
    assert [text for text, _, _, _ in documents] == ["a = 1\n", "b = 2\n"]
    assert f"2 Python files of {tmp_path / 'src'}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sample_corpus.main(["--output-dir", str(tmp_path / "out2"), "--root", str(tmp_path / "missing")])
