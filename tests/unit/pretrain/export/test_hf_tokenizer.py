"""pretrain.export.hf_tokenizer: the sentencepiece model as a transformers fast tokenizer with sentencepiece's ids."""

import json
import os
import random

import huggingface_hub.constants
import pytest
import sentencepiece
from data_fixtures import make_text
from sentencepiece import sentencepiece_model_pb2 as model_pb2
from transformers import AutoTokenizer

from data_tools import train_tokenizer
from pretrain.export.hf_tokenizer import (
    SLOW_MODEL_FILE,
    UnsupportedTokenizerError,
    build_fast_tokenizer,
    export_tokenizer,
)

SYMBOLS = ("<|code|>", "<|math|>", "§")
# (model type, vocab size, extra train_tokenizer arguments)
MODELS = {
    "bpe": ("bpe", 400, []),
    "unigram": ("unigram", 350, []),  # exported with allow_unigram=True; the texts below break no ties
    "char": ("char", 80, []),
    "bpe_symbols": ("bpe", 400, ["--user-defined-symbols", ",".join(SYMBOLS)]),
}
# lines the corpus repeats so that the models learn whitespace runs, tabs, digits, accents, CJK and emoji
TRAINING_EXTRAS = (
    "café naïve résumé Ærøskøbing", "cafe\u0301 nai\u0308ve", "東京 日本語のテキスト 中文", "😀 👍🏽 🙂",
    "2024-05-17 3.14159 12345", "\tindented\tline", "x  y   z    w", "<s> and </s> as text",
)
UNSEEN = "Ω ж ∮ 𝔘 \u200b ₪ 🦀"  # never in the corpus: bytes (or <unk> for char)
LONG_TEXT = "".join(make_text(random.Random(3), 5, 40) + " " for _ in range(400)) + UNSEEN * 20
TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "",
    " ",
    "   ",
    " leading space",
    "  two leading spaces",
    "trailing space ",
    "trailing spaces   ",
    "multiple   spaces    inside",
    "tab\tseparated\tvalues\t",
    "line one\nline two\n\n\nline five\n",
    "\nstarts with a newline",
    "windows\r\nline end",
    "café naïve résumé Ærøskøbing",  # NFC
    "cafe\u0301 nai\u0308ve re\u0301sume\u0301",  # NFD: combining marks stay separate code points
    "東京 日本語のテキスト 中文字符",
    "😀 👍🏽 👨\u200d👩\u200d👧\u200d👦 🏳️\u200d🌈",  # emoji, skin tone modifier, ZWJ sequences
    UNSEEN,
    "0 7 42 2024-05-17 3.14159 1234567890",
    "<s>",
    "</s>",
    "<pad> <unk>",
    "text with <s> inside and </s> at the end",
    "<0x41> looks like a byte piece",
    "\u2581 is sentencepiece's space symbol\u2581\u2581",
    "nul \x00 and bell \x07",
    "<|code|>",
    "<|code|>x",
    "a<|code|>b <|math|>§ <|code|><|math|>",
    "<|code|><s>",
    "<|math|><0x41><|math|>",
    "<|cod",
    LONG_TEXT,
)
# the pool random texts are drawn from for the fuzz test
POOL = tuple(" \t\n\u2581abcxyz.,-éü") + (
    "e\u0301", "東", "😀", "👍🏽", "\u200d", "Ω", "ж", "<s>", "</s>", "<0x41>", "0", "7", "  ", "the ", "café",
) + SYMBOLS


def train(corpus_path, prefix, model_type, vocab_size, extra):
    train_tokenizer.main([
        "--input", str(corpus_path), "--model-prefix", str(prefix), "--vocab-size", str(vocab_size),
        "--model-type", model_type, "--num-threads", "1", *extra,
    ])
    return f"{prefix}.model"


