"""The pretraining run config: every section of the YAML, typed and validated before launch.

`model:` and `parallel:` are ora_megatron's (model_config.py); each of `stability:` (stability.py),
`supervision:` (supervision.py), `init_from:` (init_from.py) and `faults:` (faults.py) is defined
beside the component that reads it; the rest is defined here. Checks
that depend on the number of processes (batch divisibility, ZeRO vs pipeline) run in
`validate_for_world(cfg, world_size)`, which the entry point calls before spawning workers, and
`for_world(cfg, world_size)` gives the config that then runs (and that the run dir records).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal, Optional, Union

from ora_megatron.config_io import ConfigError, apply_overrides, check, from_dict, load_yaml
from ora_megatron.model_config import ModelConfig, ParallelConfig, validate_model_parallel
from pretrain.faults import FaultInjection, check_faults_fit
from pretrain.init_from import InitFromConfig
from pretrain.parallel_layout import ParallelLayout
from pretrain.run_dir import RunDir
from pretrain.stability import StabilityConfig
from pretrain.supervision import SupervisionConfig

LayerSet = Union[Literal["all", "none", "first_half", "second_half"], list[int]]


@dataclass
class FreezeStage:
    """From `start` (fraction of train.steps) on, these layers' Q and/or K are frozen."""

    start: float = 0.0
    """Fraction of train.steps at which this stage begins, in [0, 1); before the first, attention.train_q/k apply."""
    frozen_q: LayerSet = "all"
    """Layers whose Q is frozen (1-based numbers, or a named set); the other layers' Q train."""
    frozen_k: LayerSet = "all"
    """Layers whose K is frozen (1-based numbers, or a named set); the other layers' K train."""

    def validate(self, key: str) -> None:
        check(0.0 <= self.start < 1.0, f"{key}.start", "must be in [0, 1)")


# The `partial_frozen` schedule of the research plan (docs/research.md): 50% of steps all Q/K frozen,
# 30% the first half of the layers frozen, the last 20% everything trainable.
PARTIAL_FROZEN = [
    FreezeStage(0.0, "all", "all"),
    FreezeStage(0.5, "first_half", "first_half"),
    FreezeStage(0.8, "none", "none"),
]


@dataclass
class EarlyStopping:
    enabled: bool = False
    """Stop the run when the validation loss has not improved for `patience` evaluations."""
    patience: int = 10
    """Evaluations without improvement before stopping."""
    min_delta: float = 0.001
    """A validation loss counts as an improvement when below the best so far minus this."""


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
    eval_iters: int = 4
    """Global batches per evaluation (the same fixed batches every time)."""
    activation_checkpointing: bool = False
    """Recompute each transformer layer's activations in the backward pass to save memory."""
    compile: bool = False
    """torch.compile each transformer layer and the loss (fused kernels; the first steps compile)."""
    cuda_graphs: bool = False
    """With compile: the compiled layers and loss replay as CUDA graphs (torch.compile's mode "reduce-overhead":
    one launch a graph instead of one a kernel); CUDA only."""
    tf32: bool = True
    """fp32 matrix multiplies on Ampere or newer GPUs use TF32 tensor cores; no effect on CPU."""
    freeze_schedule: Union[Literal["none", "partial_frozen"], list[FreezeStage]] = "none"
    """none, partial_frozen (50% of steps all Q/K frozen, 30% the first half, 20% none) or a list of stages."""
    early_stopping: EarlyStopping = field(default_factory=EarlyStopping)
    """Stop on a validation-loss plateau."""
    eval_per_source: bool = True
    """With a data manifest of several sources, each evaluation also reports every source's loss (eval_iters
    batches of each)."""

    @property
    def freeze_stages(self) -> list[FreezeStage]:
        if self.freeze_schedule == "none":
            return []
        if self.freeze_schedule == "partial_frozen":
            return PARTIAL_FROZEN
        return sorted(self.freeze_schedule, key=lambda s: s.start)

    def freeze_stage_at(self, step: int) -> int:
        """Index of the freeze stage in force at `step` (0-based); -1 before the first stage or without one."""
        started = [i for i, stage in enumerate(self.freeze_stages) if stage.start <= step / self.steps]
        return started[-1] if started else -1

    def evaluates_at(self, step: int) -> bool:
        """Whether the run validates after `step` steps: every eval_interval, and at the last step."""
        return step % self.eval_interval == 0 or step == self.steps

    @property
    def train_samples(self) -> int:
        """Samples the run trains on: steps × global batch."""
        return self.steps * self.global_batch_size

    @property
    def eval_samples(self) -> int:
        """Samples of one evaluation: eval_iters global batches, the same every time."""
        return self.eval_iters * self.global_batch_size

    def validate(self, key: str) -> None:
        for name in ("micro_batch_size", "global_batch_size", "steps", "log_interval", "eval_interval", "eval_iters"):
            check(getattr(self, name) > 0, f"{key}.{name}", "must be > 0")
        check(self.global_batch_size % self.micro_batch_size == 0, f"{key}.global_batch_size",
              f"{self.global_batch_size} is not a multiple of micro_batch_size {self.micro_batch_size}")


