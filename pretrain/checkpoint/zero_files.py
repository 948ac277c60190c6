"""Reading the optimizer state of a saved DeepSpeed checkpoint, parameter by parameter.

pretrain/checkpoint/reshard.py converts a checkpoint of one (DP, TP, PP, ZeRO) layout to per-parameter state.
DeepSpeed 0.19.8 has no public reader for that: zero_to_fp32 returns weights only, and
`deepspeed.checkpoint.ds_to_universal.main` is unusable whole here (checked on this project's
checkpoints): without the client's UNIVERSAL_CHECKPOINT_INFO TP patterns it concatenates replicated
norms and row-parallel weights along dim 0 (a TP=2 layernorm weight comes back with 128 elements
of 64); it crashes on megatron's `_extra_state` entries (None) of a PP=1 ZeRO-1/2 module state
(`tensor.float()` in its "params without optimizer fragments" step); and without
PIPELINE_REPLICATED patterns the last pipeline stage's copy of a tied module overwrites the first
stage's (its never-used position-embedding replica left the owner's exp_avg all zeros). Its
extraction step is sound, so the functions below call that step and DeepSpeed's DP-merge of the
fragments; the TP merge is the project's own (megatron's partition_dim / partition_stride).

Every file is read through `unpickling.safe_load`, or checked with it before DeepSpeed's readers
(which unpickle without restriction) open it.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Optional

from pretrain.checkpoint.unpickling import check_checkpoint_files, safe_load


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
