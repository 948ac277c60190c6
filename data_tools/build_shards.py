"""Tokenize a corpus into megatron-core indexed datasets, one family per (source, split).

    python -m data_tools.build_shards --input DATA... --tokenizer OUT/sp.model --output-dir OUT
        [--workers N] [--split-by-source] [--split train=0.98,valid=0.01,test=0.01]
        [--split-mode documents|contiguous] [--max-shard-tokens T] [--strict] [--weights SRC=W,...]

Output (OUT/):
    {source}-{split}-{NNNNN}.bin/.idx  megatron-core IndexedDataset shards, each document
                                        followed by the tokenizer's eos id (EOD)
    {prefix}.done.json                  a shard's counts and checksums, written after its rename
    manifest.json                       written last; identical when the same command is rerun
    build_stats.json                    timings and throughput of the last run

Records are numbered in input order (their ordinal). A shard holds a consecutive run of one
family's documents and is closed when the next document would take it past
--max-shard-tokens, so shard contents depend only on the inputs and options. A rerun keeps the
completed shards of each family (those with a matching .done.json), remembers the ordinal of
their last document, and lets the workers skip tokenizing everything up to it.
"""

import argparse
import contextlib
import dataclasses
import hashlib
import json
import multiprocessing
import os
import sys
import threading
import time
from collections import Counter, defaultdict

import numpy
import sentencepiece
from tqdm import tqdm

from data_tools.manifest import MANIFEST_NAME, SPLITS, write_json_atomic
from data_tools.readers import (
    BadRecord,
    DataError,
    InputError,
    InputFile,
    add_reader_arguments,
    expand_inputs,
    input_summary,
    iter_chunks,
    parse_item,
    reader_options_from_args,
)
from data_tools.shard_writer import (
    Families,
    ShardInfo,
    completed_shards,
    remove_shard_files,
    sha256_file,
    token_dtype,
)

ALL_SOURCES = "all"  # the family source name without --split-by-source
STATS_NAME = "build_stats.json"
MAX_SKIP_EXAMPLES = 5
# options that change shard contents; a rerun reuses shards only if these are unchanged
CONTENT_OPTIONS = (
    "text_key",
    "txt_mode",
    "source_name",
    "hf_split",
    "hf_config",
    "split",
    "split_mode",
    "split_by_source",
    "max_shard_tokens",
    "seed",
)


def bad_record_error(path: str, line: int, reason: str, detail: str) -> DataError:
    return DataError(f"{path}:{line}: {reason}: {detail}")


# ---------------------------------------------------------------------------- splits


@dataclasses.dataclass(frozen=True)
class SplitPlan:
    fractions: tuple[float, float, float] | None  # train/valid/test; None: everything is train
    mode: str  # documents: hash of (file name, line); contiguous: by position within the source
    seed: int
    cuts: dict[str, tuple[int, int]] | None = None  # contiguous: first valid, first test index

    def split_of(self, file_name: str, line: int, source: str, index_in_source: int) -> str:
        if self.fractions is None:
            return "train"
        if self.mode == "documents":
            key = f"{self.seed}:{file_name}:{line}".encode()
            position = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
            first_valid = round(self.fractions[0] * 2**64)
            first_test = round((self.fractions[0] + self.fractions[1]) * 2**64)
        else:
            first_valid, first_test = self.cuts[source]
            position = index_in_source
        if position < first_valid:
            return "train"
        return "valid" if position < first_test else "test"

    def with_cuts(self, documents_per_source: dict[str, int]) -> "SplitPlan":
        """Contiguous cuts: first X% of each source's documents train, next valid, rest test."""
        train, valid, _ = self.fractions
        cuts = {
            source: (round(count * train), round(count * (train + valid)))
            for source, count in documents_per_source.items()
        }
        return SplitPlan(self.fractions, self.mode, self.seed, cuts)


