"""Evaluator: validation every eval_interval steps and at the last step, on the same fixed batches;
early stopping after `patience` evaluations without an improvement of min_delta; the test loss; each
data source's loss beside the blend's."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from model_fixtures import SEQ, tiny_model
from one_process import tiny_run

from data_tools.manifest import load_manifest
from pretrain.checkpoint.checkpointer import TrainState
from pretrain.config.loop_sections import EarlyStopping, EvalConfig, TrainConfig
from pretrain.config.runtime_sections import BlendEntry, DataConfig
from pretrain.run_files.run_dir import RunDir
from pretrain.run_files.run_records import EvalRecord
from pretrain.runtime.data import BatchOrder, StepBatches, build_datasets, build_tokenizer
from pretrain.runtime.engine import build_engine
from pretrain.runtime.loss import batch_loss
from pretrain.runtime.metrics import MetricsLogger
from pretrain.training.evaluator import Evaluator

GRAD_ACCUM = 2
BATCHES = {"micro_batch_size": 1, "global_batch_size": GRAD_ACCUM}  # one data-parallel rank


pytestmark = pytest.mark.usefixtures("one_process_group")  # conftest.py: one gloo rank


@pytest.fixture(scope="module")
def train_engine():
    return build_engine(tiny_run("vanilla", train=TrainConfig(**BATCHES)), grad_accum=GRAD_ACCUM)


def split_samples(seed: int, count: int = 16) -> list[dict]:
    """`count` samples of random tokens: a stand-in for a split's GPTDataset."""
    tokens = torch.randint(0, 100, (count, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return [{"tokens": t[:-1], "labels": t[1:], "loss_mask": torch.ones(SEQ)} for t in tokens]


def evaluator(tmp_path, *, splits=("train", "valid", "test"), early_stopping: EarlyStopping | None = None,
              **train) -> Evaluator:
    """An Evaluator over `splits` (the others absent) logging to tmp_path's metrics.jsonl."""
    train = {**BATCHES, "steps": 10, "eval_interval": 3, **train}
    evaluation = EvalConfig(iters=2, early_stopping=early_stopping or EarlyStopping())
    cfg = tiny_run("vanilla", train=TrainConfig(**train), eval=evaluation)
    datasets = {split: split_samples(seed) if split in splits else None
                for seed, split in enumerate(("train", "valid", "test"))}
    batches = StepBatches(datasets, BatchOrder(micro_batch_size=1, grad_accum=GRAD_ACCUM, dp_rank=0, dp_size=1))
    return Evaluator(cfg, batches, MetricsLogger(RunDir(tmp_path), cfg, {}, start_step=0))


def scripted(evaluator: Evaluator, monkeypatch, losses) -> None:
    """Make the evaluator's validation losses `losses`, in order."""
    pending = iter(losses)
    monkeypatch.setattr(evaluator, "loss", lambda train_engine, split: next(pending))


def records(tmp_path, split: str) -> list[EvalRecord]:
    return RunDir(tmp_path).read_records(split)


def test_loss_is_the_mean_over_eval_iters_fixed_batches(train_engine, tmp_path):
    """eval.iters global batches of the split, the same at every evaluation whatever the step;
    without a gradient, and the engine is left in training mode."""
    ev = evaluator(tmp_path)
    with torch.no_grad():
        train_engine.ds_engine.eval()
        expected = torch.stack([batch_loss(train_engine.ds_engine, ev.batches.micro_batch("valid", i, m))
                                for i in range(2) for m in range(GRAD_ACCUM)]).mean().item()
    train_engine.ds_engine.train()

    for step in (3, 6):
        assert ev.after_step(train_engine, TrainState(step=step)) is False
    assert train_engine.ds_engine.training and all(p.grad is None for p in train_engine.module.parameters())
    assert [r.loss for r in records(tmp_path, "valid")] == [pytest.approx(expected, rel=1e-6)] * 2
    assert ev.last_valid_loss == pytest.approx(expected, rel=1e-6)
    assert ev.loss(train_engine, "test") != pytest.approx(expected)  # another split's batches


def test_validates_every_eval_interval_and_at_the_last_step(train_engine, tmp_path, monkeypatch):
    ev = evaluator(tmp_path, steps=10, eval_interval=3)
    scripted(ev, monkeypatch, [5.0, 4.0, 3.0, 2.0])
    for step in range(1, 11):
        ev.after_step(train_engine, TrainState(step=step))
    assert [(r.step, r.loss) for r in records(tmp_path, "valid")] == [(3, 5.0), (6, 4.0), (9, 3.0), (10, 2.0)]
    assert ev.last_valid_loss == 2.0


# Validation losses and, after each, (best so far, evaluations without improvement, stop?) with
# patience 2 and min_delta 0.1: an improvement is a loss below the best minus 0.1.
PLATEAU = [
    (5.0, 5.0, 0, False),
    (4.95, 5.0, 1, False),  # better, by less than min_delta
    (4.85, 4.85, 0, False),  # below 5.0 - 0.1: an improvement resets the count
    (4.80, 4.85, 1, False),
    (4.75, 4.85, 2, True),  # exactly best - min_delta is no improvement: patience reached
]


@pytest.mark.parametrize("enabled", [True, False], ids=["enabled", "disabled"])
def test_early_stopping_after_patience_evaluations_without_improvement(train_engine, tmp_path, monkeypatch, enabled):
    ev = evaluator(tmp_path, eval_interval=1, steps=100,
                   early_stopping=EarlyStopping(enabled=enabled, patience=2, min_delta=0.1))
    scripted(ev, monkeypatch, [loss for loss, *_ in PLATEAU])
    state = TrainState()
    for step, (_, best, without, stop) in enumerate(PLATEAU, start=1):
        state.step = step
        assert ev.after_step(train_engine, state) is (stop and enabled)
        assert (state.best_valid_loss, state.evals_without_improvement) == (best, without)


def test_early_stopping_counts_continue_from_the_train_state(train_engine, tmp_path, monkeypatch):
    """A resumed run's counters come from its checkpoint's train state."""
    ev = evaluator(tmp_path, eval_interval=1, early_stopping=EarlyStopping(enabled=True, patience=3, min_delta=0.0))
    scripted(ev, monkeypatch, [4.0])
    assert ev.after_step(train_engine, TrainState(step=4, best_valid_loss=3.0, evals_without_improvement=2)) is True


def test_test_loss_is_logged_at_the_step_it_is_given(train_engine, tmp_path):
    ev = evaluator(tmp_path)
    loss = ev.test(train_engine, 10)
    assert loss == ev.loss(train_engine, "test") and loss > 0
    assert [(r.step, r.loss) for r in records(tmp_path, "test")] == [(10, loss)]
    assert records(tmp_path, "valid") == []


def test_a_run_without_valid_or_test_split_evaluates_nothing(train_engine, tmp_path):
    ev = evaluator(tmp_path, splits=("train",))
    state = TrainState(step=3)
    assert ev.after_step(train_engine, state) is False and ev.last_valid_loss is None
    assert ev.test(train_engine, 10) is None
    assert records(tmp_path, "valid") == records(tmp_path, "test") == []
    assert state == dataclasses.replace(TrainState(), step=3)


# ---------------------------------------------------------------------------- per source
TWO_SOURCES = ("RedPajamaC4", "RedPajamaCommonCrawl")


def two_source_manifest(shards, folder):
    """The suite's shards (seven sources) restricted to two, as a manifest of their own (absolute prefixes)."""
    manifest = load_manifest(str(shards))
    source_of = {entry["prefix"]: entry["source"] for entry in manifest["datasets"]}
    manifest["datasets"] = [{**entry, "prefix": str(shards / entry["prefix"])} for entry in manifest["datasets"]
                            if entry["source"] in TWO_SOURCES]
    for split, blend in manifest["blend"].items():
        kept = [(str(shards / p), w) for p, w in zip(blend["prefixes"], blend["weights"])
                if source_of[p] in TWO_SOURCES]
        total = sum(w for _, w in kept)
        manifest["blend"][split] = {"prefixes": [p for p, _ in kept], "weights": [w / total for _, w in kept]}
    path = folder / "manifest.json"
    path.write_text(json.dumps(manifest))
    return path, manifest


def test_each_source_loss_equals_that_source_evaluated_alone(shards, tmp_path):
    """A manifest of two sources: each source's reported loss is the loss of a run whose validation blend
    is that source's datasets alone (same batches, same model), and the record carries them."""
    manifest_file, manifest = two_source_manifest(shards, tmp_path)
    train = TrainConfig(**BATCHES, steps=10, eval_interval=3)
    cfg = tiny_run("vanilla", model=dataclasses.replace(tiny_model("vanilla"), vocab_size=400), train=train,
                   eval=EvalConfig(iters=2),
                   data=DataConfig(manifest=str(manifest_file)))
    engine = build_engine(cfg, grad_accum=GRAD_ACCUM)
    order = BatchOrder(micro_batch_size=1, grad_accum=GRAD_ACCUM, dp_rank=0, dp_size=1)
    datasets = build_datasets(cfg, build_tokenizer(cfg.data, cfg.model.vocab_size), tmp_path / "cache")
    assert sorted(datasets) == sorted(["train", "valid", "test", *(f"{split}:{source}" for split in ("valid", "test")
                                                                  for source in TWO_SOURCES)])
    logger = MetricsLogger(RunDir(tmp_path), cfg, {}, start_step=0)
    blended = Evaluator(cfg, StepBatches(datasets, order), logger)
    blended.after_step(engine, TrainState(step=3))
    by_source = blended.last_valid_loss_by_source
    assert sorted(by_source) == sorted(TWO_SOURCES)
    record = records(tmp_path, "valid")[-1]
    assert record.sources == by_source and record.loss == blended.last_valid_loss
    source_of = {entry["prefix"]: entry["source"] for entry in manifest["datasets"]}
    tokenizer = manifest["tokenizer"]["path"]
    for source in TWO_SOURCES:
        def entries(split, only=source):
            blend = manifest["blend"][split]
            return [BlendEntry(p, w) for p, w in zip(blend["prefixes"], blend["weights"]) if source_of[p] == only]
        alone = dataclasses.replace(cfg, data=DataConfig(
            train_blend=[BlendEntry(p, w) for p, w in zip(*manifest["blend"]["train"].values())],
            valid_blend=entries("valid"), test_blend=entries("test"), tokenizer=tokenizer))
        alone_datasets = build_datasets(alone, build_tokenizer(alone.data, alone.model.vocab_size), tmp_path / "cache")
        assert Evaluator(alone, StepBatches(alone_datasets, order), logger).loss(engine, "valid") == by_source[source]
