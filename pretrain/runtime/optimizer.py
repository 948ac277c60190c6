"""The optimizer of a run: AdamW over the trainable parameters' groups (`param_groups`), skipping
steps with non-finite gradients (`SkippingAdamW`), and megatron-core's LR schedule (`lr_scheduler`)."""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from pretrain.config import OptimizerConfig, RunConfig


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


def build_optimizer(model: torch.nn.Module, opt: OptimizerConfig) -> SkippingAdamW:
    """AdamW over `param_groups(model)` with the run's hyperparameters (DeepSpeed wraps it)."""
    # foreach: the same update, tensor by tensor in C++ rather than in Python (torch picks it on
    # CUDA by itself, not on CPU, where the per-tensor loop costs more than the arithmetic).
    return SkippingAdamW(param_groups(model, opt.weight_decay), lr=opt.lr,
                         betas=(opt.beta1, opt.beta2), eps=opt.eps, foreach=True)


def lr_scheduler(cfg: RunConfig, optimizer) -> OptimizerParamScheduler:
    """megatron-core's warmup + cosine/linear decay to lr·min_lr_ratio (weight decay constant)."""
    opt = cfg.optimizer
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=opt.lr, min_lr=opt.lr * opt.min_lr_ratio,
        lr_warmup_steps=opt.warmup_steps, lr_decay_steps=opt.decay_steps or cfg.train.steps,
        lr_decay_style=opt.decay_style, start_wd=opt.weight_decay, end_wd=opt.weight_decay,
        wd_incr_steps=cfg.train.steps, wd_incr_style="constant")