def parse_split(text: str | None) -> tuple[float, float, float] | None:
    """"train=0.98,valid=0.01,test=0.01" -> normalized (train, valid, test) fractions."""
    if not text:
        return None
    shares = dict.fromkeys(SPLITS, 0.0)
    for part in text.split(","):
        name, _, value = part.partition("=")
        if name.strip() not in shares or not value:
            raise argparse.ArgumentTypeError(f"--split: expected {'|'.join(SPLITS)}=FRACTION")
        shares[name.strip()] = float(value)
    total = sum(shares.values())
    if total <= 0 or min(shares.values()) < 0:
        raise argparse.ArgumentTypeError("--split: fractions must be >= 0 with a positive sum")
    return tuple(shares[name] / total for name in SPLITS)


def parse_weights(text: str | None) -> dict[str, float] | None:
    """"RedPajamaC4=0.3,RedPajamaGithub=0.7" -> {source: weight}."""
    if not text:
        return None
    weights = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        if not name or not value or float(value) < 0:
            raise argparse.ArgumentTypeError("--weights: expected SOURCE=WEIGHT,... (weights >= 0)")
        weights[name.strip()] = float(value)
    return weights


# ---------------------------------------------------------------------------- workers


@dataclasses.dataclass(frozen=True)
class WorkerSettings:
    tokenizer_path: str
    text_key: str
    file_names: list[str]
    split_plan: SplitPlan
    split_by_source: bool
    dtype: type
    written_through: dict[tuple[str, str], int]  # family -> ordinal of its last written document


_worker: dict = {}  # per-process state set by _init_worker


def _init_worker(settings: WorkerSettings) -> None:
    _worker["settings"] = settings
    _worker["tokenizer"] = sentencepiece.SentencePieceProcessor(model_file=settings.tokenizer_path)


def _count_chunk(task) -> tuple[int, int | None, list]:
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


def _tokenize_chunk(task) -> tuple[int, int | None, list]:
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


class _BoundedFeed:
    """An iterable for Pool.imap that lets it read at most `limit` tasks ahead of the consumer
    (imap's task thread otherwise pulls the whole input into memory)."""

    def __init__(self, tasks, limit: int):
        self._tasks = tasks
        self._slots = threading.Semaphore(limit)
        self._stopped = threading.Event()

    def __iter__(self):
        for task in self._tasks:
            while not self._slots.acquire(timeout=0.1):
                if self._stopped.is_set():
                    return
            if self._stopped.is_set():
                return
            yield task

    def consumed(self) -> None:
        self._slots.release()

    def stop(self) -> None:
        self._stopped.set()


def _ordered_results(worker_fn, tasks, workers: int, settings: WorkerSettings):
    """worker_fn over tasks, results in task order: in this process for one worker, else in a
    process pool with bounded read-ahead."""
    if workers == 1:
        _init_worker(settings)
        yield from map(worker_fn, tasks)
        return
    feed = _BoundedFeed(tasks, limit=4 * workers)
    with multiprocessing.Pool(workers, initializer=_init_worker, initargs=(settings,)) as pool:
        try:
            for result in pool.imap(worker_fn, feed):
                yield result
                feed.consumed()
        finally:
            feed.stop()


# ---------------------------------------------------------------------------- shards


# ---------------------------------------------------------------------------- bookkeeping


class SkipLog:
    """Skipped records by reason and file, with a few file:line examples; raises under strict."""

    def __init__(self, strict: bool, report):
        self.strict = strict
        self.report = report
        self.by_reason = Counter()
        self.by_file = defaultdict(Counter)
        self.examples = defaultdict(list)

    def add(self, path: str, line: int, reason: str, detail: str) -> None:
        if self.strict:
            raise bad_record_error(path, line, reason, detail)
        where = f"{path}:{line}"
        self.by_reason[reason] += 1
        self.by_file[path][reason] += 1
        if len(self.examples[reason]) < MAX_SKIP_EXAMPLES:
            self.examples[reason].append(f"{where}: {detail}")
            self.report(f"skipped {reason} at {where}: {detail}")

    def summary(self) -> dict:
        return {
            "total": sum(self.by_reason.values()),
            "by_reason": dict(self.by_reason),
            "by_file": {path: dict(reasons) for path, reasons in self.by_file.items()},
            "examples": dict(self.examples),
        }