@dataclass
class OptimizerConfig:
    lr: float = 5e-4
    """Peak learning rate (reached at the end of warmup)."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of lr, in [0, 1]."""
    warmup_steps: int = 0
    """Steps of linear warmup from 0 to lr."""
    decay_style: Literal["cosine", "linear", "constant", "cosine_restarts", "polynomial", "wsd"] = "cosine"
    """Shape of the decay from lr to lr · min_lr_ratio after warmup (constant: stay at lr; cosine_restarts: SGDR;
    wsd: warmup-stable-decay, megatron-core's WSD)."""
    decay_steps: Optional[int] = None
    """Step (warmup included) at which the decay reaches lr · min_lr_ratio; null = train.steps."""
    restart_cycle_steps: Optional[int] = None
    """cosine_restarts (required; no other style reads it): steps per cosine cycle, from warmup's end to decay_steps."""
    restart_peak_decay: float = 1.0
    """cosine_restarts only: each cycle's peak is the previous one's × this, in (0, 1]."""
    decay_power: float = 1.0
    """polynomial only: the power p of (lr − end) · (1 − t)^p + end, > 0 (1: linear)."""
    wsd_decay_steps: Optional[int] = None
    """wsd (required; no other style reads it): steps of the final decay, which ends at decay_steps; before it
    the LR stays at lr."""
    wsd_decay_style: Literal["linear", "cosine", "exponential", "minus_sqrt"] = "linear"
    """wsd only: shape of the final decay (megatron-core's lr_wsd_decay_style)."""
    beta1: float = 0.9
    """AdamW β1, in [0, 1)."""
    beta2: float = 0.98
    """AdamW β2, in [0, 1)."""
    eps: float = 1e-8
    """AdamW ε."""
    weight_decay: float = 0.01
    """AdamW weight decay of matrices; biases, norms and embeddings get none."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this (DeepSpeed gradient_clipping)."""

    def validate(self, key: str) -> None:
        check(self.lr > 0, f"{key}.lr", "must be > 0")
        check(0.0 <= self.min_lr_ratio <= 1.0, f"{key}.min_lr_ratio", "must be in [0, 1]")
        check(self.warmup_steps >= 0, f"{key}.warmup_steps", "must be >= 0")
        check(self.decay_steps is None or self.decay_steps > 0, f"{key}.decay_steps", "must be > 0 (or null)")
        check(self.decay_power > 0, f"{key}.decay_power", "must be > 0")
        check(0.0 < self.restart_peak_decay <= 1.0, f"{key}.restart_peak_decay", "must be in (0, 1]")
        if self.decay_style == "cosine_restarts":
            check(self.restart_cycle_steps is not None and self.restart_cycle_steps > 0,
                  f"{key}.restart_cycle_steps", "decay_style cosine_restarts needs a cycle length > 0")
        if self.decay_style == "wsd":
            check(self.wsd_decay_steps is not None and self.wsd_decay_steps > 0,
                  f"{key}.wsd_decay_steps", "decay_style wsd needs the steps of its final decay, > 0")
        # A value the style would not read is refused rather than ignored.
        unread = {"restart_cycle_steps": (self.restart_cycle_steps, None, "cosine_restarts"),
                  "restart_peak_decay": (self.restart_peak_decay, 1.0, "cosine_restarts"),
                  "decay_power": (self.decay_power, 1.0, "polynomial"),
                  "wsd_decay_steps": (self.wsd_decay_steps, None, "wsd"),
                  "wsd_decay_style": (self.wsd_decay_style, "linear", "wsd")}
        for name, (value, unset, style) in unread.items():
            unset_text = "null" if unset is None else unset
            check(self.decay_style == style or value == unset, f"{key}.{name}",
                  f"read only with decay_style {style}, not {self.decay_style}: leave it at {unset_text}")
        for name in ("eps", "weight_decay", "clip_grad"):
            check(getattr(self, name) >= 0, f"{key}.{name}", "must be >= 0")
        for name in ("beta1", "beta2"):
            check(0.0 <= getattr(self, name) < 1.0, f"{key}.{name}", "must be in [0, 1)")


