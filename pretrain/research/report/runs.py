"""The runs of one or more sweeps, found by their experiment records, and what each one measured.

Everything is read through RunDir. A resumed run logs again the steps between its checkpoint and
the interruption; the last record of each step is the one kept.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from pretrain.config.run_config import read_run_config
from pretrain.run_files.run_dir import RunDir
from pretrain.run_files.run_records import EvalRecord, ExperimentRecord, Record, TrainRecord

GIB = 2**30


class ReportError(ValueError):
    """The inputs cannot make a report (nothing found, the same run twice, an unknown reference arm)."""


@dataclass
class SweepRun:
    arm: str
    seed: int
    run_dir: RunDir
    experiment: ExperimentRecord


def discover_runs(roots: Sequence[Path]) -> list[SweepRun]:
    """Every run with an experiment record under the given folders, at any depth. A folder that does
    not exist, or none holding a record, is a ReportError saying what was there instead."""
    found: dict[tuple[str, int], SweepRun] = {}
    for root in roots:
        if not Path(root).is_dir():
            raise ReportError(f"{root}: no such directory")
        for record_file in sorted(Path(root).rglob(RunDir.experiment.name)):
            run_dir = RunDir(record_file.parent)
            experiment = run_dir.read_experiment()
            key = (experiment.method, experiment.seed)
            if key in found:
                raise ReportError(f"arm {key[0]} seed {key[1]} appears twice: {found[key].run_dir.path} "
                                  f"and {run_dir.path}")
            found[key] = SweepRun(experiment.method, experiment.seed, run_dir, experiment)
    if not found:
        raise ReportError(f"no experiment records ({RunDir.experiment.name}) under "
                          f"{'; '.join(what_is_under(Path(root)) for root in roots)}. The report reads sweep output "
                          "directories: the --out of `python -m pretrain.research.sweep`, one run in each "
                          "<arm>/seed<seed>/")
    return list(found.values())


def what_is_under(root: Path) -> str:
    """`root` and what it holds instead of experiment records, for the message that says none were found."""
    if RunDir(root).config.exists():
        return f"{root}, a training run dir, not a sweep's output"
    run_dirs = sum(1 for _ in root.rglob(RunDir.config.name))
    return f"{root}, which holds {run_dirs} training run dir{'s' if run_dirs != 1 else ''} ({RunDir.config.name})"


def exclusion_reason(run: SweepRun) -> Optional[str]:
    """Why a run cannot enter the statistics, or None when it can."""
    status = run.experiment.status
    if status == "running":
        return "still running, or stopped before the sweep recorded its end"
    if status != "finished":
        return f"status {status}"
    if not run.run_dir.summary.exists():
        return "finished without a summary"
    summary = run.run_dir.read_summary()
    if summary.preempted:
        return f"preempted at step {summary.steps} (exit 0 on SIGTERM, not a complete run)"
    if summary.final_valid_loss is None:
        return "no validation loss in its summary"
    if not math.isfinite(summary.final_valid_loss):
        return f"final validation loss {summary.final_valid_loss} (diverged)"
    return None


# ---------------------------------------------------------------------------- one run's curves


def latest_per_step(records: Sequence[Record]) -> list[Record]:
    """One record per step, the last one written (a resumed run repeats steps), sorted by step."""
    return [record for _, record in sorted({r.step: r for r in records}.items())]


def steps_to_target(valid: Sequence[EvalRecord], target: float) -> Optional[int]:
    """Step of the first validation eval at or below the target; None when none is."""
    return next((r.step for r in valid if r.loss <= target), None)


def training_seconds_until(train: Sequence[TrainRecord], step: int) -> float:
    """Training time of steps 1..step, from the logged step times: a record logged at step s stands
    for every step since the previous record (s − previous of them), as the log keeps one step in
    log_interval. Evaluation, checkpointing and start-up are not training steps and are not counted."""
    seconds, previous = 0.0, 0
    for record in train:
        covered = min(record.step, step) - previous
        if covered <= 0:
            break
        seconds += covered * record.step_time_s
        previous = record.step
    return seconds


def mean_loss_over_curve(valid: Sequence[EvalRecord]) -> Optional[float]:
    """Area under the validation curve (trapezoids over steps) divided by its step span, first to last
    eval: the curve's mean loss, comparable across runs of different lengths. None below two evals."""
    if len(valid) < 2:
        return None
    steps = np.array([r.step for r in valid], dtype=float)
    losses = np.array([r.loss for r in valid])
    return float(np.trapezoid(losses, steps) / (steps[-1] - steps[0]))


def last_k_variance(valid: Sequence[EvalRecord], k: int) -> Optional[float]:
    """Sample variance (ddof=1) of the last k validation losses; None when the run has fewer than k."""
    if len(valid) < k:
        return None
    return statistics.variance([r.loss for r in valid[-k:]])


@dataclass
class GradNormStats:
    median: Optional[float]
    max: Optional[float]
    clipped_fraction: Optional[float]  # logged steps whose norm exceeded clip_grad


