"""Shard files of a build: megatron-core IndexedDatasets written through
`IndexedDatasetBuilder` under temporary names, renamed when complete (.idx last), then marked
by a .done.json; and finding the completed shards an interrupted build can keep."""

import dataclasses
import hashlib
import json
import os
import re
import struct
import warnings
from collections import defaultdict

import numpy

from data_tools.atomic_json import write_json_atomic
from data_tools.readers import DataError

# megatron-core warns on import when Transformer Engine / Apex are absent; irrelevant to datasets
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
from megatron.core.datasets.indexed_dataset import (  # noqa: E402
    _INDEX_HEADER,
    DType,
    IndexedDatasetBuilder,
    get_bin_path,
    get_idx_path,
)

# megatron-core's .idx header (`_IndexReader`): magic, version (<Q), dtype code (<B), sequence
# count (<Q), then the count of document boundaries (<Q), one more than the documents.
_IDX_DOCUMENT_COUNT = struct.Struct("<QBQQ")

SHARD_FILE = re.compile(
    r"^(?P<prefix>[A-Za-z0-9_.]+-(train|valid|test)-\d{5})\.(bin|idx|done\.json)(\.tmp)?$"
)


@dataclasses.dataclass
class ShardInfo:
    prefix: str  # file name prefix inside the output directory
    source: str
    split: str
    shard: int
    documents: int
    tokens: int
    text_bytes: int
    first_ordinal: int
    last_ordinal: int
    bin_bytes: int
    idx_bytes: int
    bin_sha256: str
    idx_sha256: str
    build_key: str


def token_dtype(vocab_size: int) -> type:
    """megatron-core's choice for token ids: uint16 below 65,500 tokens, else int32."""
    return DType.optimal_dtype(vocab_size)


def sha256_file(path: str) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _safe_name(source: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.]+", "_", source)


class FamilyWriter:
    """Writes one (source, split) family as consecutive shards of at most max_tokens tokens
    (a longer document gets a shard to itself). Files are written as .tmp and renamed when
    complete, .idx last; the .done.json that marks completion is written after the renames."""

    def __init__(self, out_dir, source, split, dtype, max_tokens, build_key, completed):
        self.out_dir = out_dir
        self.source = source
        self.split = split
        self.dtype = dtype
        self.max_tokens = max_tokens
        self.build_key = build_key
        self.shards: list[ShardInfo] = list(completed)
        self._builder = None

    def _open(self, first_ordinal: int) -> None:
        self._prefix = f"{_safe_name(self.source)}-{self.split}-{len(self.shards):05d}"
        self._path = os.path.join(self.out_dir, self._prefix)
        self._builder = IndexedDatasetBuilder(get_bin_path(self._path) + ".tmp", dtype=self.dtype)
        self._documents = self._tokens = self._text_bytes = 0
        self._first_ordinal = self._last_ordinal = first_ordinal

    def add(self, tokens: numpy.ndarray, text_bytes: int, ordinal: int) -> None:
        if self._builder is not None and self._tokens + len(tokens) > self.max_tokens:
            self.close()
        if self._builder is None:
            self._open(ordinal)
        self._builder.add_document(tokens, [len(tokens)])
        self._documents += 1
        self._tokens += len(tokens)
        self._text_bytes += text_bytes
        self._last_ordinal = ordinal

    def close(self) -> None:
        """Complete the open shard, if any."""
        if self._builder is None:
            return
        bin_path, idx_path = get_bin_path(self._path), get_idx_path(self._path)
        self._builder.finalize(idx_path + ".tmp")
        self._builder = None
        info = ShardInfo(
            prefix=self._prefix,
            source=self.source,
            split=self.split,
            shard=len(self.shards),
            documents=self._documents,
            tokens=self._tokens,
            text_bytes=self._text_bytes,
            first_ordinal=self._first_ordinal,
            last_ordinal=self._last_ordinal,
            bin_bytes=os.path.getsize(bin_path + ".tmp"),
            idx_bytes=os.path.getsize(idx_path + ".tmp"),
            bin_sha256=sha256_file(bin_path + ".tmp"),
            idx_sha256=sha256_file(idx_path + ".tmp"),
            build_key=self.build_key,
        )
        os.replace(bin_path + ".tmp", bin_path)
        os.replace(idx_path + ".tmp", idx_path)
        done_path = os.path.join(self.out_dir, self._prefix + ".done.json")
        write_json_atomic(done_path, dataclasses.asdict(info))
        self.shards.append(info)

    def abandon(self) -> None:
        """Close the open shard's file without completing it (its .tmp files get removed)."""
        if self._builder is not None:
            self._builder.data_file.close()
            self._builder = None


