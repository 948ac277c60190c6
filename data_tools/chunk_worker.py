"""What a build's worker process does with one chunk of raw records: parse them (the counting
pass of contiguous splits), or parse, assign a split and tokenize them (the tokenizing pass).
`init_worker` loads the per-process state both need."""

import dataclasses
from collections import Counter

import numpy
import sentencepiece

from data_tools.readers import BadRecord, parse_item
from data_tools.split_plan import SplitPlan

ALL_SOURCES = "all"  # the family source name without --split-by-source


@dataclasses.dataclass(frozen=True)
class WorkerSettings:
    tokenizer_path: str  # absolute path of the sentencepiece model
    text_key: str  # field holding the document text
    file_names: list[str]  # per input file, the name that keys the documents split
    split_plan: SplitPlan
    split_by_source: bool  # family source: the record's source set, else ALL_SOURCES
    dtype: type  # numpy dtype of the token ids
    written_through: dict[tuple[str, str], int]  # family -> ordinal of its last written document


_worker: dict = {}  # per-process state set by init_worker


def init_worker(settings: WorkerSettings) -> None:
    _worker["settings"] = settings
    _worker["tokenizer"] = sentencepiece.SentencePieceProcessor(model_file=settings.tokenizer_path)


def count_chunk(task) -> tuple[int, int | None, list]:
    """Parse only: ("skip", line, reason, detail) or ("doc", source) per record."""
    chunk, _ = task
    settings = _worker["settings"]
    results = []
    for item in chunk.items:
        try:
            _, source, _ = parse_item(item, chunk.fmt, settings.text_key)
        except BadRecord as bad:
            results.append(("skip", item.line, bad.reason, bad.detail))
        else:
            results.append(("doc", source or chunk.default_source))
    return chunk.file_index, chunk.file_bytes_read, results


def tokenize_chunk(task) -> tuple[int, int | None, list]:
    """Per record: ("skip", line, reason, detail), ("written",) for a document already in a
    completed shard, or ("doc", family, tokens + EOD, utf-8 bytes, ordinal)."""
    chunk, source_offsets = task
    settings, tokenizer = _worker["settings"], _worker["tokenizer"]
    file_name = settings.file_names[chunk.file_index]
    eod = tokenizer.eos_id()
    seen_per_source = Counter()
    results = []
    for position, item in enumerate(chunk.items):
        try:
            text, source, size = parse_item(item, chunk.fmt, settings.text_key)
        except BadRecord as bad:
            results.append(("skip", item.line, bad.reason, bad.detail))
            continue
        source = source or chunk.default_source
        index_in_source = seen_per_source[source]
        if source_offsets is not None:
            index_in_source += source_offsets.get(source, 0)
        seen_per_source[source] += 1
        split = settings.split_plan.split_of(file_name, item.line, source, index_in_source)
        family = (source if settings.split_by_source else ALL_SOURCES, split)
        ordinal = chunk.first_ordinal + position
        if ordinal <= settings.written_through.get(family, -1):
            results.append(("written",))
            continue
        tokens = numpy.array(tokenizer.encode(text) + [eod], dtype=settings.dtype)
        results.append(("doc", family, tokens, size, ordinal))
    return chunk.file_index, chunk.file_bytes_read, results
