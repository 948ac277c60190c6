"""Corpus readers: SlimPajama jsonl.zst, jsonl(.gz), txt, parquet and Hugging Face datasets.

Reading is split in two so that the expensive part can run in worker processes:
`iter_chunks` (main process) frames the input into raw items (bytes of a JSON line, a text
paragraph, a parquet/HF value) grouped in chunks that never span files, and `parse_item`
(any process) turns one raw item into (text, source, utf-8 bytes) or raises `BadRecord`.
`iter_documents` chains both for sequential consumers (tokenizer training, tests).

Every record keeps its file and 1-based line (row for parquet/HF), and its source-set name:
`meta.redpajama_set_name` when present, else `ReaderOptions.source_name`, else the file name
without its extensions (the dataset name for HF inputs).
"""

import dataclasses
import glob
import hashlib
import json
import os
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import zstandard

READ_BLOCK_BYTES = 1 << 20
HF_PREFIX = "hf:"
TXT_MODES = ("file", "paragraph", "line")
SKIP_REASONS = (
    "invalid_json",
    "missing_text",
    "invalid_utf8",
    "empty_document",
    "truncated_file",
    "corrupt_file",
)
# suffix -> (format, compression); longest suffixes first so ".jsonl.zst" wins over ".zst"
_SUFFIXES = (
    (".jsonl.zst", ("jsonl", "zst")),
    (".jsonl.gz", ("jsonl", "gz")),
    (".jsonl", ("jsonl", None)),
    (".txt.zst", ("txt", "zst")),
    (".txt.gz", ("txt", "gz")),
    (".txt", ("txt", None)),
    (".parquet", ("parquet", None)),
)


class InputError(ValueError):
    """An input specification that cannot be read (missing file, unsupported format)."""


class DataError(Exception):
    """A bad record under --strict, or data a build cannot proceed with."""


