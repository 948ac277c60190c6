"""Synthetic probe tasks for causal LMs, written as megatron-core indexed shards with a manifest.

    python -m data_tools.probe_tasks --task copy|associative_recall|sort|long_range_retrieval --out DIR
        [--examples N] [--eval-examples N] [--seq-length L] [--vocab V] [--seed S]
        [--length N] [--pairs P] [--queries Q] [--min-distance D]

Each task's answer has to be fetched from wherever its content sits in the context (routing by
content, which frozen Q/K make hardest). Examples are drawn offline with numpy's generator from
(seed, split); token ids are written directly, nothing is tokenized. Ids: 0 <unk> (unused),
1 <s> (starts every example), 2 </s> (EOD, ends every example), 3 <pad>, 4 <sep>, 5 <query>, and
6..V-1 the symbols (they decode as the numbers 0..V-7). One example is one document of exactly
L = --seq-length tokens; <pad>s fill what the task leaves before the final </s>:

    copy                  <s> x1..xn <sep> x1..xn <pad>.. </s>          answers: the copy of x
    sort                  <s> x1..xn <sep> sorted(x) <pad>.. </s>       answers: x sorted by id
    associative_recall    <s> k1 v1 .. kp vp <sep> q1 a1 .. qm am <pad>.. </s>
                          m distinct stored keys queried in random order; answers: a_j, q_j's value
    long_range_retrieval  <s> filler, with p pairs k v within its first part, <query> q1 a1 .. qm am </s>
                          m distinct stored keys queried; answers: a_j, q_j's value, each at least
                          D tokens after its key

Keys, values and filler come from disjoint thirds (retrieval) or halves (recall, keys and values)
of the symbols, so a key occurs once per example. Every example of a task has its answers at the
same positions: the manifest's "probe" section records them (`answer_positions`, document token
positions: the model predicts position p from the tokens before it), with the rule that defines
them, the task's parameters and its chance level (uniform guessing over the answer alphabet).

How training cuts these documents: megatron-core's GPTDataset concatenates the (shuffled)
documents and gives sample i the stream's tokens [i·L, (i+1)·L] (L + 1 tokens: the inputs, and
the labels shifted by one). With every document exactly L tokens long, the inputs of every sample
are exactly one example and its labels that example shifted by one, plus the next example's <s>,
so no answer moves (a document of L + 1 tokens would shift each sample one token further than the
last). Train with model.seq_length = L. megatron-core feeds <pad> inputs as id 0 and leaves <pad>
labels out of the loss; every <pad> comes after the last answer, so none reaches an answer's
prediction. Documents and samples are shuffled, so sample k is not example k: evaluations read the
examples back by document index (`read_examples`). tests/unit/data_tools/test_probe_tasks.py checks
this alignment through the training side's own dataset builder.

Output (DIR/): `{task}-{split}-00000.bin/.idx` (train, valid, test; written by shard_writer, as
.tmp files renamed when complete), `tokenizer.model` (a sentencepiece model assembled piece by
piece, since the training side reads the tokenizer the manifest names), and `manifest.json`
(build_shards' format plus the "probe" section), written last. Shard files already in DIR are
replaced.
"""

import abc
import argparse
import dataclasses
import hashlib
import json
import os
import sys

import numpy
from sentencepiece import sentencepiece_model_pb2

from data_tools.atomic_json import write_json_atomic
from data_tools.build_options import BuildOptions
from data_tools.build_shards import tokenizer_summary
from data_tools.manifest import MANIFEST_NAME, SPLITS, assemble_manifest, blend_from_manifest, blend_weights
from data_tools.readers import DataError
from data_tools.shard_writer import Families, remove_shard_files, token_dtype
from data_tools.skip_log import SkipLog

UNK, BOS, EOD, PAD, SEP, QUERY = range(6)
SPECIAL_PIECES = ("<unk>", "<s>", "</s>", "<pad>", "<sep>", "<query>")
FIRST_SYMBOL = len(SPECIAL_PIECES)
TOKENIZER_NAME = "tokenizer.model"
TASKS = ("copy", "associative_recall", "sort", "long_range_retrieval")
# the options each task takes beyond the common ones
TASK_OPTIONS = {
    "copy": ("length",),
    "sort": ("length",),
    "associative_recall": ("pairs", "queries"),
    "long_range_retrieval": ("pairs", "queries", "min_distance"),
}


