"""Train a sentencepiece tokenizer on a deterministic sample of a corpus.

    python -m data_tools.train_tokenizer --input DATA... --model-prefix OUT/sp --vocab-size N
        [--model-type bpe|unigram|char] [--sample-docs K] [--seed S]
        [--user-defined-symbols SYM,...] [--normalization identity|nmt_nfkc|...]

Writes OUT/sp.model, OUT/sp.vocab and OUT/sp.json (inputs, documents seen and sampled, vocab,
type, seed, special ids). The sample is a seeded reservoir sample of K documents kept in input
order; their non-blank lines are fed to sentencepiece from an iterator (no temporary file).
Ids: unk 0, bos 1, eos 2 (the end-of-document token of build_shards), pad 3. bpe and unigram
fall back to bytes for unseen characters. The default "identity" normalization keeps the text
verbatim (no NFKC, whitespace kept), so decode(encode(text)) == text.
"""

import argparse
import hashlib
import os
import random
import sys
from collections import Counter
from collections.abc import Iterable, Iterator

import sentencepiece

from data_tools.atomic_json import write_json_atomic
from data_tools.readers import (
    Document,
    InputError,
    Skip,
    add_reader_arguments,
    expand_inputs,
    input_summary,
    iter_documents,
    reader_options_from_args,
)

SPECIAL_IDS = {"unk_id": 0, "bos_id": 1, "eos_id": 2, "pad_id": 3}


def sample_documents(
    records: Iterable[Document | Skip], sample_docs: int, seed: int
) -> tuple[list[str], int, Counter]:
    """A seeded reservoir sample (Algorithm R) of document texts, returned in input order,
    with the number of documents seen and the skipped records by reason."""
    rng = random.Random(seed)
    reservoir: list[tuple[int, str]] = []
    seen, skipped = 0, Counter()
    for record in records:
        if isinstance(record, Skip):
            skipped[record.reason] += 1
            continue
        if len(reservoir) < sample_docs:
            reservoir.append((seen, record.text))
        else:
            slot = rng.randrange(seen + 1)
            if slot < sample_docs:
                reservoir[slot] = (seen, record.text)
        seen += 1
    return [text for _, text in sorted(reservoir)], seen, skipped


def sentences(texts: list[str]) -> Iterator[str]:
    """Non-blank lines: sentencepiece drops 'sentences' longer than max_sentence_length bytes,
    which whole documents often are."""
    for text in texts:
        for line in text.split("\n"):
            if line.strip():
                yield line


def train(args) -> dict:
    files = expand_inputs(args.input)
    records = iter_documents(files, reader_options_from_args(args))
    texts, seen, skipped = sample_documents(records, args.sample_docs, args.seed)
    if not texts:
        raise InputError("no documents to train on")
    directory = os.path.dirname(args.model_prefix)
    if directory:
        os.makedirs(directory, exist_ok=True)
    identity = args.normalization == "identity"
    sentencepiece.set_random_generator_seed(args.seed)
    sentence_count = sum(1 for _ in sentences(texts))
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=sentences(texts),
            model_prefix=args.model_prefix,
            vocab_size=args.vocab_size,
            model_type=args.model_type,
            byte_fallback=args.model_type != "char",
            user_defined_symbols=args.user_defined_symbols,
            normalization_rule_name=args.normalization,
            remove_extra_whitespaces=not identity,
            allow_whitespace_only_pieces=True,
            character_coverage=args.character_coverage,
            num_threads=args.num_threads,
            minloglevel=1,
            **SPECIAL_IDS,
        )
    except RuntimeError as error:  # e.g. "Vocabulary size too high" for a small sample
        raise InputError(f"sentencepiece training failed: {error}") from None
    model_path = args.model_prefix + ".model"
    with open(model_path, "rb") as handle:
        model_sha256 = hashlib.file_digest(handle, "sha256").hexdigest()
    summary = {
        "model": model_path,
        "model_sha256": model_sha256,
        "vocab_size": args.vocab_size,
        "model_type": args.model_type,
        "seed": args.seed,
        "normalization": args.normalization,
        "character_coverage": args.character_coverage,
        "byte_fallback": args.model_type != "char",
        "special_ids": SPECIAL_IDS,
        "user_defined_symbols": args.user_defined_symbols,
        "sample_docs": args.sample_docs,
        "documents_seen": seen,
        "documents_sampled": len(texts),
        "sentences": sentence_count,
        "skipped": dict(skipped),
        "inputs": [input_summary(file) for file in files],
    }
    write_json_atomic(args.model_prefix + ".json", summary)
    print(
        f"train_tokenizer: {args.model_type} vocab {args.vocab_size} from {len(texts):,} of "
        f"{seen:,} documents ({sentence_count:,} lines) -> {model_path}",
        file=sys.stderr,
    )
    return summary


def _symbols(text: str) -> list[str]:
    return [symbol for symbol in text.split(",") if symbol]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m data_tools.train_tokenizer", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--input", nargs="+", required=True,
                        help="files, directories, globs or hf:NAME_OR_PATH")
    parser.add_argument("--model-prefix", required=True, help="writes PREFIX.model/.vocab/.json")
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--model-type", choices=("bpe", "unigram", "char"), default="bpe")
    parser.add_argument("--sample-docs", type=int, default=100_000,
                        help="documents sampled (seeded reservoir) for training")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--user-defined-symbols", type=_symbols, default=[],
                        help="comma-separated pieces always kept whole")
    parser.add_argument("--normalization", default="identity",
                        help="sentencepiece normalization rule (identity keeps text verbatim)")
    parser.add_argument("--character-coverage", type=float, default=0.9995)
    parser.add_argument("--num-threads", type=int, default=os.cpu_count() or 1)
    add_reader_arguments(parser)
    args = parser.parse_args(argv)
    if args.sample_docs < 1:
        parser.error("--sample-docs must be >= 1")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        train(args)
    except InputError as error:
        print(f"train_tokenizer: error: {error}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