class Families:
    """The FamilyWriters of a build, created on first use, continuing completed shards."""

    def __init__(self, out_dir, dtype, max_tokens, build_key, completed):
        self.out_dir = out_dir
        self.dtype = dtype
        self.max_tokens = max_tokens
        self.build_key = build_key
        self._writers = {}
        for family, run in completed.items():
            self._writers[family] = self._new_writer(*family, run)

    def add(self, family: tuple[str, str], tokens, text_bytes: int, ordinal: int) -> None:
        writer = self._writers.get(family)
        if writer is None:
            writer = self._writers[family] = self._new_writer(*family, [])
        writer.add(tokens, text_bytes, ordinal)

    def _new_writer(self, source: str, split: str, completed) -> FamilyWriter:
        clash = [s for s, _ in self._writers if s != source and _safe_name(s) == _safe_name(source)]
        if clash:
            raise DataError(f"sources {source!r} and {clash[0]!r} map to the same file names")
        return FamilyWriter(
            self.out_dir, source, split, self.dtype, self.max_tokens, self.build_key, completed
        )

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()

    def abandon(self) -> None:
        for writer in self._writers.values():
            writer.abandon()

    def shards(self) -> list[ShardInfo]:
        every = (info for writer in self._writers.values() for info in writer.shards)
        return sorted(every, key=lambda info: info.prefix)


def shard_files(out_dir: str) -> list[str]:
    return sorted(name for name in os.listdir(out_dir) if SHARD_FILE.match(name))


def _load_done(out_dir: str, name: str) -> ShardInfo | None:
    try:
        with open(os.path.join(out_dir, name), encoding="utf-8") as handle:
            return ShardInfo(**json.load(handle))
    except (ValueError, TypeError, OSError):
        return None


def indexed_documents(idx_path: str) -> int | None:
    """The document count an .idx header records (None when it is no megatron-core index);
    reads 34 bytes."""
    with open(idx_path, "rb") as handle:
        header = handle.read(len(_INDEX_HEADER) + _IDX_DOCUMENT_COUNT.size)
    if len(header) < len(_INDEX_HEADER) + _IDX_DOCUMENT_COUNT.size or not header.startswith(_INDEX_HEADER):
        return None
    *_, boundaries = _IDX_DOCUMENT_COUNT.unpack_from(header, len(_INDEX_HEADER))
    return boundaries - 1


def shard_file_problems(path: str, bin_bytes: int, idx_bytes: int, documents: int) -> list[str]:
    """How the .bin/.idx files of dataset prefix `path` differ from the byte sizes and document
    count recorded when they were written (empty when they match). Cheap: a stat per file and
    the .idx header, no data read."""
    problems = []
    for file, recorded in ((get_bin_path(path), bin_bytes), (get_idx_path(path), idx_bytes)):
        if not os.path.exists(file):
            problems.append(f"{file} is missing")
        elif os.path.getsize(file) != recorded:
            problems.append(f"{file} has {os.path.getsize(file):,} bytes, {recorded:,} recorded")
    idx_path = get_idx_path(path)
    if os.path.exists(idx_path):
        found = indexed_documents(idx_path)
        if found is None:
            problems.append(f"{idx_path} is not a megatron-core index (bad header)")
        elif found != documents:
            problems.append(f"{idx_path} indexes {found:,} documents, {documents:,} recorded")
    return problems


def manifest_shard_problems(manifest: dict, root: str) -> list[str]:
    """How the dataset files a manifest lists (relative to `root`, its folder) differ from what it records
    for them (shard_file_problems of each; empty when all match)."""
    return [problem for entry in manifest["datasets"]
            for problem in shard_file_problems(os.path.join(root, entry["prefix"]), entry["bin_bytes"],
                                               entry["idx_bytes"], entry["documents"])]


def _shard_is_intact(out_dir: str, info: ShardInfo) -> bool:
    """Sizes of both files, the document count and the checksum of the (small) index;
    bin_sha256 is for `inspect --verify`, which rereads everything."""
    path = os.path.join(out_dir, info.prefix)
    return not shard_file_problems(path, info.bin_bytes, info.idx_bytes, info.documents) and (
        sha256_file(get_idx_path(path)) == info.idx_sha256
    )


def completed_shards(out_dir: str, build_key: str) -> dict[tuple[str, str], list[ShardInfo]]:
    """Per family, the completed shards of an earlier run of the same build that can be kept:
    intact, from this build key, and consecutive from shard 0. Every other shard file in
    out_dir (temporary, unmarked, stale or from other options) is deleted."""
    candidates = defaultdict(dict)
    for name in shard_files(out_dir):
        if name.endswith(".done.json"):
            info = _load_done(out_dir, name)
            if info and info.build_key == build_key and _shard_is_intact(out_dir, info):
                candidates[(info.source, info.split)][info.shard] = info
    kept = {}
    for family, by_index in candidates.items():
        run = []
        while len(run) in by_index:
            run.append(by_index[len(run)])
        kept[family] = run
    keep_prefixes = {info.prefix for run in kept.values() for info in run}
    for name in shard_files(out_dir):
        if SHARD_FILE.match(name)["prefix"] not in keep_prefixes or name.endswith(".tmp"):
            os.remove(os.path.join(out_dir, name))
    return {family: run for family, run in kept.items() if run}


def remove_shard_files(out_dir: str) -> None:
    """Every shard file of out_dir, complete or not (a failed --strict build leaves none)."""
    for name in shard_files(out_dir):
        os.remove(os.path.join(out_dir, name))
