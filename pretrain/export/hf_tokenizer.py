"""The run's sentencepiece model as a `transformers` fast tokenizer that gives sentencepiece's ids.

    export_tokenizer("runs/x/tokenizer/sp.model", "export/")
    AutoTokenizer.from_pretrained("export/").encode(text, add_special_tokens=False)
        == SentencePieceProcessor(model_file="runs/x/tokenizer/sp.model").encode(text)

The `tokenizers` pipeline is built here from the model proto. transformers' own conversion
(`LlamaConverter`/`SpmConverter`, or `AutoTokenizer` on a bare tokenizer.model) loses the dummy
prefix ("hello" is not "▁hello", " a" gets one "▁" instead of two), lets a unigram lattice choose
control and byte pieces, and matches "<s>" typed in the text as a special token. sentencepiece
does none of these. What is built instead, for the settings `data_tools.train_tokenizer` writes
(identity normalization, extra whitespace kept, byte fallback, dummy prefix):

- normalizer: " " -> "▁", then "▁" prepended to any non-empty text, always, as sentencepiece's
  add_dummy_prefix does (" a" -> "▁▁a"). Identity normalization changes nothing else.
- no pre-tokenizer unless one is needed (see below): sentencepiece encodes the whole normalized
  text at once.
- bpe: the vocabulary plus one merge for each way of splitting a normal piece into two normal
  pieces, ranked by the merged piece's score. That is sentencepiece's rule: merge the adjacent
  pair whose merged piece scores best. Control, byte and user-defined pieces take no part in
  merges, because sentencepiece never merges into or out of them. A character outside the
  vocabulary becomes its <0xXX> byte pieces.
- char: every piece is one character, so this is a bpe model with no merges. Without byte fallback,
  runs of unknown characters are fused into one <unk>, as sentencepiece does.
- unigram: the vocabulary and its scores. Control, unknown and byte pieces get scores too low to
  be chosen, because sentencepiece leaves them out of its lattice. A character that is not a piece
  but occurs in those pieces' text (a "<" missing from a small vocabulary) is split off first.
  Otherwise its unknown-character penalty would make "<s>" the better path. Unigram is still
  refused unless `allow_unigram=True`. sentencepiece adds lattice scores in float32, and where two
  segmentations tie, its choice follows float32 rounding of the running sum: "▁"+"▁▁▁▁▁▁▁▁▁" in one
  context and "▁▁▁▁▁▁▁▁▁"+"▁" in another. tokenizers adds in float64, which no score table can
  turn into float32 rounding.
- user-defined symbols in bpe and char models: sentencepiece cuts every occurrence out of the
  normalized text (the longest match first) and never merges across one. A split pre-tokenizer
  does the same after the normalizer. An added token would not work: it is cut from the raw text
  before the dummy prefix is added. The model then maps the isolated symbol to its piece. A
  one-character symbol is simply a piece that never merges. bpe merges cannot build a longer
  symbol, so the whole segment is looked up first (`ignore_merges`). That lookup matches
  sentencepiece only where sentencepiece would also produce that one piece. Segments it would get
  wrong are split, anchored at both ends, where sentencepiece splits them: the text of a control or
  byte piece ("<s>" between two symbols), and any normal piece that bpe does not rebuild from its
  own text. In unigram, a symbol is a lattice piece with sentencepiece's length bonus.
- special tokens: unk/bos/eos/pad and any other control pieces, with the model's ids.
  `split_special_tokens=True` because sentencepiece encodes "<s>" typed in the text as ordinary
  characters. `add_bos_token` and `add_eos_token` are off by default. The training data is
  `encode(document) + [eos]` (data_tools/chunk_worker.py) with no bos, and an eos appended to every
  encoded prompt would be wrong for generation.
- decoder: "▁" -> " ", <0xXX> bytes joined back into UTF-8, the dummy prefix's space dropped, and
  <unk> shown as sentencepiece shows it (" ⁇ ").

Any other setting is refused with `UnsupportedTokenizerError`, which names the setting:
normalization other than identity (nmt_nfkc and similar need sentencepiece's charsmap matching),
remove_extra_whitespaces, treat_whitespace_as_suffix, escape_whitespaces=false, a denormalizer,
unused pieces, word models, and user-defined symbols containing whitespace. After the export, the
saved tokenizer is loaded back and checked against sentencepiece on probe texts plus any
`verify_texts`. A copy of the sentencepiece model is kept beside it as tokenizer.model for the
slow path.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import sentencepiece
from sentencepiece import sentencepiece_model_pb2 as model_pb2
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE, Unigram
from transformers import AutoTokenizer, PreTrainedTokenizerFast

log = logging.getLogger(__name__)

SPACE = "\u2581"  # sentencepiece's whitespace symbol "▁"
SLOW_MODEL_FILE = "tokenizer.model"
SPECIAL_NAMES = ("unk", "bos", "eos", "pad")
_PIECE_TYPE = model_pb2.ModelProto.SentencePiece.Type
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = (
    _PIECE_TYPE.Value(name) for name in ("NORMAL", "UNKNOWN", "CONTROL", "USER_DEFINED", "UNUSED", "BYTE")
)
_MODEL_TYPE = model_pb2.TrainerSpec.ModelType
_REGEX_META = frozenset("\\^$.|?*+()[]{}/-#&~<>=!:,'\"")
# Texts every export is checked on: whitespace runs, the dummy prefix, byte fallback, combining
# marks, special-token and byte-piece text typed as text.
PROBE_TEXTS = (
    "", " ", "   ", "Hello world", " leading", "trailing  ", "a  b   c    d", "\tTab\n\nnew line\r\n",
    "café cafe\u0301", "東京 😀 👨\u200d👩\u200d👧", "Ω ₪ ж ∮ \x00", "0123456789 3.14",
    "<s> </s> <pad> <unk> <0x41>", "<s>", "▁ ▁x", "the quick brown fox " * 20,
)


class UnsupportedTokenizerError(ValueError):
    """A sentencepiece setting the exported fast tokenizer could not reproduce exactly."""


class TokenizerParityError(RuntimeError):
    """The built fast tokenizer disagrees with sentencepiece on a checked text."""


@dataclass
class SpModel:
    """A sentencepiece model: its proto, its pieces and a processor to compare with."""

    path: str
    proto: model_pb2.ModelProto = field(repr=False)
    pieces: list[tuple[str, float, int]] = field(repr=False)  # (piece, score, type) by id
    processor: sentencepiece.SentencePieceProcessor = field(repr=False)

    @classmethod
    def load(cls, path: str | os.PathLike) -> SpModel:
        proto = model_pb2.ModelProto()
        with open(path, "rb") as handle:
            proto.ParseFromString(handle.read())
        return cls(
            path=str(path),
            proto=proto,
            pieces=[(piece.piece, piece.score, piece.type) for piece in proto.pieces],
            processor=sentencepiece.SentencePieceProcessor(model_file=str(path)),
        )

    @property
    def model_type(self) -> str:
        return _MODEL_TYPE.Name(self.proto.trainer_spec.model_type).lower()

    def ids_of(self, *types: int) -> list[int]:
        return [index for index, (_, _, kind) in enumerate(self.pieces) if kind in types]

    def strings_of(self, *types: int) -> list[str]:
        return [self.pieces[index][0] for index in self.ids_of(*types)]

    @property
    def user_symbols(self) -> list[str]:
        return self.strings_of(USER_DEFINED)

    def special_id(self, name: str) -> int:
        """The unk/bos/eos/pad id from the trainer spec; -1 when the model has none."""
        return getattr(self.proto.trainer_spec, f"{name}_id")

    def known_chars(self) -> set[str]:
        """Characters that are pieces themselves. Any other character is unknown (bytes or <unk>)."""
        return {piece for piece, _, kind in self.pieces if kind in (NORMAL, USER_DEFINED) and len(piece) == 1}


def check_supported(model: SpModel, allow_unigram: bool = False) -> None:
    """Raise `UnsupportedTokenizerError` naming the first setting that cannot be exported exactly."""
    normalizer, trainer, denormalizer = (
        model.proto.normalizer_spec, model.proto.trainer_spec, model.proto.denormalizer_spec
    )

    def refuse(message: str):
        raise UnsupportedTokenizerError(f"{model.path}: {message}")

    if model.model_type not in ("bpe", "unigram", "char"):
        refuse(f"model_type={model.model_type} is not supported (bpe, char; unigram with allow_unigram=True)")
    if model.model_type == "unigram" and not allow_unigram:
        refuse(
            "model_type=unigram: sentencepiece adds lattice scores in float32 and breaks ties between equal-"
            "scoring segmentations (e.g. '▁'+'▁▁▁▁' vs '▁▁▁▁'+'▁' in a run of spaces) by float32 rounding, which "
            "the tokenizers library (float64) cannot reproduce, so some ids would differ; pass allow_unigram=True "
            "to export anyway, or train a bpe tokenizer"
        )
    if normalizer.precompiled_charsmap or normalizer.name not in ("identity", ""):
        refuse(
            f"normalizer_spec.name={normalizer.name!r}: only the 'identity' normalization can be reproduced "
            "exactly (a character map such as nmt_nfkc needs sentencepiece's own matching); train with "
            "--normalization identity"
        )
    if normalizer.remove_extra_whitespaces:
        refuse(
            "normalizer_spec.remove_extra_whitespaces=true: sentencepiece's whitespace collapsing is not reproduced; "
            "train with --normalization identity, which turns it off"
        )
    if not normalizer.escape_whitespaces:
        refuse("normalizer_spec.escape_whitespaces=false is not supported")
    if trainer.treat_whitespace_as_suffix:
        refuse("trainer_spec.treat_whitespace_as_suffix=true is not supported")
    if denormalizer.precompiled_charsmap or denormalizer.name not in ("identity", ""):
        refuse(f"denormalizer_spec.name={denormalizer.name!r}: a denormalizer is not supported")
    if model.ids_of(UNUSED):
        refuse("pieces of type UNUSED are not supported")
    if trainer.byte_fallback and len(model.ids_of(BYTE)) != 256:
        refuse(f"byte_fallback=true but the model has {len(model.ids_of(BYTE))} byte pieces, not 256")
    unk = model.special_id("unk")
    if not 0 <= unk < len(model.pieces) or model.pieces[unk][2] != UNKNOWN:
        refuse(f"trainer_spec.unk_id={unk} is not the model's unknown piece")
    for symbol in model.user_symbols:
        if any(char.isspace() or char == SPACE for char in symbol):
            refuse(f"user_defined_symbols: {symbol!r} contains whitespace, which escaping and the dummy prefix change")
    known = model.known_chars()
    for piece in model.strings_of(NORMAL):
        if any(char not in known for char in piece):
            refuse(f"normal piece {piece!r} contains a character that is not a piece of its own")


def _escape(text: str) -> str:
    """`text` as a literal in an Oniguruma regex (tokenizers' Regex)."""
    return "".join("\\" + char if char in _REGEX_META else char for char in text)


def _normalizer(model: SpModel):
    steps = [normalizers.Replace(" ", SPACE)]
    if model.proto.normalizer_spec.add_dummy_prefix:
        steps.append(normalizers.Prepend(SPACE))  # leaves an empty text empty, as sentencepiece does
    return normalizers.Sequence(steps)


def _decoder(model: SpModel):
    trainer = model.proto.trainer_spec
    unk_surface = trainer.unk_surface if trainer.HasField("unk_surface") else " \u2047 "
    unk_token = Regex(f"\\A{_escape(model.pieces[model.special_id('unk')][0])}\\z")  # the whole token only
    steps = [decoders.Replace(unk_token, unk_surface), decoders.Replace(SPACE, " ")]
    if trainer.byte_fallback:
        steps.append(decoders.ByteFallback())
    steps.append(decoders.Fuse())  # before Strip, which strips each token it sees
    if model.proto.normalizer_spec.add_dummy_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    return decoders.Sequence(steps)


def _bpe_merges(model: SpModel) -> list[tuple[str, str]]:
    """Every split of a normal piece into two normal pieces, the best-scoring merged piece first."""
    normal = set(model.strings_of(NORMAL))
    ranked = []
    for index in model.ids_of(NORMAL):
        piece, score, _ = model.pieces[index]
        for cut in range(1, len(piece)):
            if piece[:cut] in normal and piece[cut:] in normal:
                ranked.append((-score, index, cut))
    ranked.sort()
    return [(model.pieces[index][0][:cut], model.pieces[index][0][cut:]) for _, index, cut in ranked]


def _isolated_segmentation(model: SpModel, text: str, symbol: str) -> list[tuple[str, int]]:
    """sentencepiece's pieces (normalized text, id) for the normalized `text` standing alone between two
    occurrences of the user symbol `symbol`. The byte pieces of one character count as one piece."""
    encoded = model.processor.encode(symbol + text.replace(SPACE, " ") + symbol, return_type="proto").pieces
    symbol_id = model.processor.piece_to_id(symbol)
    ids = [piece.id for piece in encoded]
    first = ids.index(symbol_id)
    segments = [(piece.surface.replace(" ", SPACE), piece.id) for piece in encoded[first + 1 : -1] if piece.surface]
    if ids[-1] != symbol_id or "".join(surface for surface, _ in segments) != text:
        raise UnsupportedTokenizerError(f"{model.path}: cannot follow sentencepiece's segmentation of {text!r}")
    return segments


def _lookup_fixups(model: SpModel) -> str | None:
    """A regex that splits each segment the whole-segment lookup would get wrong where sentencepiece
    splits it, or None when there is none. A segment is "wrong" when it is the text of a vocabulary
    piece that sentencepiece does not produce for that text on its own."""
    delimiter = max(model.user_symbols, key=len)
    branches = []
    for index, (piece, _, kind) in enumerate(model.pieces):
        if kind == USER_DEFINED:
            continue
        pieces = _isolated_segmentation(model, piece, delimiter)
        if [index] == [piece_id for _, piece_id in pieces]:
            continue  # sentencepiece gives this piece too: the lookup is right
        if len(pieces) == 1:  # one <unk> for unknown characters, which no split could reproduce
            raise UnsupportedTokenizerError(
                f"{model.path}: user_defined_symbols with byte_fallback=false: {piece!r} between two symbols is "
                "one <unk> for sentencepiece"
            )
        segments = [surface for surface, _ in pieces]
        for position, segment in enumerate(segments):
            before, after = "".join(segments[:position]), "".join(segments[position + 1 :])
            # \G (where the search starts: 0, then the end of the previous match) comes first so that the
            # regex engine tries one position per search, not every position of a long segment
            branches.append(f"\\G{_escape(segment)}(?<=\\A{_escape(before + segment)})(?={_escape(after)}\\z)")
    return "|".join(branches) or None


def _unigram_model(model: SpModel) -> tuple[Unigram, list[str]]:
    """The unigram model and the strings to split off before it."""
    normal_scores = [model.pieces[index][1] for index in model.ids_of(NORMAL)]
    best = max(normal_scores)
    if best >= 0:
        raise UnsupportedTokenizerError(f"{model.path}: a normal piece has score {best} >= 0")
    # sentencepiece's bonus for a user-defined piece (unigram_model.cc; length in UTF-8 bytes): it usually
    # wins, but the lattice decides, as here
    scores = {index: len(model.pieces[index][0].encode()) * best - 0.1 for index in model.ids_of(USER_DEFINED)}
    unreachable = model.strings_of(CONTROL, UNKNOWN, BYTE)
    worst = min(normal_scores + list(scores.values()))
    # below any segmentation of the same text into pieces that are not unreachable (each >= `worst`)
    never = (max(map(len, unreachable)) + 1) * worst - 10.0
    scores.update((index, never) for index in model.ids_of(CONTROL, UNKNOWN, BYTE))
    vocab = [(piece, scores.get(index, score)) for index, (piece, score, _) in enumerate(model.pieces)]
    # A character that is not a piece starts and ends every path through it in sentencepiece's lattice, so
    # splitting it off changes nothing, and it keeps a "<" that is not a piece from making "<s>" the best
    # path (tokenizers' unknown-character penalty is counted from the lowest score, `never`). A user
    # symbol containing such a character is split off whole, first.
    known = model.known_chars()
    isolate = sorted({char for text in unreachable for char in text if char not in known})
    symbols = [symbol for symbol in model.user_symbols if any(char not in known for char in symbol)]
    unigram = Unigram(vocab, unk_id=model.special_id("unk"), byte_fallback=model.proto.trainer_spec.byte_fallback)
    return unigram, _longest_first(symbols) + isolate


def _longest_first(strings: list[str]) -> list[str]:
    """Alternatives in the order that makes a regex's leftmost match the longest one, as sentencepiece's
    prefix matcher does."""
    return sorted(strings, key=lambda text: (-len(text), text))


def build_backend(model: SpModel, allow_unigram: bool = False) -> Tokenizer:
    """The `tokenizers.Tokenizer` (no special tokens registered yet) that encodes like `model`."""
    check_supported(model, allow_unigram)
    fixups = None
    if model.model_type == "unigram":
        core, cuts = _unigram_model(model)
    else:
        byte_fallback = model.proto.trainer_spec.byte_fallback
        long_symbols = [symbol for symbol in model.user_symbols if len(symbol) > 1]
        core = BPE(
            {piece: index for index, (piece, _, _) in enumerate(model.pieces)},
            _bpe_merges(model) if model.model_type == "bpe" else [],
            unk_token=model.pieces[model.special_id("unk")][0],
            fuse_unk=not byte_fallback,
            byte_fallback=byte_fallback,
            ignore_merges=bool(long_symbols),
            dropout=None,
        )
        # bpe and char freeze user symbols: sentencepiece's prefix matcher cuts them out before merging
        cuts = _longest_first(model.user_symbols)
        fixups = _lookup_fixups(model) if long_symbols else None
    backend = Tokenizer(core)
    backend.normalizer = _normalizer(model)
    steps = [pre_tokenizers.Split(Regex("|".join(map(_escape, cuts))), behavior="isolated")] if cuts else []
    if fixups:
        steps.append(pre_tokenizers.Split(Regex(fixups), behavior="isolated"))
    if steps:
        backend.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    backend.decoder = _decoder(model)
    return backend


def _special_tokens(model: SpModel) -> dict:
    """transformers' named special tokens (the model's unk/bos/eos/pad) and the other control pieces."""
    tokens = {}
    for name in SPECIAL_NAMES:
        index = model.special_id(name)
        if index >= 0:
            tokens[f"{name}_token"] = AddedToken(model.pieces[index][0], special=True, normalized=False)
    named = {str(token) for token in tokens.values()}
    extra = [
        AddedToken(piece, special=True, normalized=False) for piece in model.strings_of(CONTROL) if piece not in named
    ]
    if extra:
        tokens["extra_special_tokens"] = extra
    return tokens


def probe_texts(model: SpModel) -> list[str]:
    """PROBE_TEXTS and, per user symbol, the contexts its isolation has to get right."""
    texts = list(PROBE_TEXTS)
    for symbol in model.user_symbols:
        texts += [symbol, symbol * 2, f"a{symbol}b", f" {symbol} ", f"{symbol}<s>", f"{symbol}<0x41>{symbol}"]
    return texts


def parity_mismatches(tokenizer, model: SpModel, texts: Iterable[str]) -> list[str]:
    """The texts on which `tokenizer` encodes (without special tokens) or decodes unlike sentencepiece."""
    bad = []
    for text in texts:
        ids = model.processor.encode(text)
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if encoded != ids or tokenizer.decode(ids) != model.processor.decode(ids):
            bad.append(text)
    return bad


def _check_specials(tokenizer, model: SpModel) -> None:
    for name in SPECIAL_NAMES:
        index = model.special_id(name)
        if index >= 0 and (getattr(tokenizer, f"{name}_token_id"), getattr(tokenizer, f"{name}_token")) != (
            index, model.pieces[index][0]
        ):
            raise TokenizerParityError(f"{name} token {getattr(tokenizer, f'{name}_token')!r} is not sentencepiece's")
    if len(tokenizer) != len(model.pieces):
        raise TokenizerParityError(f"{len(tokenizer)} tokens, sentencepiece has {len(model.pieces)} pieces")


def _verify(tokenizer, model: SpModel, texts: Iterable[str]) -> None:
    _check_specials(tokenizer, model)
    bad = parity_mismatches(tokenizer, model, texts)
    if bad and model.model_type == "unigram":
        log.warning("%s: unigram export differs from sentencepiece on %d checked texts, e.g. %r",
                    model.path, len(bad), bad[0][:80])
    elif bad:
        raise TokenizerParityError(f"{model.path}: the fast tokenizer differs from sentencepiece on {bad[0][:80]!r}")


def _fast_tokenizer(model: SpModel, allow_unigram: bool, add_bos_token: bool, add_eos_token: bool,
                    model_max_length: int | None) -> PreTrainedTokenizerFast:
    for name, wanted in (("bos", add_bos_token), ("eos", add_eos_token)):
        if wanted and model.special_id(name) < 0:
            raise ValueError(f"{model.path}: add_{name}_token=True but the model has no {name} piece ({name}_id=-1)")
    optional = {} if model_max_length is None else {"model_max_length": model_max_length}
    return PreTrainedTokenizerFast(
        tokenizer_object=build_backend(model, allow_unigram),
        split_special_tokens=True,
        clean_up_tokenization_spaces=False,
        add_bos_token=add_bos_token,
        add_eos_token=add_eos_token,
        **_special_tokens(model),
        **optional,
    )


def build_fast_tokenizer(
    sp_model_path: str | os.PathLike,
    *,
    allow_unigram: bool = False,
    add_bos_token: bool = False,
    add_eos_token: bool = False,
    model_max_length: int | None = None,
) -> PreTrainedTokenizerFast:
    """A `PreTrainedTokenizerFast` that encodes and decodes like the sentencepiece model. Not saved
    and not checked; `export_tokenizer` does both."""
    return _fast_tokenizer(SpModel.load(sp_model_path), allow_unigram, add_bos_token, add_eos_token, model_max_length)


def export_tokenizer(
    sp_model_path: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    allow_unigram: bool = False,
    add_bos_token: bool = False,
    add_eos_token: bool = False,
    model_max_length: int | None = None,
    verify_texts: Iterable[str] = (),
) -> PreTrainedTokenizerFast:
    """Write the fast tokenizer (tokenizer.json, tokenizer_config.json, whatever save_pretrained
    writes) and a copy of the sentencepiece model (tokenizer.model) to `output_dir`. Return the
    tokenizer as `AutoTokenizer.from_pretrained(output_dir)` loads it, after checking it against
    sentencepiece: special tokens, vocabulary size, and encode/decode of `probe_texts` plus
    `verify_texts` (a sample of the corpus, say). Raises `UnsupportedTokenizerError` before writing
    anything if the model has a setting that cannot be reproduced, and `TokenizerParityError` if a
    check fails."""
    model = SpModel.load(sp_model_path)
    texts = probe_texts(model) + list(verify_texts)
    tokenizer = _fast_tokenizer(model, allow_unigram, add_bos_token, add_eos_token, model_max_length)
    _verify(tokenizer, model, texts)
    output = Path(output_dir)
    output.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(output))
    if not (output / SLOW_MODEL_FILE).exists() or not os.path.samefile(sp_model_path, output / SLOW_MODEL_FILE):
        shutil.copyfile(sp_model_path, output / SLOW_MODEL_FILE)
    loaded = AutoTokenizer.from_pretrained(str(output))
    _verify(loaded, model, texts)
    # transformers 5 keeps add_bos_token/add_eos_token only as tokenizer.json's post-processor
    bos, eos = [model.special_id("bos")] * add_bos_token, [model.special_id("eos")] * add_eos_token
    if loaded.encode("a b") != bos + model.processor.encode("a b") + eos:
        raise TokenizerParityError(f"{output}: add_bos_token/add_eos_token did not survive save and load")
    return loaded
