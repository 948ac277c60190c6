"""The pretraining run config: every section of the YAML composed into one RunConfig, typed and validated
before launch.

`model:` and `parallel:` are ora_megatron's (model_config.py); `supervision:` (pretrain/job/supervision.py)
and `faults:` (pretrain/job/faults.py) are the job's, beside the code that reads them. The sections that
the runtime reads (runtime_sections.py), that the loop reads (loop_sections.py), the freeze schedule
(freeze.py), `stability:` (stability.py) and `init_from:` (init_from.py) sit in this room, one module per
reader, below their readers: the runtime and the loop import the config, and a config loads without
torch. Checks that depend on the number of processes (batch divisibility,
ZeRO vs pipeline) run in `validate_for_world(cfg, world_size)`, which the entry point calls before
spawning workers, and `for_world(cfg, world_size)` gives the config that then runs (and that the run
dir records).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ora_megatron.config_io import ConfigError, apply_overrides, check, from_dict, load_yaml
from ora_megatron.model_config import ModelConfig, ParallelConfig, validate_model_parallel
from pretrain.config.freeze import FreezeConfig
from pretrain.config.init_from import InitFromConfig
from pretrain.config.loop_sections import CheckpointConfig, EvalConfig, TrainConfig
from pretrain.config.runtime_sections import DataConfig, DeepSpeedConfig, LoggingConfig, OptimizerConfig, SpeedConfig
from pretrain.config.stability import StabilityConfig
from pretrain.job.faults import FaultInjection, check_faults_fit
from pretrain.job.parallel_layout import ParallelLayout
from pretrain.job.supervision import SupervisionConfig
from pretrain.run_files.run_dir import RunDir


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    """Architecture, sizes and attention variant."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Model parallelism; data parallelism takes the remaining processes."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Batch sizes, steps, and the log and evaluation cadence."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """What an evaluation reads, and early stopping."""
    speed: SpeedConfig = field(default_factory=SpeedConfig)
    """torch.compile, TF32 and activation checkpointing: how fast a step runs, not what it computes."""
    freeze: FreezeConfig = field(default_factory=FreezeConfig)
    """Which layers' Q/K are frozen when."""
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
    def eval_samples(self) -> int:
        """Samples of one evaluation: eval.iters global batches, the same every time."""
        return self.eval.iters * self.train.global_batch_size

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
        check(not (self.speed.compile and self.deepspeed.zero_stage == 3), "speed.compile",
              "torch.compile of the layers is supported with ZeRO-0/1/2, not with deepspeed.zero_stage=3")
        check(self.speed.compile or not self.speed.cuda_graphs, "speed.cuda_graphs",
              "CUDA graphs replay the compiled layers and loss: set speed.compile=true with it")
        if self.freeze.stages:
            check(self.deepspeed.precision != "fp16", "freeze.schedule",
                  "freeze schedules are supported with fp32/bf16 only")
            # The hand-over rebuilds the engine on the same module; ZeRO-3 has partitioned it.
            check(self.deepspeed.zero_stage <= 2, "freeze.schedule",
                  "freeze schedules are supported with ZeRO-0/1/2, "
                  f"got deepspeed.zero_stage={self.deepspeed.zero_stage}")
            check(self.model.attention.custom_qkv, "freeze.schedule",
                  f"needs random Q/K to freeze (attention type ora/frozen_*), got '{self.model.attention.type}'")
            for i, stage in enumerate(self.freeze.stages):
                for name in ("frozen_q", "frozen_k"):
                    layers = getattr(stage, name)
                    if isinstance(layers, list):
                        bad = [n for n in layers if not 1 <= n <= self.model.num_layers]
                        check(not bad, f"freeze.schedule[{i}].{name}",
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
        check(not cfg.freeze.stages, "freeze.schedule",
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


__all__ = ["RunConfig", "load_run_config", "read_run_config", "validate_for_world", "for_world", "ConfigError"]