@dataclass
class BlendEntry:
    path: str
    """Megatron indexed-dataset prefix (no .bin/.idx)."""
    weight: float = 1.0
    """Relative sampling weight within the blend."""


@dataclass
class DataConfig:
    manifest: Optional[str] = None
    """A data_tools manifest (JSON); exactly one source of manifest, blend, train_blend, mock is set."""
    blend: list[BlendEntry] = field(default_factory=list)
    """One blend of indexed datasets, cut into train/valid/test by `split`."""
    split: str = "98,1,1"
    """train,valid,test ratios for `blend`, for `mock`, and for a manifest built without --split."""
    train_blend: list[BlendEntry] = field(default_factory=list)
    """Or separate blends per split: the train blend (with valid_blend, test_blend)."""
    valid_blend: list[BlendEntry] = field(default_factory=list)
    """Validation blend, read only with train_blend; empty = no validation."""
    test_blend: list[BlendEntry] = field(default_factory=list)
    """Test blend, read only with train_blend; empty = no final test loss."""
    mock: bool = False
    """Megatron-core's mock dataset (synthetic tokens), no files needed."""
    tokenizer: Optional[str] = None
    """Sentencepiece .model; null = the manifest's (mock data: megatron-core's null tokenizer)."""
    seed: int = 1234
    """Seed of megatron-core's dataset shuffling."""
    eod_mask_loss: bool = False
    """Leave end-of-document tokens out of the loss (megatron-core's eod_mask_loss)."""
    reset_attention_mask: bool = False
    """Document masking: a token attends only to earlier tokens of its own document in a packed sample
    (megatron-core's reset_attention_mask; not with parallel.pipeline > 1)."""
    reset_position_ids: bool = False
    """Positions restart at 0 after every end-of-document token (megatron-core's reset_position_ids)."""

    @property
    def sources(self) -> list[str]:
        named = {"manifest": self.manifest is not None, "blend": bool(self.blend),
                 "train_blend": bool(self.train_blend), "mock": self.mock}
        return [k for k, v in named.items() if v]

    def validate(self, key: str) -> None:
        check(len(self.sources) == 1, f"{key}.manifest",
              f"set exactly one of manifest, blend, train_blend, mock (got {self.sources or 'none'})")
        parts = self.split.split(",")
        check(len(parts) == 3 and all(p.strip().replace(".", "", 1).isdigit() for p in parts)
              and float(parts[0]) > 0, f"{key}.split",
              f"expected 'train,valid,test' ratios with a train share > 0, got {self.split!r}")
        check(0 <= self.seed < 2**32, f"{key}.seed", "must be in [0, 2**32) (numpy's seed range)")


@dataclass
class DeepSpeedConfig:
    zero_stage: int = 0
    """ZeRO stage 0, 1, 2 or 3 (merges ds_configs/zero{N}.json)."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Training precision (merges ds_configs/{precision}.json)."""
    zero_with_one_rank: bool = False
    """Keep ZeRO-1/2/3 with one data-parallel rank; by default an fp32 run there trains at ZeRO-0."""

    def validate(self, key: str) -> None:
        check(self.zero_stage in (0, 1, 2, 3), f"{key}.zero_stage", "must be 0, 1, 2 or 3")


