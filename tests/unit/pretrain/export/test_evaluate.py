"""pretrain.export.evaluate: lm-evaluation-harness on an export, end to end on a local multiple-choice task, its
numbers checked against the model's own log-probabilities; and what it refuses, offline, without a network."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from data_fixtures import word_tokenizer
from network_guard import no_network

from ora_megatron.model_config import AttentionConfig, ModelConfig
from pretrain.checkpoint.consolidate import MODULE, Consolidated, reference_model
from pretrain.config.run_config import RunConfig
from pretrain.export.convert_to_hf import write_export
from pretrain.export.evaluate import main
from pretrain.export.export_record import write_export_record
from pretrain.job.environment import HUB_OFFLINE_ENVIRONMENT

WORDS = "the cat dog sat ran on a mat log red blue big small and it was".split()
TASK = "ora_tiny_choice"
DOCS = [
    {"context": "the cat sat on the", "choices": ["mat", "log", "red dog"], "answer": 0},
    {"context": "a big dog ran", "choices": ["on a log", "blue", "and it was small"], "answer": 2},
    {"context": "it was red and", "choices": ["big", "small cat"], "answer": 1},
    {"context": "the small dog", "choices": ["sat", "ran on the mat", "was blue", "log"], "answer": 3},
]


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch):
    """This process as `python -m pretrain.export.evaluate` starts: the hub off (the libraries read the flag at
    import, and this process may have imported them already), and no LOCAL_RANK, which a one-process group
    of an earlier test leaves set (ora_megatron.parallel) and accelerate would take for a distributed launch."""
    import datasets
    import huggingface_hub

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    for key, value in HUB_OFFLINE_ENVIRONMENT.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> tuple[Path, Path]:
    """(export dir, its run dir): an untrained ORA gpt2 and a small sentencepiece tokenizer, written by the
    export's own writer (weights, config, tokenizer) with a record naming a run and a checkpoint."""
    root = tmp_path_factory.mktemp("evaluate")
    tokenizer = word_tokenizer(root, WORDS, vocab_size=300, words_per_line=20)
    cfg = RunConfig(model=ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=32,
                                      vocab_size=300, make_vocab_size_divisible_by=8, hidden_dropout=0.0,
                                      attention_dropout=0.0, seed=3, attention=AttentionConfig(type="ora")))
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("LOCAL_RANK", raising=False)  # restored afterwards: building the model sets it
        state = reference_model(cfg.model).state_dict()
    out, run_dir = root / "hf", root / "run"
    out.mkdir()
    write_export(cfg.model, Consolidated(state, MODULE, torch.float32, []), out, "fp32", str(tokenizer),
                 card="An untrained model for the tests.\n")
    write_export_record(out, {"run_dir": str(run_dir), "checkpoint": "step00000000", "dtype": "fp32", "files": []})
    return out, run_dir


@pytest.fixture
def task_dir(tmp_path) -> Path:
    """A multiple-choice lm-eval task over a local jsonl (its datasets cache in tmp_path too)."""
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    task = {"task": TASK, "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(data)}, "cache_dir": str(tmp_path / "datasets")},
            "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "{{context}}",
            "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}",
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / f"{TASK}.yaml").write_text(yaml.safe_dump(task))
    return tmp_path / "tasks"


def continuation_logprob(model, tokenizer, context: str, continuation: str) -> float:
    """Σ log p(continuation tokens | context), the continuation's tokens being those the whole text has
    after the context's."""
    whole = tokenizer(context + continuation)["input_ids"]
    start = len(tokenizer(context)["input_ids"])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([whole])).logits[0].double(), dim=-1)
    return sum(logprobs[i - 1, whole[i]].item() for i in range(start, len(whole)))


@pytest.mark.slow  # lm-eval's import and task machinery: seconds of CPU
def test_local_task_end_to_end(export, task_dir, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf, run_dir = export
    with no_network() as attempts:
        code = main(["--hf", str(hf), "--tasks", TASK, "--include-path", str(task_dir), "--run-dir", str(run_dir),
                     "--device", "cpu", "--batch-size", "2", "--log-samples"])
    assert (code, attempts) == (0, [])
    record = json.loads((run_dir / "evaluations" / "downstream.json").read_text())
    assert (record["name"], record["checkpoint"]) == ("downstream", "step00000000")
    assert record["higher_is_better"] == {f"{TASK}/acc": True}

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(hf)
    samples = sorted(record["details"]["samples"][TASK], key=lambda s: s["doc_id"])
    assert [s["doc"] for s in samples] == DOCS
    correct = []
    for doc, sample in zip(DOCS, samples):
        reported = [resp[0] for resp in sample["filtered_resps"]]
        expected = [continuation_logprob(model, tokenizer, doc["context"], " " + c) for c in doc["choices"]]
        assert sample["arguments"] == [[doc["context"], " " + c] for c in doc["choices"]]
        assert reported == pytest.approx(expected, abs=1e-4)
        correct.append(max(range(len(expected)), key=expected.__getitem__) == doc["answer"])
    assert record["summary"] == {f"{TASK}/acc": pytest.approx(sum(correct) / len(DOCS))}
    assert f"{TASK}/acc: " in capsys.readouterr().out


@pytest.mark.slow  # lm-eval indexes its ~14,700 built-in tasks
def test_standard_task_without_cache_is_one_clear_error(export, tmp_path, monkeypatch, capsys):
    """No network and an empty datasets cache: the task is named, the way out said, before any model loads."""
    import datasets
    import huggingface_hub

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "empty_datasets_cache"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty_hub_cache"))
    hf, _ = export
    with no_network() as attempts:
        code = main(["--hf", str(hf), "--tasks", "arc_easy", "--out", str(tmp_path / "out.json")])
    err = capsys.readouterr().err
    assert (code, attempts) == (2, [])
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("error: task 'arc_easy': its data is not in the local Hugging Face cache")
    assert "--online" in err and "HF_DATASETS_CACHE" in err
    assert not (tmp_path / "out.json").exists()


def test_refusals_before_lm_eval_runs(export, tmp_path, capsys):
    hf, _ = export
    out = ["--out", str(tmp_path / "out.json")]
    for args, message in (
        (["--hf", str(hf), "--run-dir", str(tmp_path)], f"is an export of {hf.parent / 'run'}, not of --run-dir"),
        (["--hf", str(tmp_path / "nothing"), *out], "not a directory written by pretrain.export.convert_to_hf"),
        (["--hf", str(hf), "--limit", "0", *out], "--limit must be at least 1"),
        (["--hf", str(hf), *out, "--tasks", " , "], "names no task"),
    ):
        assert main(args) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists() and not (tmp_path / "evaluations").exists()
