"""The optimizer of a run: AdamW over the trainable parameters' groups (`param_groups`), skipping
steps with non-finite gradients (`SkippingAdamW`), and megatron-core's LR schedule with two more
decay styles (`ParamScheduler`, built by `lr_scheduler`)."""

from __future__ import annotations

import math
from typing import Optional

import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from pretrain.config.run_config import RunConfig
from pretrain.config.runtime_sections import OptimizerConfig


def _no_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    return param.ndim < 2 or "embedding" in name or "norm" in name


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups of the trainable parameters only; frozen ones never reach the optimizer.

    Groups are (decay or not) × cohort: weights unfrozen by a freeze schedule carry an
    `optimizer_cohort` so that their Adam step count is their own. `wd_mult` is read by megatron's
    OptimizerParamScheduler when it sets each group's decay. No group is empty (DeepSpeed
    ZeRO-1/2 crash on empty groups, upstream #4055/#5071).
    """
    groups: dict[str, dict] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        decay = not _no_weight_decay(name, param)
        key = f"{'decay' if decay else 'no_decay'}/{getattr(param, 'optimizer_cohort', 'base')}"
        group = groups.setdefault(key, {"params": [], "name": key, "wd_mult": 1.0 if decay else 0.0,
                                        "weight_decay": weight_decay if decay else 0.0})
        group["params"].append(param)
    return list(groups.values())


class SkippingAdamW(torch.optim.AdamW):
    """AdamW that skips a step whose gradients are not finite on every rank.

    DeepSpeed's ZeRO and mixed-precision optimizers already skip such steps; with ZeRO-0 in fp32
    the engine steps this optimizer directly and counts a skip when `overflow` is set.

    Under ZeRO-0 in fp32 DeepSpeed clips the gradients right before this step, and the total norm
    it clipped with is handed over here (`record_clip_norm`): a finite norm that summed every local
    gradient proves them all finite, so the per-tensor check (one reduction and one host sync per
    tensor) runs only when the norm is not finite (or unknown) — the same decision as checking
    every tensor each step. The norm is also DeepSpeed's `get_global_grad_norm()` (read from
    `_global_grad_norm` after the step), which it otherwise leaves empty under ZeRO-0.
    """

    overflow = False
    _global_grad_norm: Optional[torch.Tensor] = None
    _pending_norm: Optional[torch.Tensor] = None
    _grads_known_finite = False

    def record_clip_norm(self, norm: torch.Tensor, covers_local_grads: bool) -> None:
        """The total gradient norm clipping computed for this step; `covers_local_grads`: it summed
        every gradient this rank holds (DeepSpeed leaves replicated weights out on TP ranks > 0)."""
        self._pending_norm = norm
        self._grads_known_finite = covers_local_grads and bool(torch.isfinite(norm).all())

    def step(self, closure=None):
        # Consumed once: a norm recorded for an earlier step never vouches for this one.
        self._global_grad_norm, self._pending_norm = self._pending_norm, None
        known_finite, self._grads_known_finite = self._grads_known_finite, False
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        bad = not known_finite and any(not torch.isfinite(g).all() for g in grads)
        if torch.distributed.get_world_size() > 1:  # every rank skips together
            flag = torch.tensor([float(bad)])
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            bad = bool(flag.item())
        self.overflow = bad
        if self.overflow:
            self.zero_grad(set_to_none=True)
            return None
        return super().step(closure)


def build_optimizer(model: torch.nn.Module, opt: OptimizerConfig, decides_skips: bool) -> torch.optim.AdamW:
    """AdamW over `param_groups(model)` with the run's hyperparameters (DeepSpeed wraps it).

    `decides_skips`: DeepSpeed steps it directly (ZeRO-0 in fp32), so it must skip non-finite steps
    itself (SkippingAdamW). Everywhere else DeepSpeed's ZeRO or mixed-precision optimizer wraps it
    and skips such a step before calling it (from the all-reduced gradient norm): checking again
    would cost a host sync per gradient and a collective per step, and decide nothing.
    """
    adamw = SkippingAdamW if decides_skips else torch.optim.AdamW
    return adamw(param_groups(model, opt.weight_decay), lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps,
                 **adamw_implementation())


def adamw_implementation() -> dict:
    """torch AdamW's implementation for this host: on CUDA the fused kernel (one pass reading parameter,
    gradient and both moments and writing three, 28 B a parameter, against foreach's eight passes and 80 B,
    and an eighth of the launches); elsewhere foreach (the same update tensor by tensor in C++, not Python),
    whose CPU results the tests pin."""
    return {"fused": True} if torch.cuda.is_available() else {"foreach": True}


class ParamScheduler(OptimizerParamScheduler):
    """megatron-core's OptimizerParamScheduler with two more LR decay styles; its warmup, its other
    styles, weight decay and checkpointing stay megatron's. The LR is a function of the step count
    alone, so a resumed schedule continues bitwise as an uninterrupted one would.

    After warmup, with t = step − warmup steps and min_lr = lr · min_lr_ratio:

    - `cosine_restarts` (SGDR, Loshchilov & Hutter 2017; torch's CosineAnnealingWarmRestarts with
      T_mult=1): cycles of `restart_cycle_steps` C; cycle k = t // C starts at the peak
      max(lr · restart_peak_decay^k, min_lr) and falls by cosine towards min_lr. From the decay
      steps on the LR is min_lr (a cycle the decay steps cut short ends there).
    - `polynomial` (transformers' get_polynomial_decay_schedule_with_warmup):
      (lr − min_lr) · (1 − t / (decay steps − warmup steps))^decay_power + min_lr, then min_lr.

    The config's `wsd` is megatron's own "WSD" (warmup, stable at lr, then a final decay of
    wsd_decay_steps ending at the decay steps, shaped by lr_wsd_decay_style); its two settings are
    saved with the state as the added styles' are.
    """

    STYLES = ("cosine_restarts", "polynomial")

    def __init__(self, optimizer, *, restart_cycle_steps: Optional[int], restart_peak_decay: float,
                 decay_power: float, **megatron_args) -> None:
        # Set before megatron's constructor, which computes the first LR.
        self.restart_cycle_steps = restart_cycle_steps
        self.restart_peak_decay = restart_peak_decay
        self.decay_power = decay_power
        super().__init__(optimizer, **megatron_args)

    def get_lr(self, param_group: dict) -> float:
        in_warmup = self.lr_warmup_steps > 0 and self.num_steps <= self.lr_warmup_steps
        if self.lr_decay_style not in self.STYLES or in_warmup:
            return super().get_lr(param_group)
        max_lr = param_group.get("max_lr", self.max_lr)
        min_lr = param_group.get("min_lr", self.min_lr)
        if self.num_steps >= self.lr_decay_steps:  # where the decay ends; the next cycle would restart here
            return min_lr
        elapsed = self.num_steps - self.lr_warmup_steps
        if self.lr_decay_style == "polynomial":
            remaining = 1.0 - elapsed / (self.lr_decay_steps - self.lr_warmup_steps)
            return (max_lr - min_lr) * remaining ** self.decay_power + min_lr
        cycle, position = divmod(elapsed, self.restart_cycle_steps)
        peak = max(max_lr * self.restart_peak_decay ** cycle, min_lr)
        return min_lr + (peak - min_lr) * 0.5 * (1.0 + math.cos(math.pi * position / self.restart_cycle_steps))

    def state_dict(self) -> dict:
        return {**super().state_dict(), "restart_cycle_steps": self.restart_cycle_steps,
                "restart_peak_decay": self.restart_peak_decay, "decay_power": self.decay_power,
                "wsd_decay_steps": self.wsd_decay_steps, "lr_wsd_decay_style": self.lr_wsd_decay_style}

    def load_state_dict(self, state_dict: dict) -> None:
        # Like megatron's own fields: the checkpoint's values win. Set before megatron's load, which
        # steps to the checkpoint's step; a checkpoint without them had a style that reads none.
        for name, what in (("restart_cycle_steps", "restart cycle steps"),
                           ("restart_peak_decay", "restart peak decay"), ("decay_power", "decay power"),
                           ("wsd_decay_steps", "WSD decay steps"), ("lr_wsd_decay_style", "WSD decay style")):
            setattr(self, name, self._check_and_set(getattr(self, name), state_dict.get(name, getattr(self, name)),
                                                    what))
        super().load_state_dict(state_dict)


def lr_scheduler(cfg: RunConfig, optimizer) -> ParamScheduler:
    """Warmup, then the decay style's decay to lr·min_lr_ratio (weight decay constant)."""
    opt = cfg.optimizer
    wsd = opt.decay_style == "wsd"
    return ParamScheduler(
        optimizer, restart_cycle_steps=opt.restart_cycle_steps, restart_peak_decay=opt.restart_peak_decay,
        decay_power=opt.decay_power, init_lr=0.0, max_lr=opt.lr, min_lr=opt.lr * opt.min_lr_ratio,
        lr_warmup_steps=opt.warmup_steps, lr_decay_steps=cfg.lr_decay_steps,
        lr_decay_style="WSD" if wsd else opt.decay_style, start_wd=opt.weight_decay, end_wd=opt.weight_decay,
        wd_incr_steps=cfg.train.steps, wd_incr_style="constant",
        wsd_decay_steps=opt.wsd_decay_steps if wsd else None, lr_wsd_decay_style=opt.wsd_decay_style if wsd else None)