class ProbeOptionError(ValueError):
    """An option value the generator cannot run with; the message names the option."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclasses.dataclass(frozen=True)
class ProbeOptions:
    task: str  # one of TASKS
    out: str  # output directory
    examples: int = 20_000  # training examples
    eval_examples: int = 1_000  # examples of the valid split and of the test split, each
    seq_length: int = 32  # tokens per example: the model's seq_length
    vocab: int = 24  # vocabulary size: 6 special ids and vocab - 6 symbols
    seed: int = 1234  # examples are drawn from numpy's generator seeded with (seed, split)
    length: int | None = None  # copy, sort: string length (default 8)
    pairs: int | None = None  # associative_recall (default 6), long_range_retrieval (default 4): key-value pairs
    queries: int | None = None  # keys queried: associative_recall (default all pairs), long_range_retrieval (3)
    min_distance: int | None = None  # long_range_retrieval: key to answer; default: half of seq_length

    def __post_init__(self):
        if self.task not in TASKS:
            raise ProbeOptionError(f"--task must be one of {', '.join(TASKS)}, got {self.task!r}")
        for name in ("examples", "eval_examples", "seq_length", "vocab"):
            if getattr(self, name) < 1:
                raise ProbeOptionError(f"{_flag(name)} must be >= 1")
        if self.vocab < FIRST_SYMBOL + 2:
            raise ProbeOptionError(f"--vocab must be >= {FIRST_SYMBOL + 2} ({FIRST_SYMBOL} special ids, 2+ symbols)")
        for name in ("length", "pairs", "queries", "min_distance"):
            value = getattr(self, name)
            if value is not None and name not in TASK_OPTIONS[self.task]:
                raise ProbeOptionError(f"{_flag(name)} does not apply to --task {self.task}")
            if value is not None and value < 1:
                raise ProbeOptionError(f"{_flag(name)} must be >= 1")
        task_for(self)  # each task checks that its parameters fit seq_length and vocab


# ---------------------------------------------------------------------------------------- tasks
@dataclasses.dataclass(frozen=True)
class ProbeTask(abc.ABC):
    """A task's fixed layout: what the manifest records about it, and its examples."""

    seq_length: int
    vocab: int

    name = ""
    layout = ""
    answer_rule = ""

    @property
    def symbols(self) -> int:
        return self.vocab - FIRST_SYMBOL

    def parameters(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("seq_length", "vocab")}

    @abc.abstractmethod
    def answer_positions(self) -> list[int]:
        """The positions of every example that hold an answer token."""

    @abc.abstractmethod
    def answer_alphabet(self) -> tuple[int, int]:
        """The ids [first, end) an answer token is drawn from."""

    @abc.abstractmethod
    def generate(self, rng: numpy.random.Generator, count: int) -> numpy.ndarray:
        """[count, seq_length] token ids."""

    def _frame(self, count: int) -> numpy.ndarray:
        documents = numpy.full((count, self.seq_length), PAD, dtype=numpy.int64)
        documents[:, 0] = BOS
        documents[:, -1] = EOD
        return documents

    def describe(self) -> dict:
        first, end = self.answer_alphabet()
        positions = self.answer_positions()
        return {
            "task": self.name,
            "seq_length": self.seq_length,
            "vocab_size": self.vocab,
            "parameters": self.parameters(),
            "special_ids": dict(zip(("unk", "bos", "eod", "pad", "sep", "query"), range(FIRST_SYMBOL))),
            "symbols": [FIRST_SYMBOL, self.vocab],
            "layout": self.layout,
            "answer_rule": self.answer_rule,
            "answer_positions": positions,
            "answer_alphabet": [first, end],
            "chance_token_accuracy": 1.0 / (end - first),
            "chance_accuracy": (1.0 / (end - first)) ** len(positions),
        }


@dataclasses.dataclass(frozen=True)
class CopyTask(ProbeTask):
    length: int

    name = "copy"
    layout = "<s> x1..xn <sep> x1..xn <pad>.. </s>"
    answer_rule = "the n tokens after <sep>: a copy of x1..xn"

    def __post_init__(self):
        if 2 * self.length + 3 > self.seq_length:
            raise ProbeOptionError(f"--length {self.length}: 2·length + 3 tokens do not fit "
                                   f"--seq-length {self.seq_length}")

    def answer_positions(self) -> list[int]:
        return list(range(self.length + 2, 2 * self.length + 2))

    def answer_alphabet(self) -> tuple[int, int]:
        return FIRST_SYMBOL, self.vocab

    def answers(self, string: numpy.ndarray) -> numpy.ndarray:
        return string

    def generate(self, rng, count):
        documents = self._frame(count)
        string = rng.integers(FIRST_SYMBOL, self.vocab, (count, self.length))
        documents[:, 1:self.length + 1] = string
        documents[:, self.length + 1] = SEP
        documents[:, self.answer_positions()] = self.answers(string)
        return documents


