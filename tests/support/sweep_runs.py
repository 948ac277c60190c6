"""Sweep output written through the RunDir API, for the report's tests: runs whose answers are known by hand."""

from __future__ import annotations

import math
from pathlib import Path

from pretrain.run_files.run_dir import RunDir
from pretrain.run_files.run_records import EvalRecord, ExperimentRecord, Summary, TrainRecord


def train_record(step: int, step_time_s: float = 0.1, grad_norm: float = 0.5, peak_mem_bytes: int = 2**30,
                 tokens_per_s: float = 1000.0) -> TrainRecord:
    return TrainRecord(step=step, loss=3.0, lr=1e-3, grad_norm=grad_norm, tokens_per_s=tokens_per_s,
                       step_time_s=step_time_s, skipped_steps=0, trainable_params=900, peak_mem_bytes=peak_mem_bytes)


def valid_record(step: int, loss: float) -> EvalRecord:
    return EvalRecord(step=step, split="valid", loss=loss, ppl=math.exp(loss))


def write_run(root: Path, arm: str, seed: int, *, final_loss: float | None = None, status: str = "finished",
              exit_code: int | None = 0, log_tail: str = "", train: list[TrainRecord] = (),
              curve: list[tuple[int, float]] = (), frozen: int = 0, clip_grad: float = 1.0,
              git_revision: str = "abc", model: dict | None = None, params: int = 1000) -> RunDir:
    """One sweep run at root/<arm>/seed<seed>: experiment record, config, metrics and (when finished) summary.
    Without a curve, the validation curve is 4.0 at step 10 down to final_loss at step 20. `model`: the
    config's model section (e.g. its shape); `params`: trainable + frozen parameters in the summary."""
    run_dir = RunDir(root / arm / f"seed{seed}")
    run_dir.write_experiment(ExperimentRecord(
        experiment_id=f"spec/{arm}/seed{seed}", method=arm, seed=seed, start_time="2026-01-01T00:00:00",
        model_config=dict(model or {}), training_config={}, results={}, notes="", status=status, exit_code=exit_code,
        log_tail=log_tail, config_hash="0" * 64, git_revision=git_revision))
    run_dir.write_config({"optimizer": {"clip_grad": clip_grad}, **({"model": model} if model else {})})
    curve = curve or ([(10, 4.0), (20, final_loss)] if final_loss is not None else [])
    metrics = run_dir.open_metrics()
    for record in list(train or [train_record(10), train_record(20)]) + [valid_record(s, v) for s, v in curve]:
        metrics.append(record)
    metrics.close()
    if status == "finished":
        run_dir.write_summary(Summary(
            final_train_loss=3.0, final_valid_loss=curve[-1][1], final_test_loss=None, wall_time_s=10.0,
            steps=curve[-1][0], stopped_early=False, preempted=False, tokens_seen=0, skipped_steps=0,
            trainable_params=params - frozen, frozen_params=frozen))
    return run_dir


def write_evaluation(run_dir: RunDir, name: str, summary: dict, higher_is_better: dict,
                     per_layer: dict | None = None) -> Path:
    """RUN/evaluations/<name>.json in the format every post-training evaluation writes."""
    record = {"name": name, "checkpoint": "step00000020", "summary": summary, "higher_is_better": higher_is_better}
    if per_layer is not None:
        record["per_layer"] = per_layer
    return run_dir.write_evaluation(record)
