"""Every use of DeepSpeed's internals (private attributes, undocumented layouts) in one
place; reading its checkpoint files is pretrain/checkpoint's (unpickling.py, zero_files.py).

Each function says why the public API does not suffice. All were checked against DeepSpeed
0.19.8 (`runtime/zero/stage_1_and_2.py`, `runtime/zero/stage3.py`, `runtime/bf16_optimizer.py`,
`utils/tensor_fragment.py`); re-check them when the pin moves.
"""

from __future__ import annotations

import math
from typing import Callable, Iterator, Optional

import torch
from deepspeed import DeepSpeedEngine
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
from deepspeed.runtime.utils import clip_grad_norm_
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from deepspeed.utils import (
    safe_get_full_fp32_param,
    safe_get_full_optimizer_state,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
)

from pretrain.runtime.step_guard import guard_steps

MOMENTS = ("exp_avg", "exp_avg_sq")


def engine_config(ds_engine: DeepSpeedEngine):
    """The engine's parsed DeepSpeedConfig, which DeepSpeed keeps private (`_config`) and builds its
    checkpoint engine from."""
    return ds_engine._config


def base_optimizer(ds_engine: DeepSpeedEngine) -> torch.optim.Optimizer:
    """The torch optimizer under DeepSpeed's ZeRO / mixed-precision wrapper (itself without one).

    `.optimizer` is the wrapper's attribute for the wrapped optimizer; there is no accessor.
    """
    return getattr(ds_engine.optimizer, "optimizer", ds_engine.optimizer)


def whole_tensor_masters(ds_engine: DeepSpeedEngine) -> Optional[dict[torch.Tensor, torch.Tensor]]:
    """{trainable parameter: the fp32 tensor torch's optimizer steps for it, keyed in its state} when
    that is a whole tensor (ZeRO-0); None when DeepSpeed splits them into fragments (ZeRO-1/2/3 and
    the bf16 optimizer of pipelines), reached through `deepspeed.utils.safe_*`.

    In fp32 the parameter is its own master. In bf16/fp16 without ZeRO, DeepSpeed's unfused
    optimizer steps fp32 copies (`fp32_groups[i][j]` of `fp16_groups[i][j]`), with no accessor.
    """
    wrapper = ds_engine.optimizer
    if wrapper is base_optimizer(ds_engine):
        return {p: p for group in wrapper.param_groups for p in group["params"]}
    if isinstance(wrapper, FP16_UnfusedOptimizer):
        return {low: high for lows, highs in zip(wrapper.fp16_groups, wrapper.fp32_groups, strict=True)
                for low, high in zip(lows, highs, strict=True)}
    return None


def full_optimizer_state(ds_engine: DeepSpeedEngine, param, masters) -> dict[str, Optional[torch.Tensor]]:
    """{"fp32", "exp_avg", "exp_avg_sq"} of a trainable parameter, whole (None where it has no state
    yet). `masters` is `whole_tensor_masters(engine)`, computed once by the caller. Under ZeRO this
    is a collective: every rank of a data-parallel group must ask for the same parameters."""
    if masters is None:
        return {"fp32": safe_get_full_fp32_param(param),
                **{key: safe_get_full_optimizer_state(param, key) for key in MOMENTS}}
    master = masters[param]
    state = base_optimizer(ds_engine).state.get(master, {})
    return {"fp32": master.detach(), **{key: state.get(key) for key in MOMENTS}}


def set_full_optimizer_state(ds_engine: DeepSpeedEngine, param, values: dict[str, torch.Tensor], masters) -> None:
    """Set what `full_optimizer_state` reads; the Adam state must exist (ZeRO: fragments linked)."""
    if masters is None:
        for key in MOMENTS:
            safe_set_full_optimizer_state(param, values[key].to(param.device), key)
        safe_set_full_fp32_param(param, values["fp32"].to(param.device))
        return
    master = masters[param]
    for key in MOMENTS:
        base_optimizer(ds_engine).state[master][key].copy_(values[key])
    with torch.no_grad():
        master.copy_(values["fp32"])


def full_fp32_master(param, masters) -> torch.Tensor:
    """The whole fp32 master copy of a trainable parameter (with or without Adam state yet); under ZeRO
    a collective, as `full_optimizer_state`."""
    return safe_get_full_fp32_param(param) if masters is None else masters[param].detach()


def set_full_fp32_master(ds_engine: DeepSpeedEngine, param, value: torch.Tensor, masters) -> None:
    """Set the fp32 master copy the optimizer steps for a trainable parameter, before it has any Adam
    state (weights set into a fresh engine); `full_optimizer_state(...)["fp32"]` reads it back."""
    if masters is None:
        safe_set_full_fp32_param(param, value.to(param.device))
        return
    with torch.no_grad():
        masters[param].copy_(value.to(masters[param].device).view(masters[param].shape))


