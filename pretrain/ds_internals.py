"""Every use of DeepSpeed internals (private attributes, undocumented layouts) in one place.

Each function says why the public API does not suffice. All were checked against DeepSpeed
0.19.8 (`runtime/zero/stage_1_and_2.py`, `runtime/zero/stage3.py`, `runtime/bf16_optimizer.py`,
`utils/tensor_fragment.py`); re-check them when the pin moves.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch
from deepspeed.utils import safe_get_local_grad, safe_get_local_optimizer_state


def base_optimizer(engine) -> torch.optim.Optimizer:
    """The torch optimizer under DeepSpeed's ZeRO / mixed-precision wrapper (itself without one).

    `.optimizer` is the wrapper's attribute for the wrapped optimizer; there is no accessor.
    """
    return getattr(engine.optimizer, "optimizer", engine.optimizer)


def link_optimizer_fragments(engine) -> None:
    """Point every parameter's ZeRO-1/2 (and bf16-optimizer) fragment at its optimizer state.

    DeepSpeed links fragments once, right after stepping the *first* parameter group
    (`_hp_optimizer_states_linked`), so the fragments of later groups stay empty and
    `deepspeed.utils.safe_*_optimizer_state` fail for them. Linking again once every group has
    state (after a step, or after the state was created by hand) repairs it.
    """
    optimizer = engine.optimizer
    if hasattr(optimizer, "_hp_optimizer_states_linked"):
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()


def local_optimizer_state(engine, param, key: str) -> Optional[torch.Tensor]:
    """This rank's part of `param`'s optimizer state `key`: its ZeRO fragment, or the whole tensor.

    deepspeed.utils has `safe_get_local_optimizer_state` for ZeRO-3 only; for ZeRO-1/2 and the
    bf16 optimizer the local fragment is reachable only through the private `_hp_mapping`.
    """
    if hasattr(param, "ds_id"):  # ZeRO-3
        return safe_get_local_optimizer_state(param, key)
    if hasattr(param, "_hp_mapping"):
        mapping = param._hp_mapping  # None, or no state yet: this rank holds none of it
        return mapping.get_optim_state_fragment(key) if mapping and key in mapping.get_optim_state_keys() else None
    return base_optimizer(engine).state.get(param, {}).get(key)


def local_grad_tensors(engine) -> Iterator[torch.Tensor]:
    """The gradient storage this rank holds at the end of a step's backward.

    ZeRO-2 keeps its reduced gradient partitions in the optimizer's `averaged_gradients`, not in
    `param.grad`; ZeRO-3 exposes its partition through `safe_get_local_grad`.
    """
    for p in engine.module.parameters():
        if p.requires_grad:
            grad = safe_get_local_grad(p) if hasattr(p, "ds_id") else p.grad
            if grad is not None:
                yield grad
    for grads in getattr(engine.optimizer, "averaged_gradients", {}).values():
        yield from (g for g in grads or () if g is not None)


def full_numel(param: torch.Tensor) -> int:
    """Elements of the whole parameter: ZeRO-3 leaves a partitioned placeholder and keeps the
    full size in `ds_numel`."""
    return getattr(param, "ds_numel", param.numel())
