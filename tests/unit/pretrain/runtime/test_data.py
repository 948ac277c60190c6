"""Data: which samples a step reads (BatchOrder, StepBatches), the datasets a run builds, the dataset
config of each data source, and the checks of a run's data made before any worker starts."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from megatron.core.datasets.gpt_dataset import MockGPTDataset, MockGPTLowLevelDataset
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path
from one_process import tiny_run

from data_tools.shard_writer import sha256_file
from ora_megatron.config_io import ConfigError
from pretrain.config.loop_sections import EvalConfig, TrainConfig
from pretrain.config.runtime_sections import BlendEntry, DataConfig
from pretrain.runtime import data
from pretrain.runtime.data import BatchOrder, StepBatches

SEQ = 16  # model_fixtures' sequence length
VOCAB = 100  # and vocabulary


# ---------------------------------------------------------------------------- BatchOrder
def global_batch(step: int, micro_batch_size: int, grad_accum: int, dp_size: int) -> list[list[int]]:
    """Every (DP rank, micro-batch)'s sample indices of `step`."""
    return [list(BatchOrder(micro_batch_size, grad_accum, rank, dp_size).indices(step, micro))
            for rank in range(dp_size) for micro in range(grad_accum)]


@pytest.mark.parametrize("micro_batch_size, grad_accum, dp_size", [(2, 3, 4), (1, 1, 1), (4, 2, 1), (1, 1, 8)])
def test_a_global_batch_is_partitioned_across_ranks_and_micro_batches(micro_batch_size, grad_accum, dp_size):
    """Step s reads samples [s·G, (s+1)·G), each exactly once over ranks and micro-batches."""
    size = micro_batch_size * grad_accum * dp_size
    for step in (0, 1, 7):
        pieces = global_batch(step, micro_batch_size, grad_accum, dp_size)
        assert all(len(piece) == micro_batch_size for piece in pieces)
        assert sorted(i for piece in pieces for i in piece) == list(range(step * size, (step + 1) * size))


def test_micro_batch_major_then_dp_rank():
    """Like Megatron-LM's sampler: micro-batch m of rank r starts (m·dp_size + r)·micro_batch_size in."""
    assert BatchOrder(micro_batch_size=2, grad_accum=3, dp_rank=1, dp_size=4).indices(5, 2) == range(138, 140)


def test_a_step_reads_the_same_samples_in_every_layout():
    """The samples of a step depend on the step and the global batch only, not on how DP and
    gradient accumulation share it: a run resumed on another topology reads the same data."""
    layouts = [(2, 4, 1), (2, 2, 2), (2, 1, 4), (1, 8, 1)]
    for step in (0, 3):
        assert len({tuple(sorted(sum(global_batch(step, *layout), []))) for layout in layouts}) == 1


# ---------------------------------------------------------------------------- StepBatches
class Numbered:
    """A dataset of 10 samples whose tokens are all the sample's index."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> dict:
        return {"tokens": np.full(SEQ, i), "labels": np.full(SEQ, i + 1), "loss_mask": np.ones(SEQ),
                "position_ids": np.arange(SEQ)}


def test_micro_batch_stacks_the_samples_of_the_batch_order():
    batches = StepBatches({"train": Numbered(), "valid": None}, BatchOrder(2, 2, dp_rank=1, dp_size=2))
    batch = batches.micro_batch("train", 0, 1)
    assert set(batch) == {"tokens", "labels", "loss_mask"}
    assert batch["tokens"].shape == (2, SEQ) and batch["tokens"][:, 0].tolist() == [6, 7]
    assert batch["labels"][:, 0].tolist() == [7, 8]
    assert batches.micro_batch("train", 1, 1)["tokens"][:, 0].tolist() == [4, 5]  # samples 14, 15 of 10
    assert batches.has("train") and not batches.has("valid") and not batches.has("test")


def test_prefetched_batches_are_the_batches_read_in_turn():
    """Prefetching reads (step, micro)'s successor ahead; a jump (a resume, an evaluation) reads afresh."""
    order = BatchOrder(2, 3, dp_rank=0, dp_size=1)
    plain, ahead = StepBatches({"train": Numbered()}, order), StepBatches({"train": Numbered()}, order, prefetch=True)
    for step, micro in [(0, 0), (0, 1), (0, 2), (1, 0), (4, 2), (5, 0), (5, 1)]:
        expected = plain.micro_batch("train", step, micro)
        got = ahead.micro_batch("train", step, micro)
        assert all(torch.equal(got[k], expected[k]) for k in expected), (step, micro)
    assert ahead._ahead[0] == (5, 2)