@dataclasses.dataclass(frozen=True)
class SortTask(CopyTask):
    name = "sort"
    layout = "<s> x1..xn <sep> sorted(x) <pad>.. </s>"
    answer_rule = "the n tokens after <sep>: x1..xn sorted by id, ascending"

    def answers(self, string):
        return numpy.sort(string, axis=1)


def _distinct(rng: numpy.random.Generator, count: int, population: int, size: int) -> numpy.ndarray:
    """[count, size] distinct draws from range(population) per row, in random order."""
    return numpy.argsort(rng.random((count, population)), axis=1)[:, :size]


@dataclasses.dataclass(frozen=True)
class AssociativeRecallTask(ProbeTask):
    pairs: int
    queries: int

    name = "associative_recall"
    layout = "<s> k1 v1 .. kp vp <sep> q1 a1 .. qm am <pad>.. </s>"
    answer_rule = "every second token after <sep>, from the second on: a_j, the value stored with key q_j"

    def __post_init__(self):
        if self.pairs > self.key_count:
            raise ProbeOptionError(f"--pairs {self.pairs}: keys are distinct and --vocab {self.vocab} gives "
                                   f"{self.key_count} key symbols")
        if self.queries > self.pairs:
            raise ProbeOptionError(f"--queries {self.queries} exceeds --pairs {self.pairs} (distinct keys are queried)")
        if 2 * self.pairs + 2 * self.queries + 3 > self.seq_length:
            raise ProbeOptionError(f"--pairs {self.pairs} with --queries {self.queries}: 2·pairs + 2·queries + 3 "
                                   f"tokens do not fit --seq-length {self.seq_length}")

    @property
    def key_count(self) -> int:
        return self.symbols // 2  # keys: the first half of the symbols, values: the rest

    def answer_positions(self) -> list[int]:
        first = 2 * self.pairs + 3
        return list(range(first, first + 2 * self.queries, 2))

    def answer_alphabet(self) -> tuple[int, int]:
        return FIRST_SYMBOL + self.key_count, self.vocab

    def generate(self, rng, count):
        documents = self._frame(count)
        keys = FIRST_SYMBOL + _distinct(rng, count, self.key_count, self.pairs)
        values = rng.integers(*self.answer_alphabet(), (count, self.pairs))
        asked = _distinct(rng, count, self.pairs, self.queries)
        documents[:, 1:2 * self.pairs + 1:2] = keys
        documents[:, 2:2 * self.pairs + 2:2] = values
        documents[:, 2 * self.pairs + 1] = SEP
        positions = self.answer_positions()
        documents[:, [p - 1 for p in positions]] = numpy.take_along_axis(keys, asked, axis=1)
        documents[:, positions] = numpy.take_along_axis(values, asked, axis=1)
        return documents