@dataclass
class LoggingConfig:
    tensorboard: bool = True
    """Write TensorBoard events to the run dir's tensorboard/ folder."""
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    """wandb mode; wandb never touches the network unless mode is "online"."""
    wandb_project: str = "ora"
    """wandb project name."""
    progress: bool = True
    """Show a progress bar (loss, lr, tokens/s) on stderr."""
    layer_grad_norms: bool = False
    """Log each stage's gradient norm every log_interval steps (ZeRO≥1 gathers the gradients; not pipeline > 1)."""


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


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    """Architecture, sizes and attention variant."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Model parallelism; data parallelism takes the remaining processes."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Batch sizes, steps, evaluation, freeze schedule and fault tolerance."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """AdamW with megatron-core's warmup + decay schedule."""
    data: DataConfig = field(default_factory=lambda: DataConfig(mock=True))
    """Datasets and tokenizer; without a data section, the mock dataset."""
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    """ZeRO stage and precision."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """TensorBoard, wandb and the progress bar (metrics.jsonl is always written)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint frequency and retention."""
    stability: StabilityConfig = field(default_factory=StabilityConfig)
    """Skipped steps (non-finite or spiking) and what a run of them does."""
    supervision: SupervisionConfig = field(default_factory=SupervisionConfig)
    """Restarts, the hang watchdog, collective timeouts and the wall-time limit of an unattended job."""
    init_from: InitFromConfig = field(default_factory=InitFromConfig)
    """Weights a fresh run starts from instead of random ones."""
    faults: list[FaultInjection] = field(default_factory=list)
    """Faults made on purpose (tests, the chaos benchmark): process faults at steps, loss faults at data
    batches; empty in every real config."""

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one optimizer step over all data-parallel ranks."""
        return self.train.global_batch_size * self.model.seq_length

    @property
    def lr_decay_steps(self) -> int:
        """The step (warmup included) at which the learning rate has decayed to lr · min_lr_ratio."""
        return self.optimizer.decay_steps or self.train.steps

    def validate(self, key: str) -> None:
        validate_model_parallel(self.model, self.parallel)
        self._validate_init_from()
        decay_steps = self.lr_decay_steps
        check(self.optimizer.warmup_steps < decay_steps, "optimizer.warmup_steps",
              f"{self.optimizer.warmup_steps} must be below the decay steps ({decay_steps}: "
              "optimizer.decay_steps, or train.steps when unset)")
        if self.optimizer.decay_style == "wsd":
            stable_and_decay = decay_steps - self.optimizer.warmup_steps
            check(self.optimizer.wsd_decay_steps <= stable_and_decay, "optimizer.wsd_decay_steps",
                  f"{self.optimizer.wsd_decay_steps} is more than the {stable_and_decay} steps between warmup's end "
                  f"and the decay steps ({decay_steps})")
        for name in ("reset_attention_mask", "reset_position_ids"):  # the pipeline passes one tensor on
            check(not getattr(self.data, name) or self.parallel.pipeline == 1, f"data.{name}",
                  "document masks and positions reach the layers with parallel.pipeline 1 only")
        # ZeRO-3 gathers each weight in hooks inside the layers, which a compiled layer would trace.
        check(not (self.train.compile and self.deepspeed.zero_stage == 3), "train.compile",
              "torch.compile of the layers is supported with ZeRO-0/1/2, not with deepspeed.zero_stage=3")
        check(self.train.compile or not self.train.cuda_graphs, "train.cuda_graphs",
              "CUDA graphs replay the compiled layers and loss: set train.compile=true with it")
        if self.train.freeze_stages:
            check(self.deepspeed.precision != "fp16", "train.freeze_schedule",
                  "freeze schedules are supported with fp32/bf16 only")
            # The hand-over rebuilds the engine on the same module; ZeRO-3 has partitioned it.
            check(self.deepspeed.zero_stage <= 2, "train.freeze_schedule",
                  "freeze schedules are supported with ZeRO-0/1/2, "
                  f"got deepspeed.zero_stage={self.deepspeed.zero_stage}")
            check(self.model.attention.custom_qkv, "train.freeze_schedule",
                  f"needs random Q/K to freeze (attention type ora/frozen_*), got '{self.model.attention.type}'")
            for i, stage in enumerate(self.train.freeze_stages):
                for name in ("frozen_q", "frozen_k"):
                    layers = getattr(stage, name)
                    if isinstance(layers, list):
                        bad = [n for n in layers if not 1 <= n <= self.model.num_layers]
                        check(not bad, f"train.freeze_schedule[{i}].{name}",
                              f"layer numbers {bad} outside 1..{self.model.num_layers}")

    def _validate_init_from(self) -> None:
        path, qk, att = self.init_from.path, self.init_from.qk, self.model.attention
        if path is None:
            return
        check(att.uses_qk, "init_from.path",
              f"attention type '{att.type}' has no Q/K projections to import into (vanilla, ora, frozen_* have)")
        if att.custom_qkv:
            check(qk is not None, "init_from.qk",
                  f"attention type '{att.type}' draws its Q/K: choose draw (as a fresh run, from model.seed) or "
                  "imported (the source's Q/K)")
        else:
            check(qk is None, "init_from.qk",
                  f"read only for random-Q/K attention (ora, frozen_*); '{att.type}' imports its trainable Q/K: "
                  "leave it at null")