def undo_initial_zero_step(ds_engine: DeepSpeedEngine) -> None:
    """Undo the step DeepSpeed's unfused bf16/fp16 optimizer (ZeRO-0) takes with zero gradients when
    it is built (`FP16_UnfusedOptimizer.initialize_optimizer_states`, to create Adam's state early).

    That AdamW step runs with the lr the optimizer was constructed with, before the schedule sets the
    warmup's, so it decays the fp32 copies once by lr·weight_decay; and it starts every Adam count
    at 1, so the first real steps' bias correction differs from every other layout's. Torch creates
    the state again at the first real step; the copies are taken again from the weights, which the
    step did not touch.
    """
    if not isinstance(ds_engine.optimizer, FP16_UnfusedOptimizer):
        return
    base_optimizer(ds_engine).state.clear()
    with torch.no_grad():
        for weight, master in whole_tensor_masters(ds_engine).items():
            master.copy_(weight)


def link_optimizer_fragments(ds_engine: DeepSpeedEngine) -> None:
    """Point every parameter's ZeRO-1/2 (and bf16-optimizer) fragment at its optimizer state.

    DeepSpeed links fragments once, right after stepping the *first* parameter group
    (`_hp_optimizer_states_linked`), so the fragments of later groups stay empty and
    `deepspeed.utils.safe_*_optimizer_state` fail for them. Linking again once every group has
    state (after a step, or after the state was created by hand) repairs it.
    """
    optimizer = ds_engine.optimizer
    if hasattr(optimizer, "_hp_optimizer_states_linked"):
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()


def optimizer_flat_params(ds_engine: DeepSpeedEngine) -> list[tuple[torch.Tensor, dict]]:
    """(tensor, its param group) for every tensor the torch optimizer keeps Adam state for.

    ZeRO-0/1/2 and the bf16 optimizer keep them in the groups' `params`. ZeRO-3 empties those between
    steps (it puts one sub-group's fp32 partition there while stepping it, `_optimizer_step`): its
    tensors are `fp32_partitioned_groups_flat`, sub-group i belonging to group `sub_group_to_group_id[i]`.
    """
    base, wrapper = base_optimizer(ds_engine), ds_engine.optimizer
    if hasattr(wrapper, "fp32_partitioned_groups_flat"):
        return [(flat, base.param_groups[wrapper.sub_group_to_group_id[i]])
                for i, flat in enumerate(wrapper.fp32_partitioned_groups_flat)]
    return [(flat, group) for group in base.param_groups for flat in group["params"]]


def local_optimizer_state(ds_engine: DeepSpeedEngine, param, key: str, masters) -> Optional[torch.Tensor]:
    """This rank's part of `param`'s optimizer state `key`: its ZeRO fragment, or the whole tensor.

    deepspeed.utils has `safe_get_local_optimizer_state` for ZeRO-3 only; for ZeRO-1/2 and the
    bf16 optimizer the local fragment is reachable only through the private `_hp_mapping`.
    `masters` is `whole_tensor_masters(engine)`, computed once by the caller.
    """
    if hasattr(param, "ds_id"):  # ZeRO-3
        return safe_get_local_optimizer_state(param, key)
    if hasattr(param, "_hp_mapping"):
        mapping = param._hp_mapping  # None, or no state yet: this rank holds none of it
        return mapping.get_optim_state_fragment(key) if mapping and key in mapping.get_optim_state_keys() else None
    master = (masters or {}).get(param)
    return base_optimizer(ds_engine).state.get(master, {}).get(key)


def local_grad_tensors(ds_engine: DeepSpeedEngine) -> Iterator[torch.Tensor]:
    """The gradient storage this rank holds at the end of a step's backward; views of one buffer
    may repeat (count them with accounting.held_bytes).

    ZeRO keeps reduced gradient partitions outside `param.grad`: in the optimizer's
    `averaged_gradients`, and before the step ZeRO-2 in its flat `grads_in_partition`, ZeRO-3 in
    `grad_partitions_flat_buffer`. (ZeRO-3's `safe_get_local_grad` is no storage of its own: a view
    of that partition in fp32, or an fp32 copy of a bf16 one.)
    """
    yield from (p.grad for p in ds_engine.module.parameters() if p.requires_grad and p.grad is not None)
    for grads in getattr(ds_engine.optimizer, "averaged_gradients", {}).values():
        yield from (g for g in grads or () if g is not None)
    for name in ("grads_in_partition", "grad_partitions_flat_buffer"):
        buffer = getattr(ds_engine.optimizer, name, None)
        if torch.is_tensor(buffer):
            yield buffer