@dataclasses.dataclass(frozen=True)
class LongRangeRetrievalTask(ProbeTask):
    pairs: int
    queries: int
    min_distance: int

    name = "long_range_retrieval"
    layout = "<s> filler with p pairs k v in its first part <query> q1 a1 .. qm am </s>"
    answer_rule = ("every second token after <query>, from the second on: a_j, the value stored with key q_j, "
                   ">= min_distance tokens after that key")

    def __post_init__(self):
        if self.symbols < 3 or self.pairs > self.third:
            raise ProbeOptionError(f"--pairs {self.pairs}: keys are distinct and --vocab {self.vocab} gives "
                                   f"{self.third} key symbols")
        if self.queries > self.pairs:
            raise ProbeOptionError(f"--queries {self.queries} exceeds --pairs {self.pairs} (distinct keys are queried)")
        if 2 * self.pairs - 1 > self.last_key_position:
            raise ProbeOptionError(f"--min-distance {self.min_distance} with --pairs {self.pairs} and --queries "
                                   f"{self.queries}: the pairs must lie within positions "
                                   f"1..{max(self.last_key_position + 1, 1)} of --seq-length {self.seq_length}, "
                                   f"which hold fewer than {self.pairs} pairs")

    @property
    def third(self) -> int:
        return self.symbols // 3  # keys, values, then the filler: the rest of the symbols

    @property
    def first_answer(self) -> int:
        return self.seq_length - 2 * self.queries

    @property
    def last_key_position(self) -> int:
        """The last position a key may take: its value within the filler, min_distance before the first answer."""
        return min(self.first_answer - 4, self.first_answer - self.min_distance)

    def answer_positions(self) -> list[int]:
        return list(range(self.first_answer, self.seq_length - 1, 2))

    def answer_alphabet(self) -> tuple[int, int]:
        return FIRST_SYMBOL + self.third, FIRST_SYMBOL + 2 * self.third

    def generate(self, rng, count):
        documents = rng.integers(FIRST_SYMBOL + 2 * self.third, self.vocab, (count, self.seq_length))
        documents[:, 0], documents[:, -1] = BOS, EOD
        keys = FIRST_SYMBOL + _distinct(rng, count, self.third, self.pairs)
        values = rng.integers(*self.answer_alphabet(), (count, self.pairs))
        # pair starts 1 <= s_1 < s_2 - 1 < ... <= last_key_position: sorted distinct c_j, s_j = 1 + c_j + j
        slots = self.last_key_position - self.pairs + 1
        starts = 1 + numpy.sort(_distinct(rng, count, slots, self.pairs), axis=1) + numpy.arange(self.pairs)
        rows = numpy.arange(count)[:, None]
        documents[rows, starts] = keys
        documents[rows, starts + 1] = values
        asked = _distinct(rng, count, self.pairs, self.queries)
        positions = self.answer_positions()
        documents[:, self.first_answer - 2] = QUERY
        documents[:, [p - 1 for p in positions]] = numpy.take_along_axis(keys, asked, axis=1)
        documents[:, positions] = numpy.take_along_axis(values, asked, axis=1)
        return documents


