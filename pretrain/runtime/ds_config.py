"""The DeepSpeed JSON of a run: ds_configs/zero{N}.json and {precision}.json merged with the run
config's batch and clipping. Imports no DeepSpeed, so the memory plan reads the same settings."""

from __future__ import annotations

import json

import torch

from pretrain.config.run_config import RunConfig
from pretrain.config.runtime_sections import DeepSpeedConfig
from pretrain.paths import DS_CONFIG_DIR


def fp32_grad_accumulation(deepspeed: DeepSpeedConfig, grad_accum: int) -> bool:
    """Whether DeepSpeed sums the micro-batches' bf16 gradients in fp32 (rather than in bf16, 8 mantissa
    bits). It offers that with ZeRO-2/3 only: ZeRO-0 refuses the mix, and ZeRO-1 would swap in its bf16
    optimizer, whose checkpoints are laid out differently."""
    return deepspeed.precision == "bf16" and grad_accum > 1 and deepspeed.zero_stage >= 2


def deepspeed_config(cfg: RunConfig, grad_accum: int) -> dict:
    """ds_configs/zero{N}.json + ds_configs/{precision}.json + batch/clip from the run config."""
    merged = {}
    for name in (f"zero{cfg.deepspeed.zero_stage}.json", f"{cfg.deepspeed.precision}.json"):
        merged.update(json.loads((DS_CONFIG_DIR / name).read_text()))
    merged.update({
        "train_batch_size": cfg.train.global_batch_size,
        "train_micro_batch_size_per_gpu": cfg.train.micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": cfg.optimizer.clip_grad,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        # Its samples/s timer (on by default) synchronizes the device at every forward and step;
        # throughput is measured by the metrics logger instead.
        "timers": {"throughput": {"enabled": False}},
    })
    zero = merged["zero_optimization"]
    if zero["stage"] > 0 and torch.cuda.is_available():
        # Reduce each gradient bucket on a side stream while backward computes the next one. (On
        # the CPU accelerator DeepSpeed has no streams to overlap with.)
        zero["overlap_comm"] = True
    if fp32_grad_accumulation(cfg.deepspeed, grad_accum):
        merged["data_types"] = {"grad_accum_dtype": "fp32"}
    if cfg.deepspeed.precision == "bf16" and zero["stage"] in (1, 2):
        # No pass over every gradient for non-finite values before each step: the step's gradient
        # norm decides instead (ds_internals.skip_nonfinite_steps_by_norm, which build_engine installs).
        merged["bf16"] = {**merged["bf16"], "check_grad_overflow": False}
    return merged