class BadRecord(ValueError):
    """One record that cannot become a document; `reason` is one of SKIP_REASONS."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class ReaderOptions:
    text_key: str = "text"
    txt_mode: str = "paragraph"  # file: whole file; paragraph: blank-line separated; line
    source_name: str | None = None  # source for records without meta.redpajama_set_name
    hf_split: str = "train"
    hf_config: str | None = None


@dataclass
class InputFile:
    path: str  # what is opened (a file path, or a HF dataset name/path)
    name: str  # stable name relative to the input argument's root; keys the document split
    fmt: str  # jsonl | txt | parquet | hf
    compression: str | None
    size: int | None  # bytes on disk; None for HF datasets
    sha256: str | None = None  # set once the file has been read to the end


@dataclass
class RawItem:
    line: int
    payload: bytes | str | None
    source: str | None = None  # from the reader (parquet/HF meta column); None: decide in parse
    error: tuple[str, str] | None = None  # (reason, detail) found while framing the input


@dataclass
class RawChunk:
    file_index: int
    fmt: str
    default_source: str
    first_ordinal: int  # position of items[0] in the whole input stream, skipped records included
    items: list[RawItem]
    file_bytes_read: int | None  # raw bytes of the file consumed so far, for progress/ETA


@dataclass(frozen=True)
class Document:
    text: str
    source: str
    path: str
    line: int


@dataclass(frozen=True)
class Skip:
    reason: str
    detail: str
    path: str
    line: int


def add_reader_arguments(parser) -> None:
    """The reader options shared by the data_tools command lines."""
    parser.add_argument("--text-key", default="text", help="field holding the document text")
    parser.add_argument(
        "--txt-mode",
        choices=TXT_MODES,
        default="paragraph",
        help="how .txt files split into documents (default: blank-line separated paragraphs)",
    )
    parser.add_argument(
        "--source-name",
        default=None,
        help="source name for records without meta.redpajama_set_name "
        "(default: the file name without extensions)",
    )
    parser.add_argument("--hf-split", default="train", help="split of hf:NAME inputs")
    parser.add_argument("--hf-config", default=None, help="configuration name of hf:NAME inputs")


def reader_options_from_args(args) -> ReaderOptions:
    return ReaderOptions(
        text_key=args.text_key,
        txt_mode=args.txt_mode,
        source_name=args.source_name,
        hf_split=args.hf_split,
        hf_config=args.hf_config,
    )


def _format_of(path: str) -> tuple[str, str | None] | None:
    for suffix, fmt in _SUFFIXES:
        if path.endswith(suffix):
            return fmt
    return None


def _input_file(path: str, name: str) -> InputFile:
    fmt = _format_of(path)
    if fmt is None:
        supported = ", ".join(suffix for suffix, _ in _SUFFIXES)
        raise InputError(f"{path}: unsupported file type (supported: {supported})")
    return InputFile(path, name, fmt[0], fmt[1], os.path.getsize(path))


def natural_key(name: str) -> list:
    """Sort key reading digit runs as numbers: chunk2 before chunk10, like SlimPajama's
    numbering intends. re.split alternates text and digits, so lists compare like with like."""
    return [int(part) if index % 2 else part for index, part in enumerate(re.split(r"(\d+)", name))]


def _glob_root(pattern: str) -> str:
    """The directory part of a glob pattern before its first wildcard."""
    parts = pattern.split(os.sep)
    fixed = []
    for part in parts:
        if glob.has_magic(part):
            break
        fixed.append(part)
    return os.sep.join(fixed) or "."


def _expand_one(spec: str) -> list[InputFile]:
    if spec.startswith(HF_PREFIX):
        name = spec[len(HF_PREFIX) :]
        return [InputFile(name, name, "hf", None, None)]
    if os.path.isdir(spec):
        found = []
        for root, _, files in os.walk(spec):
            for file in files:
                path = os.path.join(root, file)
                if _format_of(path) is not None:
                    found.append(_input_file(path, os.path.relpath(path, spec)))
        return sorted(found, key=lambda f: natural_key(f.name))
    if glob.has_magic(spec):
        root = _glob_root(spec)
        paths = [p for p in glob.glob(spec, recursive=True) if os.path.isfile(p)]
        found = [_input_file(p, os.path.relpath(p, root)) for p in paths]
        return sorted(found, key=lambda f: natural_key(f.name))
    if os.path.isfile(spec):
        return [_input_file(spec, os.path.basename(spec))]
    raise InputError(f"{spec}: no such file or directory")


def expand_inputs(specs: list[str]) -> list[InputFile]:
    """Files named by paths, directories (recursive) and globs, each expanded in natural sorted
    order of its path, arguments in the order given; `hf:NAME_OR_PATH` names a Hugging Face
    dataset."""
    files, seen = [], set()
    for spec in specs:
        expanded = _expand_one(spec)
        if not expanded:
            raise InputError(f"{spec}: matches no readable input file")
        for file in expanded:
            key = file.path if file.fmt == "hf" else os.path.realpath(file.path)
            if key not in seen:
                seen.add(key)
                files.append(file)
    return files


def default_source(file: InputFile, options: ReaderOptions) -> str:
    if options.source_name:
        return options.source_name
    base = os.path.basename(file.path.rstrip("/"))
    if file.fmt == "hf":
        return base
    suffix = next(s for s, _ in _SUFFIXES if base.endswith(s))
    return base[: -len(suffix)]


class TruncatedInput(Exception):
    """The compressed stream ended inside a frame/member."""


class _RawFile:
    """Reads a file in blocks, hashing and counting what it has read."""

    def __init__(self, path: str):
        self._file = open(path, "rb")
        self.sha256 = hashlib.sha256()
        self.bytes_read = 0

    def blocks(self) -> Iterator[bytes]:
        while block := self._file.read(READ_BLOCK_BYTES):
            self.sha256.update(block)
            self.bytes_read += len(block)
            yield block

    def finish(self) -> str:
        """Hash whatever a failed decompression left unread, close, return the sha256."""
        for _ in self.blocks():
            pass
        self._file.close()
        return self.sha256.hexdigest()


def _decompressed(blocks: Iterator[bytes], compression: str | None) -> Iterator[bytes]:
    """Decompress concatenated zstd frames / gzip members; raise TruncatedInput if the data
    ends inside one (zstandard's stream reader returns short data silently in that case)."""
    if compression is None:
        yield from blocks
        return
    if compression == "zst":
        new_decompressor = zstandard.ZstdDecompressor().decompressobj
    else:
        new_decompressor = lambda: zlib.decompressobj(16 + zlib.MAX_WBITS)  # noqa: E731
    decompressor = None
    for block in blocks:
        while block:
            if decompressor is None:
                decompressor = new_decompressor()
            yield decompressor.decompress(block)
            if decompressor.eof:
                block, decompressor = decompressor.unused_data, None
            else:
                block = b""
    if decompressor is not None:
        raise TruncatedInput("input ends inside a compressed frame")


def _lines(blocks: Iterator[bytes]) -> Iterator[bytes]:
    """Lines without their b"\\n"; a partial line cut by an exception is never yielded.
    Pieces of a line spanning blocks are joined once, so very long lines stay linear."""
    pending: list[bytes] = []
    for block in blocks:
        lines = block.split(b"\n")
        if len(lines) == 1:
            pending.append(block)
            continue
        lines[0] = b"".join(pending) + lines[0]
        pending = [lines.pop()]
        yield from lines
    tail = b"".join(pending)
    if tail:
        yield tail


def _framed_items(lines, fmt: str, txt_mode: str) -> Iterator[RawItem]:
    """Raw items of a jsonl or txt stream of lines, numbered by the line they start on."""
    if fmt == "jsonl" or txt_mode == "line":
        for line_no, line in enumerate(lines, 1):
            if line.strip():
                yield RawItem(line_no, line)
        return
    paragraph, start = [], 0
    for line_no, line in enumerate(lines, 1):
        if line.strip():
            if not paragraph:
                start = line_no
            paragraph.append(line)
        elif paragraph:
            yield RawItem(start, b"\n".join(paragraph))
            paragraph = []
    if paragraph:
        yield RawItem(start, b"\n".join(paragraph))


class _LineCounter:
    """Counts the lines that pass through, so a decompression error can name its line."""

    def __init__(self, lines: Iterator[bytes]):
        self._lines = lines
        self.count = 0

    def __iter__(self):
        for line in self._lines:
            self.count += 1
            yield line


def _stream_items(file: InputFile, raw: _RawFile, options: ReaderOptions) -> Iterator[RawItem]:
    blocks = _decompressed(raw.blocks(), file.compression)
    counter = _LineCounter(_lines(blocks))
    try:
        if file.fmt == "txt" and options.txt_mode == "file":
            yield RawItem(1, b"".join(blocks))
        else:
            yield from _framed_items(counter, file.fmt, options.txt_mode)
    except TruncatedInput as error:
        yield RawItem(counter.count + 1, None, error=("truncated_file", str(error)))
    except (zstandard.ZstdError, zlib.error) as error:
        yield RawItem(counter.count + 1, None, error=("corrupt_file", str(error)))
    file.sha256 = raw.finish()


def _meta_source(meta) -> str | None:
    if isinstance(meta, dict):
        name = meta.get("redpajama_set_name")
        if isinstance(name, str) and name:
            return name
    return None


def _parquet_items(file: InputFile, options: ReaderOptions, progress) -> Iterator[RawItem]:
    import pyarrow
    import pyarrow.parquet

    with open(file.path, "rb") as handle:
        file.sha256 = hashlib.file_digest(handle, "sha256").hexdigest()
    try:
        parquet = pyarrow.parquet.ParquetFile(file.path)
    except pyarrow.ArrowException as error:
        yield RawItem(1, None, error=("corrupt_file", str(error)))
        return
    columns = parquet.schema_arrow.names
    if options.text_key not in columns:
        yield RawItem(1, None, error=("missing_text", f"no column {options.text_key!r}"))
        return
    wanted = [options.text_key] + (["meta"] if "meta" in columns else [])
    rows_total = max(parquet.metadata.num_rows, 1)
    row = 0
    for batch in parquet.iter_batches(batch_size=1024, columns=wanted):
        texts = batch.column(options.text_key).to_pylist()
        metas = batch.column("meta").to_pylist() if "meta" in wanted else [None] * len(texts)
        progress.bytes_read = file.size * (row + len(texts)) // rows_total
        for text, meta in zip(texts, metas):
            row += 1
            yield RawItem(row, text, _meta_source(meta))


def _hf_rows(file: InputFile, options: ReaderOptions):
    import datasets

    is_saved_dataset = os.path.isdir(file.path) and any(
        os.path.exists(os.path.join(file.path, marker))
        for marker in ("dataset_dict.json", "state.json")
    )
    if not is_saved_dataset:
        return datasets.load_dataset(
            file.path, name=options.hf_config, split=options.hf_split, streaming=True
        )
    saved = datasets.load_from_disk(file.path)
    if isinstance(saved, datasets.DatasetDict):
        saved = saved[options.hf_split]
    return saved.to_iterable_dataset()


def _hf_items(file: InputFile, options: ReaderOptions) -> Iterator[RawItem]:
    for row_no, row in enumerate(_hf_rows(file, options), 1):
        yield RawItem(row_no, row.get(options.text_key), _meta_source(row.get("meta")))


@dataclass
class _Progress:
    bytes_read: int | None


def _file_items(file: InputFile, options: ReaderOptions, progress: _Progress) -> Iterator[RawItem]:
    """Raw items of one input; progress follows the raw bytes consumed."""
    if file.fmt == "parquet":
        yield from _parquet_items(file, options, progress)
    elif file.fmt == "hf":
        yield from _hf_items(file, options)
    else:
        raw = _RawFile(file.path)
        for item in _stream_items(file, raw, options):
            progress.bytes_read = raw.bytes_read
            yield item


def iter_chunks(
    files: list[InputFile],
    options: ReaderOptions,
    max_items: int = 512,
    max_bytes: int = 1 << 20,
) -> Iterator[RawChunk]:
    """Raw items of all files in order, grouped in chunks of at most max_items items or about
    max_bytes payload bytes; a chunk never spans two files. Deterministic for given inputs."""
    ordinal = 0
    for file_index, file in enumerate(files):
        source = default_source(file, options)
        progress = _Progress(0 if file.size is not None else None)
        items, size = [], 0
        for item in _file_items(file, options, progress):
            items.append(item)
            size += len(item.payload) if isinstance(item.payload, (bytes, str)) else 0
            if len(items) >= max_items or size >= max_bytes:
                yield RawChunk(file_index, file.fmt, source, ordinal, items, progress.bytes_read)
                ordinal += len(items)
                items, size = [], 0
        if items:
            yield RawChunk(file_index, file.fmt, source, ordinal, items, file.size)
            ordinal += len(items)


def parse_item(item: RawItem, fmt: str, text_key: str) -> tuple[str, str | None, int]:
    """(text, source from the record's meta or None, utf-8 byte count), or raise BadRecord."""
    if item.error is not None:
        raise BadRecord(*item.error)
    payload = item.payload
    if isinstance(payload, bytes):
        try:
            payload = payload.decode("utf-8")
        except UnicodeDecodeError as error:
            raise BadRecord("invalid_utf8", str(error)) from None
    source = item.source
    if fmt == "jsonl":
        try:
            record = json.loads(payload)
        except ValueError as error:
            raise BadRecord("invalid_json", str(error)) from None
        if not isinstance(record, dict):
            raise BadRecord("missing_text", f"a JSON {type(record).__name__}, not an object")
        payload = record.get(text_key)
        source = _meta_source(record.get("meta"))
    if not isinstance(payload, str):
        raise BadRecord("missing_text", f"{text_key!r} is {type(payload).__name__}, not a string")
    if not payload.strip():
        raise BadRecord("empty_document", "no non-whitespace text")
    try:
        size = len(payload.encode("utf-8"))
    except UnicodeEncodeError as error:  # lone surrogates from JSON \ud800-style escapes
        raise BadRecord("invalid_utf8", str(error)) from None
    return payload, source, size


def iter_documents(
    files: list[InputFile], options: ReaderOptions = ReaderOptions()
) -> Iterator[Document | Skip]:
    """Documents and skipped records of expanded inputs, sequentially, in input order."""
    for chunk in iter_chunks(files, options):
        path = files[chunk.file_index].path
        for item in chunk.items:
            try:
                text, source, _ = parse_item(item, chunk.fmt, options.text_key)
            except BadRecord as bad:
                yield Skip(bad.reason, bad.detail, path, item.line)
            else:
                yield Document(text, source or chunk.default_source, path, item.line)


def input_summary(file: InputFile) -> dict:
    """What the manifests record of an input."""
    summary = dataclasses.asdict(file)
    summary.pop("compression")
    return summary
