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

As a library: `build(BuildOptions(input=[...], tokenizer=..., output_dir=...))`
(data_tools.build_options); `parse_args` and `main` are the command line over it.
"""

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import sys
import time
from collections import Counter

import numpy
import sentencepiece

from data_tools.atomic_json import write_json_atomic
from data_tools.build_options import CONTENT_OPTIONS, BuildOptionError, BuildOptions
from data_tools.chunk_worker import WorkerSettings, count_chunk, init_worker, tokenize_chunk
from data_tools.manifest import MANIFEST_NAME, assemble_manifest, blend_weights
from data_tools.progress import Progress
from data_tools.readers import (
    DataError,
    InputError,
    InputFile,
    add_reader_arguments,
    expand_inputs,
    iter_chunks,
    reader_options_from_args,
)
from data_tools.shard_writer import (
    Families,
    completed_shards,
    remove_shard_files,
    sha256_file,
    token_dtype,
)
from data_tools.skip_log import SkipLog, bad_record_error
from data_tools.split_plan import SPLIT_MODES, SplitPlan, parse_split
from data_tools.worker_pool import ordered_results

STATS_NAME = "build_stats.json"


def _build_key(options: BuildOptions, files: list[InputFile], tokenizer_sha256: str) -> str:
    content = {
        "inputs": [(file.path, file.size) for file in files],
        "tokenizer_sha256": tokenizer_sha256,
        "options": {name: getattr(options, name) for name in CONTENT_OPTIONS},
    }
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def tokenizer_summary(path: str) -> dict:
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


def _worker_settings(options, files, dtype, completed) -> WorkerSettings:
    return WorkerSettings(
        tokenizer_path=os.path.abspath(options.tokenizer),
        text_key=options.text_key,
        file_names=[file.name for file in files],
        split_plan=SplitPlan(options.split, options.split_mode, options.seed),
        split_by_source=options.split_by_source,
        dtype=dtype,
        written_through={family: run[-1].last_ordinal for family, run in completed.items()},
    )


def _count_documents_per_source(options, files, settings) -> tuple[dict, list]:
    """The counting pass of contiguous splits: valid documents per source, and per chunk the
    documents of each source in earlier chunks (so that workers can number documents within
    their source without seeing the rest of the stream)."""
    totals = Counter()
    offsets_per_chunk = []
    tasks = ((chunk, None) for chunk in iter_chunks(files, reader_options_from_args(options)))
    results = ordered_results(count_chunk, tasks, options.workers, init_worker, (settings,))
    progress = Progress(files, "count", not options.quiet)
    with contextlib.closing(results), contextlib.closing(progress):
        for file_index, file_bytes_read, records in results:
            offsets_per_chunk.append(dict(totals))
            for record in records:
                if record[0] == "doc":
                    totals[record[1]] += 1
                elif options.strict:
                    raise bad_record_error(files[file_index].path, *record[1:])
            progress.advance(file_index, file_bytes_read)
    return dict(totals), offsets_per_chunk


def _write_shards(options, files, settings, families, offsets_per_chunk):
    """The tokenizing pass: route each document to its family's writer, in input order."""
    chunks = iter_chunks(files, reader_options_from_args(options))
    tasks = zip(chunks, offsets_per_chunk) if offsets_per_chunk else ((c, None) for c in chunks)
    results = ordered_results(tokenize_chunk, tasks, options.workers, init_worker, (settings,))
    progress = Progress(files, "tokenize", not options.quiet)
    skip_log = SkipLog(options.strict, progress.write)
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


def _tokenize_passes(options, files, settings, families):
    """The counting pass (contiguous splits only), then the tokenizing pass. On failure the
    unfinished shards are abandoned, and a strict build removes every shard file."""
    try:
        offsets_per_chunk = None
        if options.split and options.split_mode == "contiguous":
            per_source, offsets_per_chunk = _count_documents_per_source(options, files, settings)
            settings = dataclasses.replace(
                settings, split_plan=settings.split_plan.with_cuts(per_source)
            )
        return _write_shards(options, files, settings, families, offsets_per_chunk)
    except BaseException:
        families.abandon()
        if options.strict:  # a strict build that fails leaves no shard behind
            remove_shard_files(options.output_dir)
        raise