def test_pipeline_iter_gives_the_micro_batches_as_the_pipeline_engine_takes_them():
    batches = StepBatches({"train": Numbered()}, BatchOrder(2, 3, dp_rank=0, dp_size=1))
    pieces = list(batches.pipeline_iter("train", 1))
    assert len(pieces) == 3
    for micro, (tokens, (labels, loss_mask)) in enumerate(pieces):
        expected = batches.micro_batch("train", 1, micro)
        assert torch.equal(tokens, expected["tokens"]) and torch.equal(labels, expected["labels"])
        assert torch.equal(loss_mask, expected["loss_mask"])


# ---------------------------------------------------------------------------- mock datasets
@pytest.fixture(scope="module")
def small_mock_corpus():
    """megatron-core's mock corpus is 100,000 documents of up to 4,096 tokens, seconds to index;
    200 of them are built and shuffled the same way."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(MockGPTLowLevelDataset, "size", 200)
        yield


@pytest.fixture(scope="module")
def mock_run():
    return tiny_run(train=TrainConfig(micro_batch_size=2, global_batch_size=4, steps=5), eval=EvalConfig(iters=3))


@pytest.fixture(scope="module")
def tokenizer(mock_run):
    return data.build_tokenizer(mock_run.data, mock_run.model.vocab_size)


@pytest.mark.slow
def test_mock_datasets_are_sized_for_the_run(mock_run, tokenizer, small_mock_corpus, tmp_path, monkeypatch):
    """Train: steps × global batch samples; valid and test: eval.iters global batches. The null tokenizer
    has model.vocab_size ids, the last one the end of document, and token ids stay below it."""
    requested = []
    builder = data.BlendedMegatronDatasetBuilder
    monkeypatch.setattr(data, "BlendedMegatronDatasetBuilder",
                        lambda cls, sizes, *args: (requested.append((cls, sizes)), builder(cls, sizes, *args))[1])
    datasets = data.build_datasets(mock_run, tokenizer, tmp_path)

    assert requested == [(MockGPTDataset, [5 * 4, 3 * 4, 3 * 4])]
    assert list(datasets) == ["train", "valid", "test"]
    for split, size in zip(datasets, requested[0][1]):
        assert isinstance(datasets[split], MockGPTDataset) and len(datasets[split]) >= size
        sample = datasets[split][size - 1]
        assert sample["tokens"].shape == (SEQ,) and torch.equal(sample["tokens"][1:], sample["labels"][:-1])
    assert tokenizer.vocab_size == VOCAB and tokenizer.eod == VOCAB - 1
    assert max(int(datasets["train"][i]["tokens"].max()) for i in range(len(datasets["train"]))) < VOCAB


def test_the_same_step_reads_the_same_batch_after_a_restart(mock_run, tokenizer, small_mock_corpus, tmp_path):
    """Datasets rebuilt by a resumed run (from its cache, or afresh) give every step the same batch;
    another data.seed shuffles otherwise."""
    def batches(cfg, cache: Path) -> StepBatches:
        return StepBatches(data.build_datasets(cfg, tokenizer, cache), BatchOrder(2, 2, dp_rank=0, dp_size=1))

    first = batches(mock_run, tmp_path / "cache")
    for resumed in (batches(mock_run, tmp_path / "cache"), batches(mock_run, tmp_path / "other_cache")):
        for split, step, micro in (("train", 3, 1), ("valid", 2, 0)):
            assert torch.equal(first.micro_batch(split, step, micro)["tokens"],
                               resumed.micro_batch(split, step, micro)["tokens"])
    assert not torch.equal(first.micro_batch("train", 3, 1)["tokens"], first.micro_batch("train", 2, 1)["tokens"])
    reseeded = batches(dataclasses.replace(mock_run, data=DataConfig(mock=True, seed=99)), tmp_path / "seed99")
    assert not torch.equal(first.micro_batch("train", 3, 1)["tokens"], reseeded.micro_batch("train", 3, 1)["tokens"])


def test_document_masking_reaches_the_batches_and_the_model(mock_run, tokenizer, small_mock_corpus, tmp_path,
                                                            one_process_group):
    """data.reset_attention_mask / reset_position_ids: megatron-core's positions and each token's document
    (the mask megatron-core's own would be, [b, s] instead of [b, 1, s, s]) are collated into the batches
    and reach the model through DeepSpeed's engine (batch_loss)."""
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    from ora_megatron.attention import visible_within_documents
    from pretrain.runtime.engine import build_engine
    from pretrain.runtime.loss import batch_loss, lm_loss

    cfg = dataclasses.replace(mock_run, data=DataConfig(mock=True, reset_attention_mask=True,
                                                        reset_position_ids=True))
    batches = StepBatches(data.build_datasets(cfg, tokenizer, tmp_path), BatchOrder(2, 2, dp_rank=0, dp_size=1),
                          extra_keys=data.document_keys(cfg.data))
    eod = tokenizer.eod
    batch = next(b for b in (batches.micro_batch("train", step, micro) for step in range(5) for micro in range(2))
                 if bool((b["tokens"][:, :-1] == eod).any()))
    row, at = (int(i) for i in (batch["tokens"][:, :-1] == eod).nonzero()[0])
    assert set(batch) == {"tokens", "labels", "loss_mask", "position_ids", "document_ids"}
    assert batch["document_ids"].shape == (2, SEQ) and batch["position_ids"][row, at + 1] == 0
    assert batch["document_ids"][row, at + 1] == batch["document_ids"][row, at] + 1
    megatron_masks = [_get_ltor_masks_and_position_ids(t, eod, True, True, False, True)[0] for t in batch["tokens"]]
    assert torch.equal(~visible_within_documents(batch["document_ids"]), torch.stack(megatron_masks))
    engine = build_engine(cfg, grad_accum=2)
    engine.module.eval()
    with torch.no_grad():
        loss = batch_loss(engine.ds_engine, batch)
        direct = lm_loss(engine.module(batch["tokens"], position_ids=batch["position_ids"],
                                       document_ids=batch["document_ids"]), (batch["labels"], batch["loss_mask"]))
        across = batch_loss(engine.ds_engine, {k: batch[k] for k in ("tokens", "labels", "loss_mask")})
    assert abs(float(loss) - float(direct)) <= 1e-5 and float(loss) != float(across)


def test_document_masking_alone_keeps_the_positions_of_the_sample(mock_run):
    """data.reset_attention_mask without reset_position_ids: the batch carries documents, not the reset
    positions they are read off (the model counts 0..s-1)."""
    cfg = dataclasses.replace(mock_run, data=DataConfig(mock=True, reset_attention_mask=True))
    assert data.document_keys(cfg.data) == ("document_ids",)
    samples = [{"tokens": np.arange(6), "labels": np.arange(6), "loss_mask": np.ones(6),
                "position_ids": np.array(positions)} for positions in ([0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5])]
    batch = data.collate(samples, [0, 1], extra_keys=data.document_keys(cfg.data))
    assert set(batch) == {"tokens", "labels", "loss_mask", "document_ids"}
    assert batch["document_ids"].tolist() == [[0, 0, 1, 1, 1, 2], [0] * 6]


# ---------------------------------------------------------------------------- indexed datasets
FAKE_TOKENIZER = SimpleNamespace(vocab_size=VOCAB)


def indexed_dataset(prefix: Path, document_lengths: list[int]) -> str:
    """A megatron-core indexed dataset (.bin/.idx) of documents of these lengths; its prefix."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(get_bin_path(str(prefix)), dtype=np.uint16)
    for length in document_lengths:
        builder.add_document(np.arange(length) % VOCAB, [length])
    builder.finalize(get_idx_path(str(prefix)))
    return str(prefix)


@pytest.fixture
def tokenizer_file(tmp_path, monkeypatch) -> str:
    """A tokenizer model file, read as FAKE_TOKENIZER (check_data's own checks need no sentencepiece)."""
    path = tmp_path / "sp.model"
    path.write_bytes(b"a tokenizer")
    monkeypatch.setattr(data, "build_tokenizer", lambda data_config, vocab_size: FAKE_TOKENIZER)
    return str(path)


def with_data(**data_config):
    return tiny_run(data=DataConfig(**data_config))


def write_manifest(root: Path, tokenizer: str, splits=("train", "valid", "test"), **tokenizer_record) -> str:
    """A data_tools manifest of one 10-document dataset per split, as build_shards writes it."""
    datasets, blend = [], {}
    for split in splits:
        prefix = indexed_dataset(root / f"web-{split}-00000", [20] * 10)
        datasets.append({"prefix": Path(prefix).name, "documents": 10,
                         "bin_bytes": Path(prefix + ".bin").stat().st_size,
                         "idx_bytes": Path(prefix + ".idx").stat().st_size})
        blend[split] = {"prefixes": [Path(prefix).name], "weights": [1.0]}
    record = {"path": tokenizer, "sha256": sha256_file(tokenizer), "vocab_size": VOCAB, **tokenizer_record}
    (root / "manifest.json").write_text(json.dumps({"tokenizer": record, "datasets": datasets, "blend": blend}))
    return str(root / "manifest.json")


def test_dataset_config_of_each_data_source(tmp_path):
    """mock and blend: cut by data.split; train_blend: a blend per split (an empty one: no such split)."""
    mock = data.dataset_config(DataConfig(mock=True, split="90,5,5", seed=7, eod_mask_loss=True), SEQ,
                               FAKE_TOKENIZER, tmp_path)
    assert (mock.blend, mock.blend_per_split, mock.random_seed, mock.sequence_length) == (None, None, 7, SEQ)
    assert mock.eod_mask_loss and mock.path_to_cache == str(tmp_path)

    a, b = indexed_dataset(tmp_path / "a", [20] * 10), indexed_dataset(tmp_path / "b", [20] * 10)
    blend = data.dataset_config(DataConfig(blend=[BlendEntry(a, 3.0), BlendEntry(b)], split="90,5,5"),
                                SEQ, FAKE_TOKENIZER, tmp_path)
    assert (blend.blend, blend.blend_per_split, blend.split) == (([a, b], [3.0, 1.0]), None, "90,5,5")

    per_split = data.dataset_config(DataConfig(train_blend=[BlendEntry(a)], valid_blend=[BlendEntry(b, 2.0)]),
                                    SEQ, FAKE_TOKENIZER, tmp_path)
    assert per_split.blend is None and per_split.blend_per_split == [([a], [1.0]), ([b], [2.0]), None]


def test_dataset_config_of_a_manifest(tmp_path, tokenizer_file):
    """Built with --split: the manifest's blend per split; without: its one blend cut by data.split."""
    split = data.dataset_config(DataConfig(manifest=write_manifest(tmp_path / "split", tokenizer_file)),
                                SEQ, FAKE_TOKENIZER, tmp_path)
    assert split.blend is None
    assert [prefixes for prefixes, _ in split.blend_per_split] == [
        [str(tmp_path / "split" / f"web-{name}-00000")] for name in ("train", "valid", "test")]
    whole = data.dataset_config(DataConfig(manifest=write_manifest(tmp_path / "whole", tokenizer_file, ["train"]),
                                          split="80,10,10"), SEQ, FAKE_TOKENIZER, tmp_path)
    assert whole.blend == ([str(tmp_path / "whole" / "web-train-00000")], [1.0]) and whole.split == "80,10,10"


def test_a_manifest_of_matching_files_and_tokenizer_passes(tmp_path, tokenizer_file, capsys):
    data.check_data(with_data(manifest=write_manifest(tmp_path, tokenizer_file)))
    assert capsys.readouterr().err == ""


def test_mock_data_is_not_checked(monkeypatch):
    monkeypatch.setattr(data, "build_tokenizer", lambda *args: pytest.fail("mock data needs no tokenizer check"))
    data.check_data(with_data(mock=True, tokenizer="/no/such/tokenizer.model"))


def refusal(cfg) -> ConfigError:
    with pytest.raises(ConfigError) as refused:
        data.check_data(cfg)
    return refused.value


def test_tokenizer_refusals(tmp_path, tokenizer_file):
    dataset = [BlendEntry(indexed_dataset(tmp_path / "a", [20] * 10))]
    error = refusal(with_data(blend=dataset))
    assert error.key == "data.tokenizer" and "a sentencepiece model is needed" in str(error)
    error = refusal(with_data(blend=dataset, tokenizer=str(tmp_path / "gone.model")))
    assert error.key == "data.tokenizer" and f"no tokenizer model at {tmp_path / 'gone.model'}" in str(error)
    error = refusal(dataclasses.replace(with_data(blend=dataset, tokenizer=tokenizer_file),
                                        model=dataclasses.replace(tiny_run().model, vocab_size=VOCAB - 1)))
    assert error.key == "model.vocab_size" and f"{VOCAB - 1} is smaller than the tokenizer's {VOCAB} ids" in str(error)


@pytest.mark.parametrize("record, differs", [({"vocab_size": VOCAB + 1}, f"vocab size {VOCAB} vs {VOCAB + 1}"),
                                             ({"sha256": "0" * 64}, "sha256")], ids=["vocab", "sha256"])
def test_another_tokenizer_than_the_manifests_is_refused(tmp_path, tokenizer_file, record, differs):
    error = refusal(with_data(manifest=write_manifest(tmp_path, tokenizer_file, **record)))
    assert error.key == "data.tokenizer" and "is not the tokenizer the shards of" in str(error)
    assert differs in str(error)


def test_a_shard_unlike_its_manifest_entry_is_refused(tmp_path, tokenizer_file):
    manifest = write_manifest(tmp_path, tokenizer_file)
    bin_file = tmp_path / "web-valid-00000.bin"
    bin_file.write_bytes(bin_file.read_bytes()[:-2])
    error = refusal(with_data(manifest=manifest))
    assert error.key == "data.manifest" and f"{bin_file} has 398 bytes, 400 recorded" in str(error)


def test_missing_dataset_is_refused(tmp_path, tokenizer_file):
    error = refusal(with_data(blend=[BlendEntry(str(tmp_path / "nope"))], tokenizer=tokenizer_file))
    assert error.key == "data.blend" and f"no indexed dataset at {tmp_path / 'nope'} (.bin/.idx)" in str(error)


def test_a_split_without_documents_is_refused(tmp_path, tokenizer_file):
    """Ten documents cut 98/1/1: the valid split rounds to none (megatron-core would loop forever)."""
    prefix = indexed_dataset(tmp_path / "a", [20] * 10)
    error = refusal(with_data(blend=[BlendEntry(prefix)], split="98,1,1", tokenizer=tokenizer_file))
    assert error.key == "data.blend" and "the valid split" in str(error) and "none of its 10 documents" in str(error)
    per_split = with_data(train_blend=[BlendEntry(prefix)], valid_blend=[BlendEntry(prefix)], tokenizer=tokenizer_file)
    data.check_data(per_split)  # a per-split blend reads every document of its datasets


def test_a_split_shorter_than_one_sample_is_warned_about(tmp_path, tokenizer_file, capsys):
    """Ten documents cut 60/20/20: train holds 120 tokens, valid and test 4, fewer than 16 + 1."""
    prefix = indexed_dataset(tmp_path / "a", [20] * 6 + [2] * 4)
    data.check_data(with_data(blend=[BlendEntry(prefix)], split="60,20,20", tokenizer=tokenizer_file))
    warnings = capsys.readouterr().err.splitlines()
    assert [line.split(" split")[0] for line in warnings] == ["warning: the valid", "warning: the test"]
    assert "holds 4 tokens, fewer than one sample (model.seq_length + 1 = 17)" in warnings[0]