class Progress:
    """A tqdm bar over input bytes (rate and ETA) with docs/s, text MB/s and tokens/s."""

    def __init__(self, files: list[InputFile], description: str, enabled: bool):
        sizes = [file.size for file in files]
        self._offsets = [0]
        for size in sizes:
            self._offsets.append(self._offsets[-1] + (size or 0))
        total = None if None in sizes else self._offsets[-1]
        self._bar = tqdm(
            total=total, unit="B", unit_scale=True, desc=description, disable=not enabled,
            file=sys.stderr, dynamic_ncols=True,
        )
        self.start = time.perf_counter()
        self._last_postfix = 0.0
        self.documents = self.tokens = self.text_bytes = 0

    def write(self, message: str) -> None:
        tqdm.write(message, file=sys.stderr)

    def advance(self, file_index: int, file_bytes_read: int | None) -> None:
        if file_bytes_read is not None:
            self._bar.update(self._offsets[file_index] + file_bytes_read - self._bar.n)
        now = time.perf_counter()
        if now - self._last_postfix >= 1.0:
            self._last_postfix = now
            self._bar.set_postfix_str(self.rates(), refresh=False)

    def rates(self) -> str:
        seconds = max(time.perf_counter() - self.start, 1e-9)
        return (
            f"{self.documents / seconds:,.0f} docs/s, {self.text_bytes / seconds / 1e6:.2f} MB/s, "
            f"{self.tokens / seconds:,.0f} tokens/s"
        )

    def close(self) -> None:
        self._bar.close()


# ---------------------------------------------------------------------------- build


def _build_key(args, files: list[InputFile], tokenizer_sha256: str) -> str:
    content = {
        "inputs": [(file.path, file.size) for file in files],
        "tokenizer_sha256": tokenizer_sha256,
        "options": {name: getattr(args, name) for name in CONTENT_OPTIONS},
    }
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def _count_documents_per_source(args, files, settings, strict) -> tuple[dict, list]:
    """The counting pass of contiguous splits: valid documents per source, and per chunk the
    documents of each source in earlier chunks (so that workers can number documents within
    their source without seeing the rest of the stream)."""
    totals = Counter()
    offsets_per_chunk = []
    tasks = ((chunk, None) for chunk in iter_chunks(files, reader_options_from_args(args)))
    results = _ordered_results(_count_chunk, tasks, args.workers, settings)
    progress = Progress(files, "count", not args.quiet)
    with contextlib.closing(results), contextlib.closing(progress):
        for file_index, file_bytes_read, records in results:
            offsets_per_chunk.append(dict(totals))
            for record in records:
                if record[0] == "doc":
                    totals[record[1]] += 1
                elif strict:
                    raise bad_record_error(files[file_index].path, *record[1:])
            progress.advance(file_index, file_bytes_read)
    return dict(totals), offsets_per_chunk


def _blend(shards: list[ShardInfo], user_weights: dict[str, float] | None) -> dict:
    """Per split: prefixes and weights (token share, or the user's per-source weights shared
    among a source's shards by tokens), summing to 1."""
    blend = {}
    for split in SPLITS:
        in_split = [info for info in shards if info.split == split and info.tokens > 0]
        if not in_split:
            continue
        source_tokens = Counter()
        for info in in_split:
            source_tokens[info.source] += info.tokens
        if user_weights is None:
            source_weight = dict(source_tokens)
        else:
            source_weight = {source: user_weights[source] for source in source_tokens}
        total_weight = sum(source_weight.values())
        if total_weight <= 0:
            raise DataError(f"--weights gives the {split} split a total weight of 0")
        blend[split] = {
            "prefixes": [info.prefix for info in in_split],
            "weights": [
                source_weight[info.source] / total_weight * info.tokens / source_tokens[info.source]
                for info in in_split
            ],
        }
    return blend