def grad_norm_stats(train: Sequence[TrainRecord], clip_grad: Optional[float]) -> GradNormStats:
    """Over the logged steps with a finite norm. The logged norm is DeepSpeed's global norm before
    clipping, so a step was clipped when it exceeds clip_grad (clipping is off when clip_grad <= 0)."""
    norms = [r.grad_norm for r in train if r.grad_norm is not None and math.isfinite(r.grad_norm)]
    if not norms:
        return GradNormStats(None, None, None)
    clipped = None if clip_grad is None or clip_grad <= 0 else sum(n > clip_grad for n in norms) / len(norms)
    return GradNormStats(statistics.median(norms), max(norms), clipped)


# ---------------------------------------------------------------------------- one run's measures


@dataclass
class RunMeasures:
    """What the report says about one finished run; None where it cannot be said."""

    arm: str
    seed: int
    final_valid_loss: float
    final_valid_ppl: float
    target_reached: Optional[bool]  # None without a target loss
    steps_to_target: Optional[int]
    seconds_to_target: Optional[float]
    aucc: Optional[float]
    last_k_variance: Optional[float]
    grad_norm_median: Optional[float]
    grad_norm_max: Optional[float]
    clipped_fraction: Optional[float]
    skipped_steps: int
    tokens_per_s_median: Optional[float]
    peak_memory_gib: Optional[float]  # rank 0's peak (metrics.jsonl is rank 0's)
    train_seconds: float
    trainable_params: int
    frozen_params: int
    valid_curve: list[tuple[int, float]]


def clip_grad_of(run_dir: RunDir) -> Optional[float]:
    return read_run_config(run_dir).optimizer.clip_grad if run_dir.config.exists() else None


def measure_run(run: SweepRun, target: Optional[float], last_k: int) -> RunMeasures:
    """The measures of a run that exclusion_reason accepts."""
    summary = run.run_dir.read_summary()
    train = latest_per_step(run.run_dir.read_records("train"))
    # A non-finite eval has no place on a loss curve's mean or variance; it is left out of the curve.
    valid = [r for r in latest_per_step(run.run_dir.read_records("valid")) if math.isfinite(r.loss)]
    reached_at = None if target is None else steps_to_target(valid, target)
    grad = grad_norm_stats(train, clip_grad_of(run.run_dir))
    return RunMeasures(
        arm=run.arm, seed=run.seed,
        final_valid_loss=summary.final_valid_loss, final_valid_ppl=math.exp(summary.final_valid_loss),
        target_reached=None if target is None else reached_at is not None,
        steps_to_target=reached_at,
        seconds_to_target=None if reached_at is None else training_seconds_until(train, reached_at),
        aucc=mean_loss_over_curve(valid), last_k_variance=last_k_variance(valid, last_k),
        grad_norm_median=grad.median, grad_norm_max=grad.max, clipped_fraction=grad.clipped_fraction,
        skipped_steps=summary.skipped_steps,
        tokens_per_s_median=statistics.median([r.tokens_per_s for r in train]) if train else None,
        peak_memory_gib=max(r.peak_mem_bytes for r in train) / GIB if train else None,
        train_seconds=training_seconds_until(train, summary.steps),
        trainable_params=summary.trainable_params, frozen_params=summary.frozen_params,
        valid_curve=[(r.step, r.loss) for r in valid])


# ---------------------------------------------------------------------------- post-training evaluations


@dataclass
class Evaluation:
    """One RUN/evaluations/<name>.json: its scalars (None where it has no finite number) and, for
    some, a value per layer (1..L)."""

    name: str
    summary: dict[str, Optional[float]]
    higher_is_better: dict[str, bool]
    per_layer: dict[str, list[Optional[float]]]


def _number(value, path: Path, key: str) -> Optional[float]:
    """A finite number, None for null or a non-finite one (never 0); anything else is a ReportError."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ReportError(f"{path}: {key} is {value!r}, not a number or null")
    return float(value) if math.isfinite(value) else None


def read_evaluation(path: Path) -> Evaluation:
    """An evaluation file; a ReportError names the file and what is wrong with it."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ReportError(f"{path}: not a readable JSON evaluation ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("summary"), dict):
        raise ReportError(f"{path}: no 'summary' mapping of metric → number")
    summary, directions, per_layer = data["summary"], data.get("higher_is_better"), data.get("per_layer") or {}
    if (not isinstance(directions, dict) or set(directions) != set(summary)
            or not all(isinstance(v, bool) for v in directions.values())):
        raise ReportError(f"{path}: 'higher_is_better' must give true or false for exactly the summary's metrics")
    if not isinstance(per_layer, dict) or not all(isinstance(v, list) for v in per_layer.values()):
        raise ReportError(f"{path}: 'per_layer' must map each metric to a list (one value per layer)")
    return Evaluation(
        name=path.stem,
        summary={metric: _number(value, path, f"summary.{metric}") for metric, value in summary.items()},
        higher_is_better=dict(directions),
        per_layer={metric: [_number(v, path, f"per_layer.{metric}[{i}]") for i, v in enumerate(values)]
                   for metric, values in per_layer.items()})


def read_evaluations(run_dir: RunDir) -> dict[str, Evaluation]:
    """Every evaluations/<name>.json of the run, by name (none: an empty mapping)."""
    return {path.stem: read_evaluation(path) for path in sorted(run_dir.evaluations.glob("*.json"))}
