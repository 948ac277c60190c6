"""data_tools.probe_tasks and pretrain.research.probes: each task's answers are what the task
defines, the shards read back as the generated examples (and train as whole examples through the
run's datasets), answer scoring, bad options, and the evaluation of a trained run."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy
import pytest
import sentencepiece
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset
from one_process import tiny_run

from data_tools import probe_tasks
from data_tools.manifest import blend_from_manifest
from data_tools.probe_tasks import BOS, EOD, PAD, QUERY, SEP, ProbeOptions, generate, task_for
from pretrain.config.loop_sections import EvalConfig, TrainConfig
from pretrain.config.runtime_sections import DataConfig
from pretrain.research import probes
from pretrain.research.probes import AnswerCounts
from pretrain.runtime import data

SEQ, VOCAB = 16, 24  # 18 symbols: recall keys 9, values 9; retrieval keys, values, filler 6 each


def examples(task: str, count: int = 64, **options):
    probe = task_for(ProbeOptions(task=task, out="unused", seq_length=SEQ, vocab=VOCAB, **options))
    return probe, generate(probe, 7, "train", count)


@pytest.mark.parametrize("task, expected", [("copy", lambda x: x), ("sort", sorted)])
def test_copy_and_sort_answers_follow_the_string(task, expected):
    probe, documents = examples(task, length=5)
    assert probe.answer_positions() == [7, 8, 9, 10, 11]
    for document in documents:
        string = list(document[1:6])
        assert document[0] == BOS and document[6] == SEP and document[-1] == EOD
        assert list(document[probe.answer_positions()]) == list(expected(string))
        assert list(document[12:-1]) == [PAD] * 3 and min(string) >= probe_tasks.FIRST_SYMBOL
    assert len({tuple(d[1:6]) for d in documents}) > 1


def test_associative_recall_answers_are_the_stored_values():
    probe, documents = examples("associative_recall", pairs=3, queries=2)
    assert probe.answer_positions() == [9, 11]
    first_value = probe.answer_alphabet()[0]
    for document in documents:
        keys, values = list(document[1:7:2]), list(document[2:7:2])
        assert len(set(keys)) == 3 and max(keys) < first_value <= min(values)
        assert document[7] == SEP and document[-1] == EOD
        queried = [document[p - 1] for p in probe.answer_positions()]
        assert len(set(queried)) == 2 and set(queried) <= set(keys)
        stored = dict(zip(keys, values))
        assert [document[p] for p in probe.answer_positions()] == [stored[k] for k in queried]


def retrieval_distances(probe, document) -> list[int]:
    """Per answer: its distance from the one occurrence of its key before <query>; asserts the
    answer is the value stored right after that key."""
    distances = []
    for position in probe.answer_positions():
        where = numpy.flatnonzero(document[1:probe.first_answer - 2] == document[position - 1]) + 1
        assert len(where) == 1, "a key occurs once before <query>"
        assert document[position] == document[where[0] + 1]
        distances.append(position - int(where[0]))
    return distances


def test_long_range_retrieval_answers_are_the_queried_values_far_from_their_keys():
    probe, documents = examples("long_range_retrieval", pairs=2, queries=2, min_distance=7)
    assert probe.answer_positions() == [12, 14]
    for document in documents:
        assert (document[0], document[10], document[-1]) == (BOS, QUERY, EOD)
        assert len(set(document[[11, 13]])) == 2, "distinct keys are queried"
        assert min(retrieval_distances(probe, document)) >= 7
    assert len({tuple(numpy.flatnonzero(d[1:10] < probe.answer_alphabet()[0])) for d in documents}) > 1, "keys move"


def test_the_default_distance_is_half_the_sequence():
    probe = task_for(ProbeOptions(task="long_range_retrieval", out="unused"))
    assert (probe.pairs, probe.queries, probe.min_distance) == (4, 3, probe.seq_length // 2)
    documents = generate(probe, 1, "valid", 200)
    assert min(min(retrieval_distances(probe, d)) for d in documents) >= probe.seq_length // 2


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("probe")
    options = ProbeOptions(task="associative_recall", out=str(out), examples=40, eval_examples=6, seq_length=SEQ,
                           vocab=VOCAB, seed=3, pairs=3, queries=2)  # 13 tokens and 2 pads
    return options, probe_tasks.write_probe(options)


def test_shards_read_back_as_the_generated_examples(written):
    options, manifest = written
    task = task_for(options)
    blends = blend_from_manifest(options.out)
    for split, count in (("train", 40), ("valid", 6), ("test", 6)):
        (prefix,), _ = blends[split]
        dataset = IndexedDataset(prefix)
        stored = numpy.stack([dataset[i] for i in range(len(dataset))])
        assert numpy.array_equal(stored, generate(task, 3, split, count))
        assert numpy.array_equal(probe_tasks.read_examples(options.out, split, 4), stored[:4])
    probe = manifest["probe"]
    assert (probe["task"], probe["parameters"], probe["answer_positions"]) == (
        "associative_recall", {"pairs": 3, "queries": 2}, [9, 11])
    assert probe["chance_token_accuracy"] == pytest.approx(1 / 9) and probe["seed"] == 3
    tokenizer = sentencepiece.SentencePieceProcessor(model_file=manifest["tokenizer"]["path"])
    assert (tokenizer.vocab_size(), tokenizer.eos_id(), tokenizer.pad_id()) == (VOCAB, EOD, PAD)
    assert tokenizer.decode([BOS, 6, 15, SEP, 6, 15, EOD]) == "0 9<sep> 0 9"


def test_training_samples_are_whole_examples(written, tmp_path):
    """What the run trains on (its own dataset builder, after its data checks): every sample's inputs
    are one example (megatron-core feeds <pad> as id 0) and its labels that example shifted by one,
    then the next example's <s>; <pad> labels carry no loss."""
    options, _ = written
    cfg = tiny_run(train=TrainConfig(micro_batch_size=2, global_batch_size=2, steps=50), eval=EvalConfig(iters=2),
                   data=DataConfig(manifest=options.out))
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, seq_length=SEQ, vocab_size=VOCAB))
    data.check_data(cfg)
    train = data.build_datasets(cfg, data.build_tokenizer(cfg.data, cfg.model.vocab_size), tmp_path)["train"]
    generated = generate(task_for(options), options.seed, "train", options.examples)
    as_fed = {tuple(numpy.where(row == PAD, 0, row)): row for row in generated}
    assert len(train) >= 100
    for index in range(len(train)):
        sample = train[index]
        example = as_fed[tuple(sample["tokens"].tolist())]
        labels, loss_mask = sample["labels"].numpy(), sample["loss_mask"].numpy()
        assert numpy.array_equal(labels[:-1], numpy.where(example[1:] == PAD, 0, example[1:])) and labels[-1] == BOS
        assert numpy.array_equal(loss_mask[:-1] == 0, example[1:] == PAD) and loss_mask[-1] == 1