def _check_weights(user_weights, shards: list[ShardInfo]) -> None:
    sources = sorted({info.source for info in shards})
    missing = [source for source in sources if source not in user_weights]
    unknown = sorted(set(user_weights) - set(sources))
    if missing or unknown:
        raise DataError(
            f"--weights must name exactly the built sources {sources}; "
            f"missing {missing}, unknown {unknown}"
        )


def _manifest(args, files, tokenizer, shards, skip_log, blend) -> dict:
    documents = sum(info.documents for info in shards)
    return {
        "format": "ora-data-manifest/1",
        "options": vars(args),
        "tokenizer": tokenizer,
        "inputs": [input_summary(file) for file in files],
        "datasets": [
            {
                key: value
                for key, value in dataclasses.asdict(info).items()
                if key not in ("build_key", "first_ordinal", "last_ordinal")
            }
            for info in shards
        ],
        "blend": blend,
        "totals": {
            "records": documents + skip_log.summary()["total"],
            "documents": documents,
            "tokens": sum(info.tokens for info in shards),
            "text_bytes": sum(info.text_bytes for info in shards),
            "shards": len(shards),
        },
        "skipped": skip_log.summary(),
    }


def _tokenizer_summary(path: str) -> dict:
    if not os.path.isfile(path):
        raise InputError(f"{path}: no such tokenizer model")
    tokenizer = sentencepiece.SentencePieceProcessor(model_file=path)
    if tokenizer.eos_id() < 0:
        raise DataError(f"{path}: the tokenizer has no eos piece to use as end-of-document")
    vocab_size = tokenizer.vocab_size()
    return {
        "path": os.path.abspath(path),
        "sha256": sha256_file(path),
        "vocab_size": vocab_size,
        "eod_id": tokenizer.eos_id(),
        "dtype": token_dtype(vocab_size).__name__,
    }


def _write_shards(args, files, settings, families, offsets_per_chunk):
    """The tokenizing pass: route each document to its family's writer, in input order."""
    chunks = iter_chunks(files, reader_options_from_args(args))
    tasks = zip(chunks, offsets_per_chunk) if offsets_per_chunk else ((c, None) for c in chunks)
    results = _ordered_results(_tokenize_chunk, tasks, args.workers, settings)
    progress = Progress(files, "tokenize", not args.quiet)
    skip_log = SkipLog(args.strict, progress.write)
    with contextlib.closing(results), contextlib.closing(progress):
        for file_index, file_bytes_read, records in results:
            for record in records:
                if record[0] == "doc":
                    _, family, tokens, text_bytes, ordinal = record
                    families.add(family, tokens, text_bytes, ordinal)
                    progress.documents += 1
                    progress.tokens += len(tokens)
                    progress.text_bytes += text_bytes
                elif record[0] == "skip":
                    skip_log.add(files[file_index].path, *record[1:])
            progress.advance(file_index, file_bytes_read)
    families.close()
    return progress, skip_log


def _write_outputs(args, files, tokenizer, shards, skip_log, stats) -> dict:
    """build_stats.json, then manifest.json: the manifest's presence marks a finished build."""
    if args.weights is not None:
        _check_weights(args.weights, shards)
    manifest = _manifest(args, files, tokenizer, shards, skip_log, _blend(shards, args.weights))
    write_json_atomic(os.path.join(args.output_dir, STATS_NAME), stats)
    write_json_atomic(os.path.join(args.output_dir, MANIFEST_NAME), manifest)
    return manifest


