"""The sections the training loop and what it drives read: `train:` (batch sizes, run length, the log and
evaluation cadence: pretrain/training/trainer.py), `eval:` (what an evaluation reads, and early stopping:
pretrain/training/evaluator.py) and `checkpoint:` (when to save, what to keep: pretrain/checkpoint/
checkpointer.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ora_megatron.config_io import check


@dataclass
class TrainConfig:
    micro_batch_size: int = 4
    """Samples per forward/backward pass on each data-parallel rank."""
    global_batch_size: int = 8
    """Samples per optimizer step over all ranks; a multiple of micro_batch_size × data-parallel size."""
    steps: int = 100
    """Optimizer steps of the run (also sizes the train dataset: steps × global_batch_size samples)."""
    log_interval: int = 1
    """Log train metrics every this many steps (skipped steps are always logged)."""
    eval_interval: int = 50
    """Evaluate the validation loss every this many steps, and at the last step."""

    def evaluates_at(self, step: int) -> bool:
        """Whether the run validates after `step` steps: every eval_interval, and at the last step."""
        return step % self.eval_interval == 0 or step == self.steps

    @property
    def train_samples(self) -> int:
        """Samples the run trains on: steps × global batch."""
        return self.steps * self.global_batch_size

    def validate(self, key: str) -> None:
        for name in ("micro_batch_size", "global_batch_size", "steps", "log_interval", "eval_interval"):
            check(getattr(self, name) > 0, f"{key}.{name}", "must be > 0")
        check(self.global_batch_size % self.micro_batch_size == 0, f"{key}.global_batch_size",
              f"{self.global_batch_size} is not a multiple of micro_batch_size {self.micro_batch_size}")


@dataclass
class EarlyStopping:
    enabled: bool = False
    """Stop the run when the validation loss has not improved for `patience` evaluations."""
    patience: int = 10
    """Evaluations without improvement before stopping."""
    min_delta: float = 0.001
    """A validation loss counts as an improvement when below the best so far minus this."""

@dataclass
class EvalConfig:
    iters: int = 4
    """Global batches per evaluation (the same fixed batches every time)."""
    per_source: bool = True
    """With a data manifest of several sources, each evaluation also reports every source's loss (iters
    batches of each)."""
    early_stopping: EarlyStopping = field(default_factory=EarlyStopping)
    """Stop on a validation-loss plateau."""

    def validate(self, key: str) -> None:
        check(self.iters > 0, f"{key}.iters", "must be > 0")


@dataclass
class CheckpointConfig:
    save_interval: int = 100
    """Save every this many steps (and at the last step, on early stop and on SIGTERM/SIGINT)."""
    save_interval_s: float = 0.0
    """Also save once this many seconds passed since the last save (0: steps only). A failure loses half an
    interval on average, so the best interval is a time (Young/Daly), whatever a step takes on this many nodes."""
    keep_last: int = 2
    """Checkpoints kept; older ones are deleted after each save."""

    def validate(self, key: str) -> None:
        check(self.save_interval > 0, f"{key}.save_interval", "must be > 0")
        check(self.save_interval_s >= 0, f"{key}.save_interval_s", "must be >= 0")
        check(self.keep_last >= 1, f"{key}.keep_last", "must be >= 1")
