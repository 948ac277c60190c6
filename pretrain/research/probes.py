"""Answer accuracy of a run trained on a probe task (data_tools.probe_tasks).

    python -m pretrain.research.probes --run-dir RUN [--checkpoint TAG] [--split valid|test|train]
        [--examples N] [--manifest PATH] [--batch-size B]

Reads the split's examples back from the probe's shards by document index (the order they were
generated in; the training data's sample order is shuffled), runs the run's model (checkpoint TAG,
default the latest, consolidated to fp32 in this process) on each whole example in one
teacher-forced forward, and scores only the answer positions the manifest's "probe" section
records. An example is correct when every answer token is the argmax prediction (exact match).

Writes RUN/evaluations/probe.json: summary {answer_accuracy (exact match), answer_token_accuracy,
answer_loss (mean cross-entropy of the answer tokens, nats)}, with the task, its chance level
(chance_accuracy, chance_token_accuracy: uniform guessing over the answer alphabet), the split and
the counts. The manifest is the run's data.manifest (relative to the directory the run was started
from) unless --manifest names it.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from data_tools.manifest import SPLITS, load_manifest, manifest_path
from data_tools.probe_tasks import read_examples
from data_tools.readers import DataError
from pretrain.checkpoint.consolidate import CheckpointMismatch, load_trained_model, tp1_parallel_state
from pretrain.checkpoint.unpickling import UnsafeCheckpointFile
from pretrain.config.run_config import read_run_config
from pretrain.run_files.run_dir import RunDir

NAME = "probe"
EXIT_ERROR = 2
HIGHER_IS_BETTER = {"answer_accuracy": True, "answer_token_accuracy": True, "answer_loss": False}


class ProbeError(ValueError):
    """The run or its data cannot be probed; nothing was written."""


@dataclass
class AnswerCounts:
    """Running sums over batches of examples, scored at their answer positions only."""

    examples: int = 0
    exact: int = 0
    answer_tokens: int = 0
    correct_tokens: int = 0
    loss_sum: float = 0.0

    def add(self, logits: torch.Tensor, tokens: torch.Tensor, answer_positions: Sequence[int]) -> None:
        """logits [n, L, V] of the inputs tokens [n, L]: logits[:, t] predicts tokens[:, t + 1]."""
        positions = torch.as_tensor(answer_positions)
        predicted = logits[:, positions - 1].float()
        targets = tokens[:, positions]
        correct = predicted.argmax(-1) == targets
        self.examples += tokens.size(0)
        self.exact += int(correct.all(dim=1).sum())
        self.answer_tokens += correct.numel()
        self.correct_tokens += int(correct.sum())
        self.loss_sum += float(F.cross_entropy(predicted.transpose(1, 2), targets, reduction="sum"))

    def summary(self) -> dict[str, float]:
        return {"answer_accuracy": self.exact / self.examples,
                "answer_token_accuracy": self.correct_tokens / self.answer_tokens,
                "answer_loss": self.loss_sum / self.answer_tokens}


def probe_manifest(path: Optional[str]) -> tuple[str, dict]:
    """(manifest file, its "probe" section); ProbeError when there is none."""
    if path is None:
        raise ProbeError("the run was trained on no data manifest: name the probe's with --manifest")
    file = manifest_path(path)
    if not os.path.isfile(file):
        raise ProbeError(f"no manifest at {file} (a path relative to where the run started?): name it with --manifest")
    probe = load_manifest(file).get("probe")
    if probe is None:
        raise ProbeError(f"{file} is not a probe task's manifest (python -m data_tools.probe_tasks writes those)")
    return file, probe


def evaluate(run: RunDir, tag: Optional[str] = None, split: str = "valid", limit: Optional[int] = None,
             manifest: Optional[str] = None, batch_size: int = 64) -> dict:
    """The probe evaluation record of the run's checkpoint (INTERFACES: evaluations/<name>.json)."""
    cfg = read_run_config(run)
    file, probe = probe_manifest(manifest or cfg.data.manifest)
    if probe["seq_length"] > cfg.model.seq_length:
        raise ProbeError(f"the probe's examples have {probe['seq_length']} tokens, the model "
                         f"model.seq_length={cfg.model.seq_length}")
    if probe["seq_length"] != cfg.model.seq_length:
        print(f"warning: model.seq_length={cfg.model.seq_length} is not the probe's {probe['seq_length']}: its "
              "training samples held parts of several examples", file=sys.stderr)
    examples = torch.from_numpy(read_examples(file, split, limit))
    trained = load_trained_model(run, tag)
    counts = AnswerCounts()
    with tp1_parallel_state(), torch.no_grad():
        for batch in examples.split(batch_size):
            logits = trained.model(batch)[..., : cfg.model.vocab_size]
            counts.add(logits, batch, probe["answer_positions"])
    return {
        "name": NAME,
        "checkpoint": trained.tag,
        "summary": counts.summary(),
        "higher_is_better": dict(HIGHER_IS_BETTER),
        "task": probe["task"],
        "parameters": probe["parameters"],
        "chance_accuracy": probe["chance_accuracy"],
        "chance_token_accuracy": probe["chance_token_accuracy"],
        "split": split,
        "examples": counts.examples,
        "exact_examples": counts.exact,
        "answer_tokens": counts.answer_tokens,
        "correct_answer_tokens": counts.correct_tokens,
        "manifest": os.path.abspath(file),
    }


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pretrain.research.probes", description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--checkpoint", help="checkpoint tag (default: the latest)")
    parser.add_argument("--split", choices=SPLITS, default="valid")
    parser.add_argument("--examples", type=positive, help="the split's first N examples (default: all)")
    parser.add_argument("--manifest", help="the probe's manifest (default: the run's data.manifest)")
    parser.add_argument("--batch-size", type=positive, default=64)
    args = parser.parse_args(argv)
    run = RunDir(args.run_dir)
    if not run.config.is_file():
        parser.error(f"--run-dir {args.run_dir}: no run config ({run.config.name}) there")
    try:
        record = evaluate(run, args.checkpoint, args.split, args.examples, args.manifest, args.batch_size)
    except (ProbeError, DataError, FileNotFoundError, CheckpointMismatch, UnsafeCheckpointFile) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    path = run.write_evaluation(record)
    summary = record["summary"]
    print(f"probe {record['task']} ({record['split']}, {record['examples']} examples, {record['checkpoint']}): "
          f"exact match {summary['answer_accuracy']:.4f} (chance {record['chance_accuracy']:.3g}), answer tokens "
          f"{summary['answer_token_accuracy']:.4f} (chance {record['chance_token_accuracy']:.3g}), answer loss "
          f"{summary['answer_loss']:.4f} -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