def test_exact_match_scores_the_answer_positions_only():
    tokens = torch.tensor([[1, 6, 7, 8, 9, 2], [1, 6, 7, 8, 9, 2], [1, 6, 7, 8, 9, 2]])
    logits = torch.full((3, 6, 12), -5.0)
    logits[:, torch.arange(5), tokens[0, 1:]] = 5.0  # every next token predicted
    logits[1, 3, 10] = 9.0  # example 1: one answer token wrong
    logits[2, 0, 11] = 9.0  # example 2: a wrong token before the answer span
    counts = AnswerCounts()
    counts.add(logits[:2], tokens[:2], [3, 4])
    counts.add(logits[2:], tokens[2:], [3, 4])
    summary = counts.summary()
    assert (counts.examples, counts.exact, counts.answer_tokens, counts.correct_tokens) == (3, 2, 6, 5)
    assert summary["answer_accuracy"] == pytest.approx(2 / 3)
    assert summary["answer_token_accuracy"] == pytest.approx(5 / 6)
    right = math.log1p(11 * math.exp(-10))  # target at 5, the 11 others at -5
    wrong = math.log(math.exp(9) + math.exp(5) + 10 * math.exp(-5)) - 5
    assert summary["answer_loss"] == pytest.approx((5 * right + wrong) / 6)


@pytest.mark.parametrize("argv, message", [
    (["--task", "copy", "--length", "7"], "--length 7: 2·length + 3 tokens do not fit --seq-length 16"),
    (["--task", "copy", "--pairs", "2"], "--pairs does not apply to --task copy"),
    (["--task", "associative_recall", "--pairs", "2", "--queries", "3"], "--queries 3 exceeds --pairs 2"),
    (["--task", "associative_recall", "--pairs", "10"], "--pairs 10: keys are distinct"),
    (["--task", "long_range_retrieval", "--min-distance", "13"], "--min-distance 13 with --pairs 4"),
    (["--task", "sort", "--vocab", "7"], "--vocab must be >= 8"),
    (["--task", "sort", "--examples", "0"], "--examples must be >= 1"),
    (["--task", "recall"], "argument --task: invalid choice"),
])
def test_bad_options_exit_2_naming_the_option(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        probe_tasks.main([*argv, "--out", str(tmp_path / "out"), "--seq-length", str(SEQ)])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_probe_evaluation_of_a_trained_run(trained_runs, tmp_path, capsys):
    """The session's tiny run (mock data, seq_length 32) scored on a probe of its length."""
    run = trained_runs.copy(tmp_path / "run")
    out = tmp_path / "copy"
    probe_tasks.write_probe(ProbeOptions(task="copy", out=str(out), examples=4, eval_examples=5))
    assert probes.main(["--run-dir", str(run), "--manifest", str(out), "--examples", "3"]) == 0
    record = json.loads((run / "evaluations" / "probe.json").read_text())
    assert (record["name"], record["task"], record["checkpoint"], record["examples"]) == (
        "probe", "copy", "step00000006", 3)
    assert set(record["summary"]) == set(record["higher_is_better"]) == {
        "answer_accuracy", "answer_token_accuracy", "answer_loss"}
    assert record["answer_tokens"] == 24 and record["chance_token_accuracy"] == pytest.approx(1 / 18)
    assert 0 <= record["summary"]["answer_token_accuracy"] <= 1 and record["summary"]["answer_loss"] > 0
    assert "exact match" in capsys.readouterr().out

    assert probes.main(["--run-dir", str(run)]) == 2  # mock data: no probe manifest
    assert "--manifest" in capsys.readouterr().err