def build(args) -> dict:
    """Run the build described by parsed arguments; return this run's throughput stats."""
    started = time.perf_counter()
    files = expand_inputs(args.input)
    tokenizer = _tokenizer_summary(args.tokenizer)
    os.makedirs(args.output_dir, exist_ok=True)
    build_key = _build_key(args, files, tokenizer["sha256"])
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(args.output_dir, MANIFEST_NAME))
    completed = completed_shards(args.output_dir, build_key)
    dtype = getattr(numpy, tokenizer["dtype"])
    settings = WorkerSettings(
        tokenizer_path=os.path.abspath(args.tokenizer),
        text_key=args.text_key,
        file_names=[file.name for file in files],
        split_plan=SplitPlan(args.split, args.split_mode, args.seed),
        split_by_source=args.split_by_source,
        dtype=dtype,
        written_through={family: run[-1].last_ordinal for family, run in completed.items()},
    )
    families = Families(args.output_dir, dtype, args.max_shard_tokens, build_key, completed)
    try:
        offsets_per_chunk = None
        if args.split and args.split_mode == "contiguous":
            per_source, offsets_per_chunk = _count_documents_per_source(
                args, files, settings, args.strict
            )
            settings = dataclasses.replace(
                settings, split_plan=settings.split_plan.with_cuts(per_source)
            )
        progress, skip_log = _write_shards(args, files, settings, families, offsets_per_chunk)
    except BaseException:
        families.abandon()
        if args.strict:  # a strict build that fails leaves no shard behind
            remove_shard_files(args.output_dir)
        raise
    stats = {
        "seconds": time.perf_counter() - started,
        "documents_tokenized": progress.documents,
        "tokens_tokenized": progress.tokens,
        "text_bytes_tokenized": progress.text_bytes,
        "input_bytes": sum(file.size or 0 for file in files),
        "shards_reused": sum(len(run) for run in completed.values()),
        "workers": args.workers,
    }
    manifest = _write_outputs(args, files, tokenizer, families.shards(), skip_log, stats)
    totals = manifest["totals"]
    print(
        f"build_shards: {totals['documents']:,} documents, {totals['tokens']:,} tokens in "
        f"{totals['shards']} shards, {manifest['skipped']['total']:,} records skipped, "
        f"{stats['shards_reused']} shards reused; {stats['seconds']:.1f} s "
        f"({progress.rates()}) -> {os.path.join(args.output_dir, MANIFEST_NAME)}",
        file=sys.stderr,
    )
    return stats


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m data_tools.build_shards", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--input", nargs="+", required=True,
                        help="files, directories, globs or hf:NAME_OR_PATH, read in order")
    parser.add_argument("--tokenizer", required=True, help="sentencepiece .model")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                        help="tokenizer processes (default: the CPUs this process may use)")
    parser.add_argument("--split-by-source", action="store_true",
                        help="one dataset family per source set (meta.redpajama_set_name)")
    parser.add_argument("--split", type=parse_split, default=None,
                        help="e.g. train=0.98,valid=0.01,test=0.01 (default: all train)")
    parser.add_argument("--split-mode", choices=("documents", "contiguous"), default="documents",
                        help="documents: seeded hash of file:line; contiguous: first X%% of each "
                        "source's documents train, next valid, last test (reads the input twice)")
    parser.add_argument("--seed", type=int, default=1234, help="seed of the document split")
    parser.add_argument("--max-shard-tokens", type=int, default=1_000_000_000)
    parser.add_argument("--strict", action="store_true",
                        help="stop at the first bad record (file:line), leaving no output")
    parser.add_argument("--weights", type=parse_weights, default=None,
                        help="blend weights per source, SRC=W,... (default: token share); "
                        "needs --split-by-source")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    add_reader_arguments(parser)
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be >= 1")
    if args.max_shard_tokens < 1:
        parser.error("--max-shard-tokens must be >= 1")
    if args.weights is not None and not args.split_by_source:
        parser.error("--weights needs --split-by-source")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        build(args)
    except (DataError, InputError) as error:
        print(f"build_shards: error: {error}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
