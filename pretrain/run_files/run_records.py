"""The records a run dir holds, as typed dataclasses: metrics.jsonl's lines (train steps, evaluations,
events), restarts.jsonl's, summary.json and a sweep's experiment.yaml. Where each lives and how it is
written and read is pretrain/run_files/run_dir.py's alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union


@dataclass
class TrainRecord:
    """One logged training step."""

    step: int
    loss: float
    lr: float
    grad_norm: Optional[float]
    tokens_per_s: float
    step_time_s: float
    skipped_steps: int
    trainable_params: int
    peak_mem_bytes: int  # GPU: allocator peak; CPU: process max RSS
    tflops_per_device: Optional[float] = None  # on a GPU whose peak is known
    mfu: Optional[float] = None
    # Gradient 2-norm of each stage ({"embedding": …, "layer1": …}) before clipping, at log-interval
    # steps (logging.layer_grad_norms); None where not measured or not finite.
    layer_grad_norms: Optional[dict[str, Optional[float]]] = None
    # What kept this step's update from being applied: "non-finite", "loss spike" or "grad-norm spike".
    skip_reason: Optional[str] = None
    # The run's events so far (every segment and job): updates skipped as spikes, restarts of a failed
    # job, hangs among those failures, rewinds.
    spike_skips: int = 0
    restarts: int = 0
    hangs: int = 0
    rewinds: int = 0
    split: str = "train"


@dataclass
class EventRecord:
    """Something that happened to the run at `step`: a restart (its RestartRecord), a rewind (what was
    reloaded and which data batches were skipped) or a skipped spike (the loss, the norm, the bounds)."""

    step: int
    kind: str  # "restart" | "rewind" | "spike"
    detail: dict = field(default_factory=dict)
    split: str = "event"


@dataclass
class RestartRecord:
    """One failure of a supervised job and what its supervisor (pretrain/launch/supervisor.py) did about it:
    one line of restarts.jsonl, written by the process that launched the ranks, never by the dead ones."""

    time: str
    action: str  # "restart", or "stop": the job ends with this failure (refused, crash loop)
    host: str
    node_rank: Optional[int]  # with one launch per node (NODE_RANK), the node that writes it
    attempt: int  # the attempt that failed: 0 is the job's first launch
    exit_code: int  # the launcher's
    ranks: dict[str, str]  # rank -> "exit 4 (hung)", "SIGKILL", ... as the launcher reported them
    cause: str  # one line
    hang_dumps: list[str]  # files of hangs/ this failure wrote
    log_tail: list[str]  # the job's last output lines
    failed_at_step: Optional[int]  # the last step logged before the failure
    resumed_from_step: Optional[int]  # the checkpoint the restart resumes from
    steps_redone: Optional[int]
    seconds_lost: float  # from the resumed checkpoint's save to the relaunch (the relaunch's start-up comes on top)
    backoff_s: float


@dataclass
class EvalRecord:
    """Loss and perplexity on the validation set (every eval_interval) or the test set (at the end)."""

    step: int
    split: str  # "valid" or "test"
    loss: float  # of the blend
    ppl: float
    # Each data source's loss on its own part of the split (a manifest of several sources,
    # eval.per_source); None otherwise.
    sources: Optional[dict[str, float]] = None


Record = Union[TrainRecord, EvalRecord, EventRecord]


@dataclass
class Summary:
    """What a finished, stopped-early or preempted run reports."""

    final_train_loss: float
    final_valid_loss: Optional[float]
    final_test_loss: Optional[float]  # None when preempted or without a test split
    wall_time_s: float  # the training loop's, summed over the run's segments (resumes add to it)
    steps: int
    stopped_early: bool
    preempted: bool
    tokens_seen: int
    skipped_steps: int
    trainable_params: int
    frozen_params: int
    # Per rank: Adam-state elements/bytes and gradient bytes, read from the live tensors.
    allocated_by_rank: list[dict] = field(default_factory=list)
    # Each data source's loss at the last validation / the test (EvalRecord.sources); None without them.
    final_valid_loss_by_source: Optional[dict[str, float]] = None
    final_test_loss_by_source: Optional[dict[str, float]] = None
    # Why the run stopped before its last step without a signal: "max_wall_time" (resumable),
    # "diverged" (rewinds used up) or "non-finite steps"; None when it finished, stopped early or was preempted.
    stop_reason: Optional[str] = None
    spike_skips: int = 0  # updates skipped as loss or gradient-norm spikes
    restarts: int = 0  # restarts of the run's failed jobs (restarts.jsonl)
    hangs: int = 0  # of those failures, the ones a hang watchdog reported
    rewinds: list[dict] = field(default_factory=list)  # each rewind: steps, checkpoint, skipped batches


@dataclass
class ExperimentRecord:
    """The research plan's record of one sweep run (docs/research.md): which arm and seed, what it ran,
    what came out.
    Written by pretrain.research.sweep before the run starts (status "running") and again when it ends."""

    experiment_id: str  # "<spec>/<arm>/seed<seed>"
    method: str  # the arm's name
    seed: int
    start_time: str
    model_config: dict
    training_config: dict
    # final_train_loss, final_val_loss, final_val_ppl, training_time_hours; empty until the run ends
    results: dict
    notes: str
    status: str  # "running" | "finished" | "failed"
    exit_code: Optional[int]
    log_tail: str  # the last lines of the run's log when it failed
    config_hash: str  # sha256 of the resolved config
    git_revision: str
    # The spec's post-training evaluations that ended: name → status ("finished" | "failed"),
    # exit_code, seconds, log_tail (when failed). Its file evaluations/<name>.json is the result.
    evaluations: dict = field(default_factory=dict)