def load_run_config(path: str, overrides: list[str] = ()) -> RunConfig:
    data = apply_overrides(load_yaml(path), list(overrides))
    return from_dict(RunConfig, data)


def read_run_config(run_dir: RunDir) -> RunConfig:
    """A run's resolved config (its run dir's config.yaml) as a typed RunConfig."""
    return load_run_config(str(run_dir.config))


def validate_for_world(cfg: RunConfig, world_size: int) -> int:
    """Checks that need the process count; returns the gradient-accumulation steps."""
    model_parallel = cfg.parallel.tensor * cfg.parallel.pipeline
    check(world_size % model_parallel == 0, "parallel.tensor",
          f"world size {world_size} is not divisible by tensor × pipeline = {model_parallel}")
    dp = ParallelLayout.of(cfg.parallel, world_size).data
    per_step = cfg.train.micro_batch_size * dp
    check(cfg.train.global_batch_size % per_step == 0, "train.global_batch_size",
          f"{cfg.train.global_batch_size} is not a multiple of micro_batch_size × data-parallel size "
          f"= {cfg.train.micro_batch_size} × {dp}")
    if cfg.parallel.pipeline > 1:
        check(cfg.deepspeed.zero_stage <= 1, "deepspeed.zero_stage",
              f"DeepSpeed's pipeline engine supports ZeRO-0/1 only, got {cfg.deepspeed.zero_stage} "
              f"with parallel.pipeline={cfg.parallel.pipeline}")
        check(not cfg.train.freeze_stages, "train.freeze_schedule",
              "freeze schedules are not supported with pipeline parallelism yet")
        check(not cfg.stability.spike_skip.enabled, "stability.spike_skip.enabled",
              "skip-step is implemented for pipeline size 1 only (the pipeline engine steps inside train_batch)")
    check_faults_fit(cfg.faults, world_size, cfg.parallel.pipeline)
    return cfg.train.global_batch_size // per_step


def for_world(cfg: RunConfig, world_size: int) -> RunConfig:
    """The config as it trains on `world_size` processes.

    With one data-parallel rank ZeRO has nothing to partition, and in fp32 ZeRO-0 takes the same
    AdamW step without ZeRO's flat buffers, bucket copies and bookkeeping: such runs train at ZeRO-0
    unless deepspeed.zero_with_one_rank keeps the stage. Mixed precision keeps it: DeepSpeed's ZeRO-0
    bf16/fp16 path is another optimizer wrapper, without fp32 gradient accumulation. The run dir records
    the stage that ran, so resuming on more ranks reshards the checkpoint like any other ZeRO change.
    """
    ds = cfg.deepspeed
    one_rank = ParallelLayout.of(cfg.parallel, world_size).data == 1
    if not one_rank or ds.zero_stage == 0 or ds.precision != "fp32" or ds.zero_with_one_rank:
        return cfg
    return replace(cfg, deepspeed=replace(ds, zero_stage=0))


__all__ = ["RunConfig", "load_run_config", "read_run_config", "validate_for_world", "for_world", "ConfigError",
           "FreezeStage", "PARTIAL_FROZEN"]