def _write_outputs(options, files, tokenizer, shards, skip_log, stats) -> dict:
    """build_stats.json, then manifest.json: the manifest's presence marks a finished build."""
    blend = blend_weights(shards, options.weights)
    manifest = assemble_manifest(
        dataclasses.asdict(options), tokenizer, files, shards, skip_log.summary(), blend
    )
    write_json_atomic(os.path.join(options.output_dir, STATS_NAME), stats)
    write_json_atomic(os.path.join(options.output_dir, MANIFEST_NAME), manifest)
    return manifest


def _print_summary(manifest: dict, stats: dict, rates: str, output_dir: str) -> None:
    totals = manifest["totals"]
    print(
        f"build_shards: {totals['documents']:,} documents, {totals['tokens']:,} tokens in "
        f"{totals['shards']} shards, {manifest['skipped']['total']:,} records skipped, "
        f"{stats['shards_reused']} shards reused; {stats['seconds']:.1f} s "
        f"({rates}) -> {os.path.join(output_dir, MANIFEST_NAME)}",
        file=sys.stderr,
    )


def build(options: BuildOptions) -> dict:
    """Run the build `options` describe; return this run's throughput stats."""
    started = time.perf_counter()
    files = expand_inputs(options.input)
    tokenizer = tokenizer_summary(options.tokenizer)
    os.makedirs(options.output_dir, exist_ok=True)
    build_key = _build_key(options, files, tokenizer["sha256"])
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(options.output_dir, MANIFEST_NAME))
    completed = completed_shards(options.output_dir, build_key)
    dtype = getattr(numpy, tokenizer["dtype"])
    settings = _worker_settings(options, files, dtype, completed)
    families = Families(options.output_dir, dtype, options.max_shard_tokens, build_key, completed)
    progress, skip_log = _tokenize_passes(options, files, settings, families)
    stats = {
        "seconds": time.perf_counter() - started,
        "documents_tokenized": progress.documents,
        "tokens_tokenized": progress.tokens,
        "text_bytes_tokenized": progress.text_bytes,
        "input_bytes": sum(file.size or 0 for file in files),
        "shards_reused": sum(len(run) for run in completed.values()),
        "workers": options.workers,
    }
    manifest = _write_outputs(options, files, tokenizer, families.shards(), skip_log, stats)
    _print_summary(manifest, stats, progress.rates(), options.output_dir)
    return stats


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


def parse_args(argv=None) -> BuildOptions:
    # options left out of the command line are left out of the namespace: BuildOptions' defaults
    parser = argparse.ArgumentParser(
        prog="python -m data_tools.build_shards", description=__doc__.split("\n\n")[0],
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--input", nargs="+", required=True,
                        help="files, directories, globs or hf:NAME_OR_PATH, read in order")
    parser.add_argument("--tokenizer", required=True, help="sentencepiece .model")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--workers", type=int,
                        help="tokenizer processes (default: the CPUs this process may use)")
    parser.add_argument("--split-by-source", action="store_true",
                        help="one dataset family per source set (meta.redpajama_set_name)")
    parser.add_argument("--split", type=parse_split,
                        help="e.g. train=0.98,valid=0.01,test=0.01 (default: all train)")
    parser.add_argument("--split-mode", choices=SPLIT_MODES,
                        help="documents: seeded hash of file:line; contiguous: first X%% of each "
                        "source's documents train, next valid, last test (reads the input twice)")
    parser.add_argument("--seed", type=int, help="seed of the document split")
    parser.add_argument("--max-shard-tokens", type=int)
    parser.add_argument("--strict", action="store_true",
                        help="stop at the first bad record (file:line), leaving no output")
    parser.add_argument("--weights", type=parse_weights,
                        help="blend weights per source, SRC=W,... (default: token share); "
                        "needs --split-by-source")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    add_reader_arguments(parser)
    try:
        return BuildOptions(**vars(parser.parse_args(argv)))
    except BuildOptionError as error:
        parser.error(str(error))


def main(argv=None) -> None:
    options = parse_args(argv)
    try:
        build(options)
    except (DataError, InputError) as error:
        print(f"build_shards: error: {error}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