@pytest.fixture(scope="module", autouse=True)
def offline():
    """Nothing here may reach the Hugging Face hub (the flag is read at import, so patch the constant)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        yield


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("hf_tokenizer_corpus") / "corpus.jsonl"
    with open(path, "w", encoding="utf-8") as handle:
        for index in range(300):
            text = make_text(rng, 5, 40) + " " + TRAINING_EXTRAS[index % len(TRAINING_EXTRAS)]
            if index % 5 == 0:
                text += " " + rng.choice(SYMBOLS)
            handle.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    return path


@pytest.fixture(scope="module")
def sp_models(corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_tokenizer_models")
    return {name: train(corpus, root / name, *spec) for name, spec in MODELS.items()}


@pytest.fixture(scope="module")
def exported(sp_models, tmp_path_factory, offline):
    """name -> (sentencepiece processor, AutoTokenizer loaded from the export directory, directory)"""
    root = tmp_path_factory.mktemp("hf_tokenizer_exports")
    result = {}
    for name, path in sp_models.items():
        directory = root / name
        export_tokenizer(path, directory, allow_unigram=name == "unigram")
        result[name] = (
            sentencepiece.SentencePieceProcessor(model_file=path),
            AutoTokenizer.from_pretrained(str(directory)),
            directory,
        )
    return result


def mismatches(processor, tokenizer, texts):
    """(text, sentencepiece pieces, fast tokenizer pieces) for each text encoded differently."""
    bad = []
    for text in texts:
        expected, got = processor.encode(text), tokenizer.encode(text, add_special_tokens=False)
        if got != expected:
            bad.append((text[:60], processor.id_to_piece(expected)[:20], tokenizer.convert_ids_to_tokens(got)[:20]))
    return bad


@pytest.mark.parametrize("name", MODELS)
def test_ids_equal_sentencepiece(exported, name):
    processor, tokenizer, _ = exported[name]
    assert mismatches(processor, tokenizer, TEXTS) == []
    assert tokenizer(list(TEXTS), add_special_tokens=False)["input_ids"] == [processor.encode(t) for t in TEXTS]


@pytest.mark.parametrize("name", MODELS)
def test_decode_equals_sentencepiece(exported, name):
    processor, tokenizer, _ = exported[name]
    for text in TEXTS:
        ids = processor.encode(text)
        assert tokenizer.decode(ids) == processor.decode(ids), text[:60]
        if name != "char" and "\u2581" not in text:  # byte fallback: the text comes back verbatim, except
            assert tokenizer.decode(ids) == text, text[:60]  # that sentencepiece decodes a typed "▁" as " " too
    char_processor, char_tokenizer, _ = exported["char"]
    assert char_tokenizer.decode(char_processor.encode("Ω x")) == char_processor.decode(char_processor.encode("Ω x"))


@pytest.mark.parametrize("name", MODELS)
def test_random_texts(exported, name):
    processor, tokenizer, _ = exported[name]
    rng = random.Random(name)
    texts = ["".join(rng.choice(POOL) for _ in range(rng.randint(0, 25))) for _ in range(400)]
    assert mismatches(processor, tokenizer, texts) == []


def test_export_directory_and_special_tokens(exported, sp_models):
    processor, tokenizer, directory = exported["bpe"]
    files = set(os.listdir(directory))
    assert {"tokenizer.json", "tokenizer_config.json", SLOW_MODEL_FILE} <= files
    assert (directory / SLOW_MODEL_FILE).read_bytes() == open(sp_models["bpe"], "rb").read()
    assert tokenizer.is_fast
    assert len(tokenizer) == processor.vocab_size()
    for name in ("unk", "bos", "eos", "pad"):
        index = getattr(processor, f"{name}_id")()
        assert getattr(tokenizer, f"{name}_token_id") == index
        assert getattr(tokenizer, f"{name}_token") == processor.id_to_piece(index)
    assert tokenizer.convert_ids_to_tokens(list(range(processor.vocab_size()))) == [
        processor.id_to_piece(i) for i in range(processor.vocab_size())
    ]
    # training saw encode(document) + [eos], no bos: the default adds neither
    assert tokenizer("hello world")["input_ids"] == processor.encode("hello world")
    # the special tokens' text is plain text, as for sentencepiece
    assert processor.bos_id() not in tokenizer("<s> x </s>")["input_ids"]
    ids = [processor.bos_id()] + processor.encode("hello") + [processor.eos_id()]
    assert tokenizer.decode(ids, skip_special_tokens=True) == processor.decode(ids) == "hello"


def test_add_bos_eos_and_max_length(sp_models, tmp_path):
    processor = sentencepiece.SentencePieceProcessor(model_file=sp_models["bpe"])
    export_tokenizer(sp_models["bpe"], tmp_path, add_bos_token=True, add_eos_token=True, model_max_length=256)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    assert tokenizer("a b")["input_ids"] == [processor.bos_id(), *processor.encode("a b"), processor.eos_id()]
    assert tokenizer.encode("a b", add_special_tokens=False) == processor.encode("a b")
    assert tokenizer.model_max_length == 256
    batch = tokenizer(["a", "a b c"], padding=True)["input_ids"]
    assert batch[0][-1] == processor.pad_id() and len(batch[0]) == len(batch[1])


def test_user_defined_symbols_stay_whole(exported):
    processor, tokenizer, _ = exported["bpe_symbols"]
    for symbol in SYMBOLS:
        assert tokenizer.convert_ids_to_tokens(tokenizer.encode(f"x{symbol}y", add_special_tokens=False)).count(
            symbol
        ) == 1
    assert tokenizer.encode("<|code|>", add_special_tokens=False) == processor.encode("<|code|>")  # ["▁", symbol]


def test_unigram_differs_only_in_the_order_of_tied_pieces(exported):
    """Why unigram needs allow_unigram=True: in runs of spaces, "▁"+"▁▁▁▁" and "▁▁▁▁"+"▁" score the same and
    sentencepiece's float32 sums pick one or the other by rounding; the ids are the same, in another order."""
    processor, tokenizer, _ = exported["unigram"]
    rng = random.Random(1)
    texts = [" ".join("x" + " " * rng.randint(0, 12) for _ in range(rng.randint(1, 6))) for _ in range(300)]
    differing = [(processor.encode(t), tokenizer.encode(t, add_special_tokens=False)) for t in texts]
    differing = [(expected, got) for expected, got in differing if expected != got]
    assert differing, "no tie broken differently: if sentencepiece now sums in float64, unigram could be allowed"
    assert all(sorted(expected) == sorted(got) for expected, got in differing)