def keep_fp32_clip_norm(ds_engine: DeepSpeedEngine, record: Callable[[torch.Tensor, bool], None]) -> None:
    """Hand the total norm of DeepSpeed's fp32 gradient clipping to `record(norm, covers_local_grads)`.

    Without ZeRO and mixed precision the engine clips itself, in `_take_model_step` right before
    `optimizer.step()`: `clip_fp32_gradients` calls `runtime.utils.clip_grad_norm_` and drops the
    total norm it returns, so `get_global_grad_norm()` stays None and a caller wanting the norm
    would compute it a second time. There is no hook or option for it: the method is replaced on
    this engine instance by the very same call that keeps the norm — the gradients are clipped
    exactly as before. `covers_local_grads`: the norm summed every gradient of this rank, which
    clip_grad_norm_ does on model-parallel rank 0 only (it leaves replicated weights to that rank).

    A job of one process takes torch's clipping instead (`get_total_norm` + `clip_grads_with_norm_`,
    foreach): the same formula — total 2-norm, coefficient max_norm / (norm + 1e-6) capped at 1,
    every gradient scaled by it — without DeepSpeed's two all-reduces over one rank and its
    per-tensor Python loops (~0.7 ms a step at nanoGPT's shakespeare size).
    """
    if not callable(getattr(ds_engine, "clip_fp32_gradients", None)):
        raise RuntimeError("this DeepSpeed has no DeepSpeedEngine.clip_fp32_gradients: re-check keep_fp32_clip_norm")

    def clip_fp32_gradients() -> None:
        mpu = ds_engine.mpu
        if torch.distributed.get_world_size() == 1:
            params = [p for p in ds_engine.module.parameters() if p.grad is not None]
            norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
            torch.nn.utils.clip_grads_with_norm_(params, ds_engine.gradient_clipping(), norm, foreach=True)
            record(norm, True)
            return
        norm = clip_grad_norm_(parameters=ds_engine.module.parameters(), max_norm=ds_engine.gradient_clipping(),
                               mpu=mpu)
        record(norm, mpu is None or mpu.get_model_parallel_rank() == 0)

    ds_engine.clip_fp32_gradients = clip_fp32_gradients


def skip_nonfinite_steps_by_norm(ds_engine: DeepSpeedEngine) -> None:
    """Under ZeRO-1/2 in bf16, skip a step whose global gradient norm is not finite, as DeepSpeed's own
    check would, without its pass over every gradient.

    Before computing the norm it clips with, the ZeRO-1/2 optimizer looks for non-finite gradients
    tensor by tensor (`has_overflow_partitioned_grads_serial`: amax, amin, two isfinite and more, some
    13 small kernels per tensor; on an H100, 1,924 of the 4,192 kernels a Base step launched). The
    norm decides the same: one non-finite gradient makes it non-finite, and it is all-reduced, so
    every rank decides alike; ZeRO-3 and the bf16 optimizer decide from the norm alone. With
    `bf16.check_grad_overflow` false (ds_config.py) the pass is skipped, but DeepSpeed then steps
    whatever the norm. This puts the decision back where the norm is known: DeepSpeed sets
    `_global_grad_norm`, then calls the torch optimizer's `step()` once per parameter group; a
    non-finite norm skips each of them and sets the wrapper's `overflow`, which the engine counts in
    `skipped_steps` as it counts its own skips. Weights and Adam state stay as they were; DeepSpeed
    clears the gradients as after any step.
    """
    wrapper = ds_engine.optimizer
    if not isinstance(wrapper, DeepSpeedZeroOptimizer) or wrapper.check_grad_overflow:
        return
    if not wrapper.compute_grad_norm:
        raise RuntimeError("ZeRO-1/2 without its own overflow check needs the gradient norm: "
                           "keep zero_optimization.compute_grad_norm on")

    def nonfinite() -> bool:
        if math.isfinite(step_grad_norm(ds_engine)):
            return False
        wrapper.overflow = True
        return True

    guard_steps(base_optimizer(ds_engine), nonfinite)


def step_grad_norm(ds_engine: DeepSpeedEngine) -> Optional[float]:
    """The global gradient norm (before clipping) of the step DeepSpeed is taking, for code that the torch
    optimizer's `step()` calls (pretrain/runtime/step_guard.py); None where DeepSpeed computes none.

    `get_global_grad_norm()` is the engine's copy, taken after the step. Every wrapper (ZeRO-1/2/3,
    the bf16 and fp16 optimizers) sets its `_global_grad_norm` before it calls the torch optimizer;
    without a wrapper (ZeRO-0 in fp32) the norm the engine clipped with is the one handed to
    SkippingAdamW (`keep_fp32_clip_norm`), pending until its step consumes it.
    """
    wrapper = ds_engine.optimizer
    norm = getattr(wrapper, "_pending_norm" if wrapper is base_optimizer(ds_engine) else "_global_grad_norm", None)
    return None if norm is None else float(norm)


def full_numel(param: torch.Tensor) -> int:
    """Elements of the whole parameter: ZeRO-3 leaves a partitioned placeholder and keeps the
    full size in `ds_numel`."""
    return getattr(param, "ds_numel", param.numel())
