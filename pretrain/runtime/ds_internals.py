"""Every use of DeepSpeed internals (private attributes, undocumented layouts) in one place, and the
one way files of a run dir are unpickled (`safe_load`, DeepSpeed's own readers included).

Each function says why the public API does not suffice. All were checked against DeepSpeed
0.19.8 (`runtime/zero/stage_1_and_2.py`, `runtime/zero/stage3.py`, `runtime/bf16_optimizer.py`,
`utils/tensor_fragment.py`); re-check them when the pin moves.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pickle
import re
import zipfile
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
from deepspeed.runtime.utils import clip_grad_norm_
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils import (
    safe_get_full_fp32_param,
    safe_get_full_optimizer_state,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
)
from deepspeed.utils.tensor_fragment import fragment_address

MOMENTS = ("exp_avg", "exp_avg_sq")


def base_optimizer(engine) -> torch.optim.Optimizer:
    """The torch optimizer under DeepSpeed's ZeRO / mixed-precision wrapper (itself without one).

    `.optimizer` is the wrapper's attribute for the wrapped optimizer; there is no accessor.
    """
    return getattr(engine.optimizer, "optimizer", engine.optimizer)


def whole_tensor_masters(engine) -> Optional[dict[torch.Tensor, torch.Tensor]]:
    """{trainable parameter: the fp32 tensor torch's optimizer steps for it, keyed in its state} when
    that is a whole tensor (ZeRO-0); None when DeepSpeed splits them into fragments (ZeRO-1/2/3 and
    the bf16 optimizer of pipelines), reached through `deepspeed.utils.safe_*`.

    In fp32 the parameter is its own master. In bf16/fp16 without ZeRO, DeepSpeed's unfused
    optimizer steps fp32 copies (`fp32_groups[i][j]` of `fp16_groups[i][j]`), with no accessor.
    """
    wrapper = engine.optimizer
    if wrapper is base_optimizer(engine):
        return {p: p for group in wrapper.param_groups for p in group["params"]}
    if isinstance(wrapper, FP16_UnfusedOptimizer):
        return {low: high for lows, highs in zip(wrapper.fp16_groups, wrapper.fp32_groups, strict=True)
                for low, high in zip(lows, highs, strict=True)}
    return None


def full_optimizer_state(engine, param, masters) -> dict[str, Optional[torch.Tensor]]:
    """{"fp32", "exp_avg", "exp_avg_sq"} of a trainable parameter, whole (None where it has no state
    yet). `masters` is `whole_tensor_masters(engine)`, computed once by the caller. Under ZeRO this
    is a collective: every rank of a data-parallel group must ask for the same parameters."""
    if masters is None:
        return {"fp32": safe_get_full_fp32_param(param),
                **{key: safe_get_full_optimizer_state(param, key) for key in MOMENTS}}
    master = masters[param]
    state = base_optimizer(engine).state.get(master, {})
    return {"fp32": master.detach(), **{key: state.get(key) for key in MOMENTS}}


def set_full_optimizer_state(engine, param, values: dict[str, torch.Tensor], masters) -> None:
    """Set what `full_optimizer_state` reads; the Adam state must exist (ZeRO: fragments linked)."""
    if masters is None:
        for key in MOMENTS:
            safe_set_full_optimizer_state(param, values[key].to(param.device), key)
        safe_set_full_fp32_param(param, values["fp32"].to(param.device))
        return
    master = masters[param]
    for key in MOMENTS:
        base_optimizer(engine).state[master][key].copy_(values[key])
    with torch.no_grad():
        master.copy_(values["fp32"])


def undo_initial_zero_step(engine) -> None:
    """Undo the step DeepSpeed's unfused bf16/fp16 optimizer (ZeRO-0) takes with zero gradients when
    it is built (`FP16_UnfusedOptimizer.initialize_optimizer_states`, to create Adam's state early).

    That AdamW step runs with the lr the optimizer was constructed with, before the schedule sets the
    warmup's, so it decays the fp32 copies once by lr·weight_decay; and it starts every Adam count
    at 1, so the first real steps' bias correction differs from every other layout's. Torch creates
    the state again at the first real step; the copies are taken again from the weights, which the
    step did not touch.
    """
    if not isinstance(engine.optimizer, FP16_UnfusedOptimizer):
        return
    base_optimizer(engine).state.clear()
    with torch.no_grad():
        for weight, master in whole_tensor_masters(engine).items():
            master.copy_(weight)


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


def optimizer_flat_params(engine) -> list[tuple[torch.Tensor, dict]]:
    """(tensor, its param group) for every tensor the torch optimizer keeps Adam state for.

    ZeRO-0/1/2 and the bf16 optimizer keep them in the groups' `params`. ZeRO-3 empties those between
    steps (it puts one sub-group's fp32 partition there while stepping it, `_optimizer_step`): its
    tensors are `fp32_partitioned_groups_flat`, sub-group i belonging to group `sub_group_to_group_id[i]`.
    """
    base, wrapper = base_optimizer(engine), engine.optimizer
    if hasattr(wrapper, "fp32_partitioned_groups_flat"):
        return [(flat, base.param_groups[wrapper.sub_group_to_group_id[i]])
                for i, flat in enumerate(wrapper.fp32_partitioned_groups_flat)]
    return [(flat, group) for group in base.param_groups for flat in group["params"]]


def local_optimizer_state(engine, param, key: str, masters) -> Optional[torch.Tensor]:
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
    return base_optimizer(engine).state.get(master, {}).get(key)


def local_grad_tensors(engine) -> Iterator[torch.Tensor]:
    """The gradient storage this rank holds at the end of a step's backward; views of one buffer
    may repeat (count them with accounting.held_bytes).

    ZeRO keeps reduced gradient partitions outside `param.grad`: in the optimizer's
    `averaged_gradients`, and before the step ZeRO-2 in its flat `grads_in_partition`, ZeRO-3 in
    `grad_partitions_flat_buffer`. (ZeRO-3's `safe_get_local_grad` is no storage of its own: a view
    of that partition in fp32, or an fp32 copy of a bf16 one.)
    """
    yield from (p.grad for p in engine.module.parameters() if p.requires_grad and p.grad is not None)
    for grads in getattr(engine.optimizer, "averaged_gradients", {}).values():
        yield from (g for g in grads or () if g is not None)
    for name in ("grads_in_partition", "grad_partitions_flat_buffer"):
        buffer = getattr(engine.optimizer, name, None)
        if torch.is_tensor(buffer):
            yield buffer


def keep_fp32_clip_norm(engine, record: Callable[[torch.Tensor, bool], None]) -> None:
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
    if not callable(getattr(engine, "clip_fp32_gradients", None)):
        raise RuntimeError("this DeepSpeed has no DeepSpeedEngine.clip_fp32_gradients: re-check keep_fp32_clip_norm")

    def clip_fp32_gradients() -> None:
        mpu = engine.mpu
        if torch.distributed.get_world_size() == 1:
            params = [p for p in engine.module.parameters() if p.grad is not None]
            norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
            torch.nn.utils.clip_grads_with_norm_(params, engine.gradient_clipping(), norm, foreach=True)
            record(norm, True)
            return
        norm = clip_grad_norm_(parameters=engine.module.parameters(), max_norm=engine.gradient_clipping(), mpu=mpu)
        record(norm, mpu is None or mpu.get_model_parallel_rank() == 0)

    engine.clip_fp32_gradients = clip_fp32_gradients


def full_numel(param: torch.Tensor) -> int:
    """Elements of the whole parameter: ZeRO-3 leaves a partitioned placeholder and keeps the
    full size in `ds_numel`."""
    return getattr(param, "ds_numel", param.numel())


# ---------------------------------------------------------------------------- loading files of a run dir
# A run dir may come from someone else, and its integrity records do not vouch for it (whoever wrote
# the files can rewrite them). A pickle can name any callable, which `torch.load(weights_only=False)`
# calls, so every checkpoint, RNG-state, optimizer-state and conversion file is read with torch's
# restricted unpickler (weights_only=True): tensors, containers, numbers, strings, and beside them
# exactly the classes DeepSpeed 0.19.8 pickles into its optimizer files — the loss scaler of a ZeRO
# optimizer (`loss_scaler`), its `zero_stage` and its partitions' `fragment_address`es
# (`state_dict()` of runtime/zero/stage_1_and_2.py, stage3.py, bf16_optimizer.py). Each is rebuilt
# by setting its `__dict__`, which runs no code of the class; the enum is looked up by value.
DEEPSPEED_CHECKPOINT_CLASSES = [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


class UnsafeCheckpointFile(ValueError):
    """A checkpoint file holds objects other than tensors and DeepSpeed's records: not loaded."""


@contextlib.contextmanager
def _only_safe_globals(allowed: list) -> Iterator[None]:
    """Exactly `allowed` beside torch's own types for the restricted unpickler, then the list as it was.

    torch keeps one process-wide list of extra allowed globals, and `import megatron.core` adds to it
    (numpy arrays, argparse.Namespace, io.BytesIO, pathlib paths, its own configs:
    megatron/core/safe_globals.py), which torch's `safe_globals` context manager would keep allowed."""
    before = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(allowed)
    try:
        yield
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)


def safe_load(path, map_location="cpu", mmap: bool = False, allowed: tuple = ()):
    """torch.load with the restricted unpickler (weights_only=True), allowing DeepSpeed's checkpoint
    classes and `allowed` — nothing else — for this call; any other global raises UnsafeCheckpointFile
    naming the file. mmap: read the tensors only when used (files in torch's zip format, which DeepSpeed
    writes; others are read whole)."""
    try:
        with _only_safe_globals([*DEEPSPEED_CHECKPOINT_CLASSES, *allowed]):
            return torch.load(path, map_location=map_location, weights_only=True,
                              mmap=mmap and zipfile.is_zipfile(path))
    except pickle.UnpicklingError as e:
        # torch's message names the refused global, or the class it was asked to build
        named = re.search(r"GLOBAL (\S+)|got <class '([^']+)'>", str(e))
        what = f"it names {named.group(1) or named.group(2)}" if named else "it does not unpickle as data"
        raise UnsafeCheckpointFile(f"{path}: not loaded: {what}; checkpoint files are read as tensors and "
                                   "DeepSpeed's checkpoint records only (unpickling anything else can run code)"
                                   ) from None


def check_checkpoint_files(checkpoint_dir) -> None:
    """Read DeepSpeed's files of a checkpoint directory (`*_states.pt`: model, layer and optimizer states)
    with the restricted unpickler, memory-mapped so that no tensor is read, before DeepSpeed's own readers,
    which unpickle without restriction, open them. Raises UnsafeCheckpointFile naming the first file that
    holds anything else. (The run's own files, RNG states and conversions, are only read by `safe_load`.)"""
    for path in sorted(Path(checkpoint_dir).glob("*_states.pt")):
        safe_load(path, mmap=True)


class RestrictedCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's torch checkpoint engine, loading through `safe_load` (its own load unpickles without
    restriction). The engine reads every file of `load_checkpoint` through it: model states, ZeRO
    partitions, pipeline layer files (`runtime/engine.py` `_load_checkpoint`, `_load_zero_checkpoint`;
    `runtime/pipe/module.py` `load_state_dir`)."""

    def load(self, path: str, map_location=None):
        return safe_load(path, map_location=map_location)


def restrict_checkpoint_loading(engine) -> None:
    """Make `engine.load_checkpoint` read its files through RestrictedCheckpointEngine. DeepSpeed creates
    its checkpoint engine from its config (`_configure_checkpointing`, into `checkpoint_engine`) and
    takes none from the caller; the replacement saves as the torch engine did."""
    if type(engine.checkpoint_engine) not in (TorchCheckpointEngine, RestrictedCheckpointEngine):
        raise RuntimeError(f"DeepSpeed's checkpoint engine is {type(engine.checkpoint_engine).__name__}, not its "
                           "torch engine: re-check restrict_checkpoint_loading")
    engine.checkpoint_engine = RestrictedCheckpointEngine(engine._config)


# ---------------------------------------------------------------------------- reading saved checkpoints
# pretrain/checkpoint/reshard.py converts a checkpoint of one (DP, TP, PP, ZeRO) layout to per-parameter state.
# DeepSpeed 0.19.8 has no public reader for that: zero_to_fp32 returns weights only, and
# `deepspeed.checkpoint.ds_to_universal.main` is unusable whole here (checked on this project's
# checkpoints): without the client's UNIVERSAL_CHECKPOINT_INFO TP patterns it concatenates replicated
# norms and row-parallel weights along dim 0 (a TP=2 layernorm weight comes back with 128 elements
# of 64); it crashes on megatron's `_extra_state` entries (None) of a PP=1 ZeRO-1/2 module state
# (`tensor.float()` in its "params without optimizer fragments" step); and without
# PIPELINE_REPLICATED patterns the last pipeline stage's copy of a tied module overwrites the first
# stage's (its never-used position-embedding replica left the owner's exp_avg all zeros). Its
# extraction step is sound, so the functions below call that step and DeepSpeed's DP-merge of the
# fragments; the TP merge is the project's own (megatron's partition_dim / partition_stride).

def has_partitioned_optimizer_files(checkpoint_dir) -> bool:
    """True when the optimizer state is in `[bf16_]zero_pp_rank_*_optim_states.pt` files (ZeRO-1/2/3, and
    the bf16 optimizer under ZeRO-0); False when it is the torch optimizer's state dict inside
    `mp_rank_*_model_states.pt` (ZeRO-0 in fp32)."""
    return any(Path(checkpoint_dir).glob("*zero_pp_rank_*_optim_states.pt"))


def extract_zero_fragments(checkpoint_dir, out_dir, zero_stage: int) -> tuple[int, dict[str, int]]:
    """Dump every optimizer-held parameter's fp32 / exp_avg / exp_avg_sq fragments of a partitioned
    checkpoint as `out_dir/<DeepSpeed name>/<tp rank>/<state>.<dp rank>` (ds_to_universal's extraction:
    `extract_zero_shards`, `extract_zero_shards_stage3` and the private `_build_zero3_rank_grid`).

    Returns the TP degree and each parameter's Adam step. ZeRO-1/2 dump the step beside the fragments
    (read by `merged_fragments(..., "step")`, returned empty here); DeepSpeed's ZeRO-3 extraction
    drops it, so it is read from the optimizer file's sub-group state (`optimizer_state_dict` →
    `optimizer_state_dict` → `state[i]["step"]`, sub-group i holding the parameters of `param_shapes[i]`).
    """
    from deepspeed.checkpoint import DeepSpeedCheckpoint
    from deepspeed.checkpoint import ds_to_universal as ucp
    from deepspeed.checkpoint.constants import (
        PARAM_SHAPES,
        PIPELINE_REPLICATED_PARAMETER_PATTERNS,
        UNIVERSAL_CHECKPOINT_INFO,
    )

    check_checkpoint_files(checkpoint_dir)  # DeepSpeed's readers below unpickle without restriction
    checkpoint_dir, out_dir = str(checkpoint_dir), str(out_dir)
    if zero_stage <= 2:
        ds_checkpoint = DeepSpeedCheckpoint(checkpoint_dir)
        # A later stage's copy of a tied module is a replica: only the first stage's state counts.
        ds_checkpoint.global_state[UNIVERSAL_CHECKPOINT_INFO] = {
            PIPELINE_REPLICATED_PARAMETER_PATTERNS: [r"tied_modules\."]}
        for indices in itertools.product(range(ds_checkpoint.pp_degree), range(ds_checkpoint.tp_degree),
                                         range(ds_checkpoint.dp_degree)):
            ucp.extract_zero_shards(out_dir, ds_checkpoint, indices)
        return ds_checkpoint.tp_degree, {}
    files = sorted(Path(checkpoint_dir).glob("*zero_pp_rank_*"))
    model_grid, tp_degree, dp_degree = ucp._build_zero3_rank_grid([str(p) for p in files
                                                                     if p.name.endswith("_model_states.pt")])
    optim_grid, _, _ = ucp._build_zero3_rank_grid([str(p) for p in files if p.name.endswith("_optim_states.pt")])
    shapes_grid = [safe_load(model_grid[tp][0], mmap=True)[PARAM_SHAPES] for tp in range(tp_degree)]
    for tp, dp in itertools.product(range(tp_degree), range(dp_degree)):
        ucp.extract_zero_shards_stage3(optim_grid, shapes_grid, dp_degree, out_dir, (tp, dp))
    steps = {}
    for tp in range(tp_degree):
        sub_groups = safe_load(optim_grid[tp][0], mmap=True)["optimizer_state_dict"]["optimizer_state_dict"]["state"]
        for index, shapes in enumerate(shapes_grid[tp]):
            for name in shapes:
                steps[name] = int(sub_groups[index]["step"])
    return tp_degree, steps


def merged_fragments(fragment_dir, name: str, state: str, tp_degree: int) -> list:
    """Per TP rank, the fragments of one parameter's `state` concatenated over the DP ranks (flat), or
    for "step" the step (ds_to_universal's private `_merge_zero_shards`, which checks that every DP
    rank saved the same step)."""
    from deepspeed.checkpoint.ds_to_universal import _merge_zero_shards

    return _merge_zero_shards(os.path.join(str(fragment_dir), name), state, tp_degree)


def torch_optimizer_state(model_states_file, client_key: str) -> tuple[dict, Optional[dict], Optional[list]]:
    """ZeRO-0: (the torch optimizer's state_dict, the client state saved under `client_key`, the fp32
    masters per group or None) of one model-parallel rank. DeepSpeed stores the state dict under
    `optimizer` in `mp_rank_*_model_states.pt` (`client_state` entries beside it); in bf16/fp16 that
    entry is its unfused optimizer's own dict, holding torch's (`optimizer_state_dict`) and the fp32
    masters the weights were rounded from (`fp32_groups`, in the order of torch's groups)."""
    state = safe_load(model_states_file, mmap=True)
    optimizer = state["optimizer"]
    if "optimizer_state_dict" in optimizer:
        return optimizer["optimizer_state_dict"], state.get(client_key), optimizer["fp32_groups"]
    return optimizer, state.get(client_key), None