def test_unigram_needs_opt_in(sp_models, tmp_path):
    with pytest.raises(UnsupportedTokenizerError, match="model_type=unigram.*float32.*allow_unigram=True"):
        export_tokenizer(sp_models["unigram"], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_nmt_nfkc_is_refused(corpus, tmp_path):
    path = train(corpus, tmp_path / "nfkc", "bpe", 400, ["--normalization", "nmt_nfkc"])
    with pytest.raises(UnsupportedTokenizerError, match="normalizer_spec.name='nmt_nfkc'"):
        export_tokenizer(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def edited(model_path, tmp_path, edit):
    proto = model_pb2.ModelProto()
    proto.ParseFromString(open(model_path, "rb").read())
    edit(proto)
    path = tmp_path / "edited.model"
    path.write_bytes(proto.SerializeToString())
    return path


@pytest.mark.parametrize("edit, setting", [
    (lambda p: setattr(p.normalizer_spec, "remove_extra_whitespaces", True), "remove_extra_whitespaces"),
    (lambda p: setattr(p.trainer_spec, "treat_whitespace_as_suffix", True), "treat_whitespace_as_suffix"),
    (lambda p: setattr(p.normalizer_spec, "escape_whitespaces", False), "escape_whitespaces"),
    (lambda p: setattr(p.trainer_spec, "model_type", model_pb2.TrainerSpec.WORD), "model_type=word"),
    (lambda p: setattr(p.pieces[-1], "type", model_pb2.ModelProto.SentencePiece.UNUSED), "UNUSED"),
])
def test_unsupported_settings_are_named(sp_models, tmp_path, edit, setting):
    with pytest.raises(UnsupportedTokenizerError, match=setting):
        build_fast_tokenizer(edited(sp_models["bpe"], tmp_path, edit))


def test_without_dummy_prefix(sp_models, tmp_path):
    path = edited(sp_models["bpe"], tmp_path, lambda p: setattr(p.normalizer_spec, "add_dummy_prefix", False))
    export_tokenizer(path, tmp_path / "out")
    processor = sentencepiece.SentencePieceProcessor(model_file=str(path))
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    original = sentencepiece.SentencePieceProcessor(model_file=sp_models["bpe"])
    assert processor.encode("a b") != original.encode("a b")  # the edit took effect
    assert mismatches(processor, tokenizer, TEXTS) == []
    assert all(tokenizer.decode(processor.encode(text)) == processor.decode(processor.encode(text)) for text in TEXTS)