def task_for(options: ProbeOptions) -> ProbeTask:
    """The task of `options`, defaults filled in; raises ProbeOptionError when it does not fit."""
    common = {"seq_length": options.seq_length, "vocab": options.vocab}
    if options.task in ("copy", "sort"):
        return (CopyTask if options.task == "copy" else SortTask)(**common, length=options.length or 8)
    if options.task == "associative_recall":
        pairs = options.pairs or 6
        return AssociativeRecallTask(**common, pairs=pairs, queries=options.queries or pairs)
    return LongRangeRetrievalTask(**common, pairs=options.pairs or 4, queries=options.queries or 3,
                                  min_distance=options.min_distance or options.seq_length // 2)


def generate(task: ProbeTask, seed: int, split: str, count: int) -> numpy.ndarray:
    """The first `count` examples of a split, [count, seq_length]: the same for the same arguments."""
    return task.generate(numpy.random.default_rng([seed, SPLITS.index(split)]), count)


# ---------------------------------------------------------------------------------------- output
def write_tokenizer(path: str, vocab: int) -> None:
    """A sentencepiece model whose id i is piece i of the fixed vocabulary (no training): the
    special pieces, then "▁0".."▁{vocab - 7}" (decoded: space-separated numbers)."""
    model = sentencepiece_model_pb2.ModelProto()
    spec = model.trainer_spec
    spec.model_type = sentencepiece_model_pb2.TrainerSpec.UNIGRAM
    spec.vocab_size = vocab
    spec.unk_id, spec.bos_id, spec.eos_id, spec.pad_id = UNK, BOS, EOD, PAD
    model.normalizer_spec.name = "identity"
    model.normalizer_spec.add_dummy_prefix = True
    model.normalizer_spec.escape_whitespaces = True
    piece = sentencepiece_model_pb2.ModelProto.SentencePiece
    kinds = (piece.UNKNOWN, piece.CONTROL, piece.CONTROL, piece.CONTROL, piece.USER_DEFINED, piece.USER_DEFINED)
    for text, kind in zip(SPECIAL_PIECES, kinds):
        model.pieces.add(piece=text, type=kind, score=0.0)
    for symbol in range(vocab - FIRST_SYMBOL):
        model.pieces.add(piece=f"\u2581{symbol}", type=piece.NORMAL, score=-1.0)
    temporary = path + ".tmp"
    with open(temporary, "wb") as handle:
        handle.write(model.SerializeToString())
    os.replace(temporary, path)


def write_probe(options: ProbeOptions) -> dict:
    """Generate the task's splits into options.out; return the manifest (written last)."""
    task = task_for(options)
    os.makedirs(options.out, exist_ok=True)
    manifest_file = os.path.join(options.out, MANIFEST_NAME)
    if os.path.exists(manifest_file):
        os.remove(manifest_file)
    remove_shard_files(options.out)
    tokenizer_file = os.path.join(options.out, TOKENIZER_NAME)
    write_tokenizer(tokenizer_file, options.vocab)
    tokenizer = tokenizer_summary(tokenizer_file)
    build_key = hashlib.sha256(json.dumps(dataclasses.asdict(options), sort_keys=True).encode()).hexdigest()
    families = Families(options.out, token_dtype(options.vocab), BuildOptions.max_shard_tokens, build_key, {})
    counts = {"train": options.examples, "valid": options.eval_examples, "test": options.eval_examples}
    ordinal = 0
    try:
        for split in SPLITS:
            for document in generate(task, options.seed, split, counts[split]):
                families.add((task.name, split), document, 0, ordinal)
                ordinal += 1
        families.close()
    except BaseException:
        families.abandon()
        remove_shard_files(options.out)  # never leave part of a build
        raise
    shards = families.shards()
    manifest = assemble_manifest(dataclasses.asdict(options), tokenizer, [], shards,
                                 SkipLog(strict=False, report=print).summary(), blend_weights(shards, None))
    manifest["probe"] = {**task.describe(), "seed": options.seed, "examples": counts}
    write_json_atomic(manifest_file, manifest)
    return manifest


def read_examples(manifest_path: str, split: str, limit: int | None = None) -> numpy.ndarray:
    """The split's examples as written, in document order, [n, seq_length] int64 (megatron-core's
    IndexedDataset over the manifest's shards of the split); the first `limit` when given."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    blend = blend_from_manifest(manifest_path)
    if split not in blend:
        raise DataError(f"{manifest_path}: no {split} split")
    rows = []
    for prefix in blend[split][0]:
        dataset = IndexedDataset(prefix)
        wanted = len(dataset) if limit is None else min(len(dataset), limit - len(rows))
        rows += [numpy.asarray(dataset[i], dtype=numpy.int64) for i in range(wanted)]
        if limit is not None and len(rows) >= limit:
            break
    return numpy.stack(rows)


def parse_args(argv=None) -> ProbeOptions:
    parser = argparse.ArgumentParser(prog="python -m data_tools.probe_tasks", description=__doc__.split("\n\n")[0],
                                     argument_default=argparse.SUPPRESS)
    parser.add_argument("--task", required=True, choices=TASKS)
    parser.add_argument("--out", required=True, help="output directory (its shard files are replaced)")
    parser.add_argument("--examples", type=int, help="training examples (default 20000)")
    parser.add_argument("--eval-examples", type=int, help="examples of the valid and of the test split (default 1000)")
    parser.add_argument("--seq-length", type=int, help="tokens per example: train with model.seq_length = this "
                        "(default 32)")
    parser.add_argument("--vocab", type=int, help="vocabulary size: 6 special ids + symbols (default 24)")
    parser.add_argument("--seed", type=int, help="seed of the examples (default 1234)")
    parser.add_argument("--length", type=int, help="copy, sort: string length (default 8)")
    parser.add_argument("--pairs", type=int, help="associative_recall (default 6), long_range_retrieval "
                        "(default 4): key-value pairs")
    parser.add_argument("--queries", type=int, help="keys queried: associative_recall (default: all pairs), "
                        "long_range_retrieval (default 3)")
    parser.add_argument("--min-distance", type=int, help="long_range_retrieval: least tokens from the queried key "
                        "to the answer (default: half of --seq-length)")
    try:
        return ProbeOptions(**vars(parser.parse_args(argv)))
    except ProbeOptionError as error:
        parser.error(str(error))


def main(argv=None) -> None:
    options = parse_args(argv)
    manifest = write_probe(options)
    probe = manifest["probe"]
    print(f"probe_tasks: {probe['task']} {probe['parameters']}, {manifest['totals']['documents']:,} examples of "
          f"{probe['seq_length']} tokens, answers at {len(probe['answer_positions'])} positions, chance "
          f"{probe['chance_accuracy']:.3g} -> {os.path.join(options.out, MANIFEST_NAME)}", file=sys.stderr)


if __name__ == "__main__":
    main()
