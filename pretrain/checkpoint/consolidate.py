"""One fp32 state dict from a DeepSpeed checkpoint of any layout the trainer writes.

The result has exactly the keys of a TP=1 `StagedGPT` (`{stage}.{param}`), so it loads with
`load_state_dict(strict=True)` and is what HF export and evaluation read. Per layout:

- PP=1, ZeRO-0/1/2: `mp_rank_{tp}_model_states.pt["module"]` holds each TP rank's whole module.
- PP>1 (ZeRO-0/1): `layer_{index}-model_{tp}-model_states.pt` holds one stage module's state dict.
- ZeRO-3: the module files hold empty placeholders; the weights exist only as the optimizer's
  fp32 partitions, which DeepSpeed's own zero_to_fp32 gathers.
- ZeRO>=1 with PP=1 (any precision, any TP size): the trainable weights are taken from the fp32
  master weights (zero_to_fp32), not from the module copy, which is bf16/fp16 in mixed precision.

TP shards are merged along the `partition_dim` (and `partition_stride`) that megatron sets on the
parameters of the TP=1 reference model; replicated tensors must be identical on every TP rank.
Frozen Q/K are regenerated from the config (the reference model draws them from (seed, layer,
role)) and every stored copy is checked against them: zero_to_fp32 drops frozen parameters for
ZeRO-1 and returns them in the training dtype for ZeRO-2/3, so no stored copy is trusted.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from megatron.core import parallel_state

from ora_megatron.attention import RandomQKVLinear, use_imported_qk
from ora_megatron.model_config import ModelConfig, ParallelConfig
from ora_megatron.orthogonal import matches_regenerated
from ora_megatron.parallel import init_distributed
from ora_megatron.stages import StagedGPT, StageSpec, build_staged_gpt, stage_specs
from pretrain.checkpoint.unpickling import check_checkpoint_files, safe_load
from pretrain.config.freeze import FreezeConfig
from pretrain.config.run_config import RunConfig, read_run_config
from pretrain.run_files.run_dir import RunDir
from pretrain.runtime.freeze import trainability

FP32_MASTER = "fp32_master"
"""Trainable weights from the ZeRO optimizer's fp32 master partitions (DeepSpeed's zero_to_fp32)."""
MODULE = "module"
"""Weights from the saved module state (upcast to fp32 when the run trained in bf16/fp16)."""

log = logging.getLogger(__name__)

PIPELINE_LAYER_FILE = re.compile(r"layer_(\d{2,})-model_(\d{2,})-model_states\.pt")

StateDict = dict[str, Optional[torch.Tensor]]


class CheckpointMismatch(ValueError):
    """The checkpoint does not hold the model its config describes."""


@dataclass
class Consolidated:
    state_dict: StateDict
    """fp32 tensors under the TP=1 StagedGPT keys (megatron's `_extra_state` entries are None)."""
    source: str
    """FP32_MASTER or MODULE: where the trainable weights came from."""
    saved_dtype: Optional[torch.dtype]
    """dtype of the saved module weights; None for ZeRO-3 (the module files hold placeholders)."""
    frozen_qk: list[str]
    """Names of the Q/K weights frozen in every step so far (regenerated, not read)."""


def pipeline_layer_file_stage(path, specs: list[StageSpec]) -> tuple[str, int]:
    """DeepSpeed's per-layer pipeline file name → (stage name, tensor-parallel rank).

    PipelineModule saves stage `index` of TP rank `tp` as `layer_{index:02d}-model_{tp:02d}-model_states.pt`
    (the `model` axis of the PipeModelDataParallelTopology the trainer builds).
    """
    name = Path(path).name
    match = PIPELINE_LAYER_FILE.fullmatch(name)
    if match is None:
        raise ValueError(f"{name}: not a DeepSpeed pipeline layer file (layer_NN-model_TT-model_states.pt)")
    index, tp_rank = int(match.group(1)), int(match.group(2))
    if index >= len(specs):
        raise ValueError(f"{name}: stage index {index}, but the model has {len(specs)} stages")
    return specs[index].name, tp_rank


def consolidated_state_dict(cfg: RunConfig, checkpoint_dir: Path) -> Consolidated:
    """The full fp32 model of one checkpoint (`run_dir/checkpoints/<tag>`), for `cfg`'s model.

    Works in a plain single process: megatron's parallel state is created for the TP=1 reference
    model if none exists, and torn down again.
    """
    checkpoint_dir = Path(checkpoint_dir)
    check_checkpoint_files(checkpoint_dir)  # zero_to_fp32 unpickles without restriction
    reference = reference_model(cfg.model)
    use_run_qk(reference, RunDir(checkpoint_dir.parent.parent))
    expected = reference.state_dict()
    tp = cfg.parallel.tensor
    module = None if cfg.deepspeed.zero_stage == 3 else module_weights(cfg.model, cfg.parallel, checkpoint_dir)
    # ZeRO>=1 keeps fp32 master partitions that zero_to_fp32 reads; it handles PP=1 only.
    has_masters = cfg.deepspeed.zero_stage >= 1 and cfg.parallel.pipeline == 1
    master = _fp32_master_weights(checkpoint_dir, tp) if has_masters else None
    if module is None and master is None:
        raise ValueError("ZeRO-3 with pipeline parallelism: DeepSpeed's pipeline engine refuses it, "
                         "so no such checkpoint exists")

    frozen = untrained_qk(cfg.model, cfg.freeze, cfg.train.steps, reference, checkpoint_dir)
    merged = {}
    for what, per_rank in (("module", module), ("fp32 master", master)):
        if per_rank is not None:
            merged[what] = merge_tensor_parallel(per_rank, reference, what)
            _check_stored_qk(merged[what], frozen, what, cfg.model)
    state = _assemble(expected, frozen, merged.get("fp32 master", {}), merged.get("module", {}))
    saved_dtype = _saved_dtype(module[0]) if module is not None else None
    return Consolidated(state, FP32_MASTER if master is not None else MODULE, saved_dtype, sorted(frozen))


@dataclass
class TrainedModel:
    cfg: RunConfig
    """The run's resolved config."""
    tag: str
    """The checkpoint the weights come from."""
    model: StagedGPT
    """The TP=1 model holding the consolidated fp32 weights, in eval mode."""


def load_trained_model(run_dir, tag: Optional[str] = None) -> TrainedModel:
    """A run's model at checkpoint `tag` (default: the latest complete one), in one process.

    Run it inside `tp1_parallel_state()`: megatron's layers read the parallel state in forward.
    """
    run = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    tag = tag or run.latest_checkpoint()
    if tag is None:
        raise FileNotFoundError(f"{run.path}: no complete checkpoint (checkpoints/latest is missing)")
    if not run.checkpoint(tag).is_dir():
        raise FileNotFoundError(f"{run.checkpoint(tag)}: no such checkpoint (tags: {run.checkpoint_tags()})")
    cfg = read_run_config(run)
    model = reference_model(cfg.model)
    model.load_state_dict(consolidated_state_dict(cfg, run.checkpoint(tag)).state_dict, strict=True)
    return TrainedModel(cfg, tag, model.eval())


# ---------------------------------------------------------------------------- the reference model
@contextlib.contextmanager
def tp1_parallel_state() -> Iterator[None]:
    """megatron's parallel state for building a TP=1 model: joined if present, else created and
    destroyed afterwards (a consolidation script is a plain single process)."""
    own_group = not dist.is_initialized()
    own_megatron = not parallel_state.model_parallel_is_initialized()
    if not own_megatron and parallel_state.get_tensor_model_parallel_world_size() != 1:
        raise RuntimeError("consolidation builds a TP=1 model: call it outside a tensor-parallel process")
    init_distributed(1, 1, backend="gloo", alone=True)
    try:
        yield
    finally:
        if own_megatron:
            parallel_state.destroy_model_parallel()
        if own_group:
            dist.destroy_process_group()


def reference_model(model: ModelConfig) -> StagedGPT:
    """The TP=1 model of the config: its keys, shapes, TP attributes and regenerated frozen Q/K.

    Building it seeds the torch RNG per stage; the caller's RNG state is restored afterwards.
    """
    with tp1_parallel_state(), torch.random.fork_rng(devices=[]):
        return build_staged_gpt(model, ParallelConfig())


QK_KEY = re.compile(r"layer(\d+)\.layer\.self_attention\.linear_qkv\.([qk])_weight")


def imported_qk(run_dir: RunDir) -> dict[tuple[int, str], torch.Tensor]:
    """(layer, role) → the full Q or K of a run that imported them at its start (init_from.qk:
    imported; pretrain/config/init_from.py), which are its reference instead of the draw; else {}."""
    record = run_dir.read_init_from()
    if not record or record.get("qk") != "imported":
        return {}
    from safetensors import safe_open

    tensors = {}
    with safe_open(str(run_dir.init_from_weights), framework="pt") as f:
        for key in f.keys():
            match = QK_KEY.fullmatch(key)
            if match:
                tensors[(int(match.group(1)), match.group(2))] = f.get_tensor(key)
    return tensors


def use_run_qk(reference: StagedGPT, run_dir: RunDir) -> None:
    """Give a TP=1 reference model the Q/K its run imported, if it imported them (else it keeps the draw)."""
    tensors = imported_qk(run_dir)
    if use_imported_qk(reference, tensors):
        with torch.no_grad():
            for linear in (m for m in reference.modules() if isinstance(m, RandomQKVLinear)):
                for role in linear.imported_qk:
                    getattr(linear, f"{role}_weight").copy_(linear.local_weight(role))


def untrained_qk(model: ModelConfig, freeze: FreezeConfig, steps: int, reference: StagedGPT,
                 checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    """Name → regenerated fp32 value of every Q/K that was frozen in every step before the checkpoint.

    Those are a function of (seed, layer, role) and are regenerated; a Q/K that was trainable in
    some step (attention.train_q/k, or a freeze-schedule stage) is an ordinary trained weight.
    The trainer runs step s (0-based) in schedule stage `freeze.stage_at(s, steps)`.
    """
    stages = {-1}
    if freeze.stages:
        run = RunDir(checkpoint_dir.parent.parent)
        steps_done = run.read_train_state(checkpoint_dir.name)["step"]
        stages = {freeze.stage_at(s, steps) for s in range(max(steps_done, 1))}
    flags = [trainability(model, freeze, index) for index in stages]
    frozen = {}
    for prefix, linear in reference.named_modules():
        if isinstance(linear, RandomQKVLinear):
            for role in ("q", "k"):
                if not any(f[(linear.layer_number, role)] for f in flags):
                    frozen[f"{prefix}.{role}_weight"] = getattr(linear, f"{role}_weight").detach().float()
    return frozen


# ---------------------------------------------------------------------------- reading the files
def module_weights(model: ModelConfig, parallel: ParallelConfig, checkpoint_dir: Path) -> list[StateDict]:
    """Per TP rank, the saved module state dict under the stage names (ZeRO-0/1/2)."""
    if parallel.pipeline > 1:
        return _pipeline_module_weights(model, parallel, checkpoint_dir)
    return [safe_load(checkpoint_dir / f"mp_rank_{rank:02d}_model_states.pt")["module"]
            for rank in range(parallel.tensor)]


def _pipeline_module_weights(model: ModelConfig, parallel: ParallelConfig, checkpoint_dir: Path) -> list[StateDict]:
    """PP>1: each (stage, TP rank) file holds that stage module's own state dict; prefix the stage
    name. The tied gpt2 output stage has no file (its module is the embedding stage's)."""
    specs = stage_specs(model, parallel)
    per_rank: list[StateDict] = [{} for _ in range(parallel.tensor)]
    files = sorted(checkpoint_dir.glob("layer_*-model_states.pt"))
    if not files:
        raise FileNotFoundError(f"{checkpoint_dir}: no pipeline layer files (layer_NN-model_TT-model_states.pt)")
    for path in files:
        stage, rank = pipeline_layer_file_stage(path, specs)
        if rank >= parallel.tensor:
            raise CheckpointMismatch(f"{path.name}: TP rank {rank}, but parallel.tensor={parallel.tensor}")
        per_rank[rank].update({f"{stage}.{key}": value for key, value in safe_load(path).items()})
    return per_rank


def _fp32_master_weights(checkpoint_dir: Path, tp: int) -> list[StateDict]:
    """Per TP rank, DeepSpeed's zero_to_fp32 of that rank's files.

    zero_to_fp32 globs every `*_model_states.pt` / `*_optim_states.pt` of a tag and expects one
    optimizer file per data-parallel rank, so with TP>1 it is given one TP rank's files at a time
    (symlinked into a staging tag): each TP rank's ZeRO partitions cover exactly its own shards.
    """
    per_rank = []
    for rank in range(tp):
        files = sorted(checkpoint_dir.glob(f"*mp_rank_{rank:02d}_*states.pt"))
        with tempfile.TemporaryDirectory(prefix="ora-consolidate-") as staging:
            tag_dir = Path(staging) / checkpoint_dir.name
            tag_dir.mkdir()
            for path in files:
                (tag_dir / path.name).symlink_to(path.resolve())
            chatter = io.StringIO()  # it prints and draws progress bars unconditionally
            with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
                per_rank.append(get_fp32_state_dict_from_zero_checkpoint(staging, tag=checkpoint_dir.name))
            log.debug("zero_to_fp32 of TP rank %d:\n%s", rank, chatter.getvalue())
    return per_rank


def _saved_dtype(state: StateDict) -> torch.dtype:
    return next(v.dtype for v in state.values() if isinstance(v, torch.Tensor) and v.is_floating_point())


# ---------------------------------------------------------------------------- merging and checking
def merge_tensor_parallel(per_rank: list[StateDict], reference: StagedGPT, what: str) -> dict[str, torch.Tensor]:
    """One full tensor per key from the TP ranks' tensors (keys every rank holds, tensors only)."""
    params = dict(reference.named_parameters())
    expected = reference.state_dict()
    keys = [k for k, v in per_rank[0].items() if isinstance(v, torch.Tensor)]
    unknown = [k for k in keys if k not in expected]
    if unknown:
        raise CheckpointMismatch(f"{what} weights hold names the configured model lacks: {unknown[:5]}")
    merged = {}
    for key in keys:
        shards = []
        for rank, state in enumerate(per_rank):
            if key not in state:
                raise CheckpointMismatch(f"{key}: in the {what} weights of TP rank 0 but not of TP rank {rank}")
            shards.append(state[key])
        merged[key] = _merge_shards(key, shards, params.get(key))
        if merged[key].shape != expected[key].shape:
            raise CheckpointMismatch(f"{key}: {what} weights have shape {tuple(merged[key].shape)} after merging "
                                     f"{len(shards)} TP rank(s), the configured model {tuple(expected[key].shape)}")
    return merged


def _merge_shards(name: str, shards: list[torch.Tensor], param: Optional[torch.nn.Parameter]) -> torch.Tensor:
    """A TP-sharded tensor is concatenated along megatron's `partition_dim`; with a
    `partition_stride` s each rank holds s interleaved chunks (SwiGLU's fc1 holds its part of the
    gate and of the up projection), so chunk j of every rank comes before chunk j+1 of any.
    A replicated tensor (norms, row-parallel biases, position embeddings) must be equal on every rank.
    """
    if len(shards) == 1:
        return shards[0]
    if param is not None and getattr(param, "tensor_model_parallel", False):
        dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
        chunks = [shard.chunk(stride, dim) for shard in shards]
        return torch.cat([rank_chunks[j] for j in range(stride) for rank_chunks in chunks], dim)
    for rank, shard in enumerate(shards[1:], start=1):
        if not torch.equal(shard, shards[0]):
            raise CheckpointMismatch(f"{name}: replicated tensor differs between TP rank 0 and TP rank {rank}")
    return shards[0]


def _check_stored_qk(stored: dict[str, torch.Tensor], frozen: dict[str, torch.Tensor], what: str,
                     model: ModelConfig) -> None:
    """Every stored copy of a frozen Q/K must be the regenerated one (up to an ulp of its dtype)."""
    att = model.attention
    for name, regenerated in frozen.items():
        copy = stored.get(name)
        if copy is not None and not matches_regenerated(copy, regenerated):
            raise CheckpointMismatch(
                f"{name}: the frozen weight stored in the checkpoint ({what} copy) differs from the one "
                f"regenerated from model.seed={model.seed}, attention.type={att.type}, "
                f"orthogonal_method={att.orthogonal_method}: the checkpoint was written with a different "
                "seed or attention config")


def _assemble(expected: StateDict, frozen: dict[str, torch.Tensor], master: dict[str, torch.Tensor],
              module: dict[str, torch.Tensor]) -> StateDict:
    """The reference model's keys: frozen Q/K regenerated, weights from the fp32 masters where
    the optimizer held them, else from the module (a re-frozen Q/K, ZeRO-0, pipelines), in fp32.
    Non-tensor entries (megatron's `_extra_state`, None for these local layers) are the reference's."""
    state: StateDict = {}
    missing = []
    for key, value in expected.items():
        if not isinstance(value, torch.Tensor):
            state[key] = value
        elif key in frozen:
            state[key] = frozen[key].clone()
        elif key in master or key in module:
            state[key] = master.get(key, module.get(key)).float().contiguous()
        else:
            missing.append(key)
    if missing:
        raise CheckpointMismatch(
            f"the checkpoint lacks {len(missing)} weight(s) of the configured model: {missing[:5]}")
    return state
