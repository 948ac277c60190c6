"""The sections of what each rank builds to train (pretrain/runtime/): `data:` (runtime/data.py),
`optimizer:` (runtime/optimizer.py), `deepspeed:` (runtime/ds_config.py), `speed:` (the model build in
runtime/engine.py, and the worker's matmul precision) and `logging:` (runtime/metrics.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from ora_megatron.config_io import check


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
class SpeedConfig:
    compile: bool = False
    """torch.compile each transformer layer and the loss (fused kernels; the first steps compile)."""
    cuda_graphs: bool = False
    """With compile: the compiled layers and loss replay as CUDA graphs (torch.compile's mode "reduce-overhead":
    one launch a graph instead of one a kernel); CUDA only."""
    tf32: bool = True
    """fp32 matrix multiplies on Ampere or newer GPUs use TF32 tensor cores; no effect on CPU."""
    activation_checkpointing: bool = False
    """Recompute each transformer layer's activations in the backward pass to save memory."""


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
