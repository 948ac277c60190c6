"""Resume on a different topology: a checkpoint written with one (DP, TP, PP, ZeRO stage) continues
with another, carrying weights, fp32 master weights, Adam moments and step counts.

DeepSpeed loads a checkpoint only into the layout that wrote it. Its universal checkpoint would lift
that for a changed DP size, but it needs the client's TP slicing patterns, names parameters by the
assembly's own names (`layer1.…` in the plain module, `1.…` / `tied_modules.embedding.…` in the
pipeline one, which differ across a PP change), and has no ZeRO-0 path. So the launcher converts the
checkpoint once, before any worker starts, to a topology-free form cached in the tag's directory:

    checkpoints/<tag>/topology_free/meta.json          source topology, step, parameter names
    checkpoints/<tag>/topology_free/params/<name>.pt   {fp32, exp_avg, exp_avg_sq, step} of one parameter

one entry per optimizer-held parameter, under the `{stage}.{param}` names of the TP=1 model, full
(TP shards merged along megatron's partition_dim / partition_stride, as consolidation does), fp32.
Partitioned optimizer files are read with DeepSpeed's own extraction (zero_files.py); ZeRO-0
keeps torch's optimizer state dict (in bf16 beside DeepSpeed's fp32 copies of the weights), whose
parameter order each checkpoint records (`optimizer_record`, saved as DeepSpeed client state).

Workers of the new topology build their engine as for a fresh run; `load_converted` then sets every
local trainable parameter's weight, fp32 master, Adam moments and its group's step, TP-sliced, through
ds_internals.set_full_optimizer_state (deepspeed.utils.safe_set_full_* under ZeRO; ZeRO-3 keeps its
Adam state elsewhere, see ds_internals.optimizer_flat_params), and reads them back through
full_optimizer_state to check. Frozen Q/K are
never state: they are regenerated as after every load. The data position is train_state.json's step
(a step's samples depend on the step and the global batch).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import torch
from deepspeed import DeepSpeedEngine
from deepspeed.runtime.zero import GatheredParameters
from megatron.core import parallel_state

from ora_megatron.model_config import ModelConfig, ParallelConfig
from ora_megatron.stages import owner_names, stage_specs
from pretrain.checkpoint.consolidate import CheckpointMismatch, merge_tensor_parallel, module_weights, reference_model
from pretrain.checkpoint.resume_check import ResumeRefused
from pretrain.checkpoint.unpickling import safe_load
from pretrain.checkpoint.zero_files import (
    extract_zero_fragments,
    has_partitioned_optimizer_files,
    merged_fragments,
    torch_optimizer_state,
)
from pretrain.config.run_config import RunConfig
from pretrain.job.parallel_layout import ParallelLayout
from pretrain.run_files.run_dir import RunDir, write_text_atomic
from pretrain.runtime.ds_internals import (
    MOMENTS,
    base_optimizer,
    full_fp32_master,
    full_optimizer_state,
    link_optimizer_fragments,
    optimizer_flat_params,
    set_full_fp32_master,
    set_full_optimizer_state,
    whole_tensor_masters,
)
from pretrain.runtime.engine import PipelinedGPT, TrainEngine
from pretrain.runtime.optimizer import param_groups

META = "meta.json"
FORMAT_VERSION = 1
OPTIMIZER_RECORD = "ora_optimizer_params"
"""Client-state key: per torch optimizer group, the stage name of each parameter (ZeRO-0)."""
STATES = ("fp32", *MOMENTS)


@dataclass(frozen=True)
class Topology:
    """How a run's processes partition the model and its optimizer state."""

    layout: ParallelLayout
    zero_stage: int
    precision: str

    def __str__(self) -> str:
        return f"{self.layout}/ZeRO-{self.zero_stage}"

    def to_json(self) -> dict:
        """topology.json's and meta.json's record."""
        return {**self.layout.to_json(), "zero_stage": self.zero_stage, "precision": self.precision}

    @classmethod
    def from_json(cls, record: dict) -> Topology:
        return cls(ParallelLayout.from_json(record), record["zero_stage"], record["precision"])


def run_topology(cfg: RunConfig, world_size: int) -> Topology:
    """The topology a run with this config and process count trains in."""
    return Topology(ParallelLayout.of(cfg.parallel, world_size), cfg.deepspeed.zero_stage, cfg.deepspeed.precision)


def engine_topology(train_engine: TrainEngine) -> Topology:
    """The topology of a running engine (every rank gets the same)."""
    ds_engine = train_engine.ds_engine
    precision = "bf16" if ds_engine.bfloat16_enabled() else "fp16" if ds_engine.fp16_enabled() else "fp32"
    return Topology(train_engine.layout, ds_engine.zero_optimization_stage(), precision)


# ---------------------------------------------------------------------------- at save (Checkpointer.save)
def record_topology(run_dir: RunDir, tag: str, topology: Topology) -> None:
    """Rank 0, once the tag's DeepSpeed files exist and before its integrity record."""
    write_text_atomic(run_dir.topology_file(tag), json.dumps(topology.to_json(), indent=1) + "\n")


def optimizer_record(train_engine: TrainEngine) -> dict:
    """Client state for `save_checkpoint`: which parameter each slot of a plain torch optimizer holds.

    ZeRO-0 saves torch's state dict, whose entries are numbered, not named (DeepSpeed saves
    `param_shapes` only for its partitioned optimizers, which need no record); in bf16 torch's
    entries are DeepSpeed's fp32 copies of the weights. A tied module's copy on a later pipeline stage
    is recorded as None: the first stage's copy is the one carried.
    """
    masters = whole_tensor_masters(train_engine.ds_engine)
    if masters is None:
        return {}
    names = {}
    for raw, param in train_engine.module.named_parameters():
        if param not in masters:  # frozen: outside the optimizer
            continue
        if train_engine.pipelined:
            module = train_engine.module
            names[id(masters[param])] = None if module.is_tied_replica(raw) else module.stage_name(raw)
        else:
            names[id(masters[param])] = raw
    groups = [[names[id(p)] for p in group["params"]] for group in base_optimizer(train_engine.ds_engine).param_groups]
    return {OPTIMIZER_RECORD: {"tp_rank": parallel_state.get_tensor_model_parallel_rank(), "groups": groups}}


# ---------------------------------------------------------------------------- before the workers start
def checkpoint_topology(run_dir: RunDir, tag: str) -> Topology:
    """The topology a checkpoint was written with (its topology.json, covered by its integrity record)."""
    return Topology.from_json(json.loads(run_dir.topology_file(tag).read_text()))


def converted_dir(run_dir: RunDir, tag: str) -> Path:
    return run_dir.topology_free_dir(tag)


def is_converted(run_dir: RunDir, tag: str) -> bool:
    """A complete conversion in this format (meta.json is written last, then the folder renamed)."""
    meta = converted_dir(run_dir, tag) / META
    return meta.is_file() and json.loads(meta.read_text()).get("format") == FORMAT_VERSION


@dataclass
class TopologyChange:
    """A resume whose checkpoint another topology wrote; `convert` prepares it (once)."""

    run_dir: RunDir
    tag: str
    cfg: RunConfig = field(repr=False)
    source: Topology
    target: Topology

    def convert(self) -> str:
        """Convert the checkpoint unless its conversion is cached; returns the line to log."""
        path = converted_dir(self.run_dir, self.tag)
        head = f"checkpoint {self.tag} written with {self.source}, resuming with {self.target}"
        if is_converted(self.run_dir, self.tag):
            return f"{head}: using its topology-free conversion cached in {path}"
        start = time.time()
        count = convert_checkpoint(self.run_dir, self.tag, self.cfg, self.source)
        return f"{head}: converted once to {path} ({count} parameters, {time.time() - start:.1f} s)"


def plan_topology_change(run_dir: RunDir, tag: Optional[str], cfg: RunConfig,
                         world_size: int) -> Optional[TopologyChange]:
    """None when there is nothing to resume or the topology is the checkpoint's; raises ResumeRefused for
    a change that cannot be carried. Reads only (the launcher calls `convert` on what it returns)."""
    if tag is None:
        return None
    source, target = checkpoint_topology(run_dir, tag), run_topology(cfg, world_size)
    if source == target:
        return None
    problem = _unconvertible(source, target)
    if problem:
        raise ResumeRefused(f"cannot resume {run_dir.path} from checkpoint {tag} (written with {source}) "
                            f"with {target}: {problem}")
    return TopologyChange(run_dir, tag, cfg, source, target)


def _unconvertible(source: Topology, target: Topology) -> Optional[str]:
    if source.precision != target.precision:
        return (f"deepspeed.precision {source.precision} → {target.precision}: a topology change keeps the "
                "checkpoint's precision")
    if source.precision == "fp16":
        return ("fp16's dynamic loss scale lives in DeepSpeed's optimizer wrapper and is not carried to another "
                "topology; resume with the checkpoint's topology")
    return None


# ---------------------------------------------------------------------------- the conversion
def convert_checkpoint(run_dir: RunDir, tag: str, cfg: RunConfig, source: Topology) -> int:
    """Write `<tag>/topology_free/` from the tag's DeepSpeed files (one process, no process group of
    the old layout needed); returns the number of parameters. Atomic: built aside, then renamed."""
    old = replace(cfg, parallel=replace(cfg.parallel, tensor=source.layout.tensor, pipeline=source.layout.pipeline),
                  deepspeed=replace(cfg.deepspeed, zero_stage=source.zero_stage, precision=source.precision))
    reference = reference_model(old.model)
    staging = Path(tempfile.mkdtemp(prefix=f".{tag}-{run_dir.topology_free_dir(tag).name}-", dir=run_dir.checkpoints))
    try:
        per_rank, steps = _read_states(old.model, old.parallel, source, run_dir.checkpoint(tag),
                                       staging / "fragments", reference)
        merged = {key: merge_tensor_parallel(per_rank[key], reference, key) for key in STATES}
        shutil.rmtree(staging / "fragments", ignore_errors=True)
        (staging / "params").mkdir()
        for name in merged["fp32"]:
            entry = {key: merged[key][name].float().contiguous() for key in STATES}
            torch.save({**entry, "step": steps[name]}, staging / "params" / f"{name}.pt")
        meta = {"format": FORMAT_VERSION, "source": source.to_json(), "step": run_dir.read_train_state(tag)["step"],
                "params": sorted(merged["fp32"])}
        (staging / META).write_text(json.dumps(meta, indent=1) + "\n")
        final = converted_dir(run_dir, tag)
        shutil.rmtree(final, ignore_errors=True)  # an incomplete leftover has no meta.json
        os.replace(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return len(merged["fp32"])


StatesPerRank = dict[str, list[dict[str, torch.Tensor]]]


def _read_states(model: ModelConfig, parallel: ParallelConfig, source: Topology, checkpoint: Path, fragments: Path,
                 reference: torch.nn.Module) -> tuple[StatesPerRank, dict[str, int]]:
    """Per state ("fp32", "exp_avg", "exp_avg_sq"), per TP rank, stage name → this rank's shard; and
    each parameter's Adam step."""
    if not has_partitioned_optimizer_files(checkpoint):
        return _torch_optimizer_states(model, parallel, checkpoint)
    tp, zero3_steps = extract_zero_fragments(checkpoint, fragments, source.zero_stage)
    stage_name = _stage_namer(model, parallel)
    params = dict(reference.named_parameters())
    per_rank: StatesPerRank = {key: [{} for _ in range(tp)] for key in STATES}
    steps = {}
    for raw in sorted(os.listdir(fragments)):
        name = stage_name(raw)
        if name not in params:
            raise CheckpointMismatch(f"{checkpoint}: optimizer state of {raw!r}, which the configured model lacks")
        shape = _shard_shape(params[name], tp)
        for key in STATES:
            for rank, flat in enumerate(merged_fragments(fragments, raw, key, tp)):
                per_rank[key][rank][name] = flat.view(shape)
        if raw in zero3_steps:
            steps[name] = zero3_steps[raw]
        else:
            per_tp = {int(s) for s in merged_fragments(fragments, raw, "step", tp)}
            if len(per_tp) != 1:
                raise CheckpointMismatch(f"{raw}: Adam steps {sorted(per_tp)} differ between TP ranks")
            steps[name] = per_tp.pop()
    return per_rank, steps


def _torch_optimizer_states(model: ModelConfig, parallel: ParallelConfig,
                            checkpoint: Path) -> tuple[StatesPerRank, dict[str, int]]:
    """ZeRO-0: fp32 masters (the weights of the module files in fp32, DeepSpeed's fp32 copies in bf16),
    moments and steps from torch's state dict of each model-parallel rank, named by the checkpoint's
    optimizer record."""
    module = module_weights(model, parallel, checkpoint)
    per_rank: StatesPerRank = {key: [{} for _ in module] for key in STATES}
    steps = {}
    for path in sorted(checkpoint.glob("mp_rank_*_model_states.pt")):
        optimizer, record, masters = torch_optimizer_state(path, OPTIMIZER_RECORD)
        if record is None:
            raise CheckpointMismatch(f"{path} has no {OPTIMIZER_RECORD}: its optimizer entries cannot be named")
        rank = record["tp_rank"]
        for g, (group, names) in enumerate(zip(optimizer["param_groups"], record["groups"], strict=True)):
            for j, (index, name) in enumerate(zip(group["params"], names, strict=True)):
                state = optimizer["state"].get(index)
                if name is None or state is None:  # a tied replica; a parameter that never had a gradient
                    continue
                per_rank["fp32"][rank][name] = module[rank][name] if masters is None else masters[g][j]
                for key in MOMENTS:
                    per_rank[key][rank][name] = state[key]
                steps[name] = int(state["step"])
    return per_rank, steps


def _stage_namer(model: ModelConfig, parallel: ParallelConfig):
    """DeepSpeed's parameter name in the checkpoint's assembly → `{stage}.{param}`."""
    if parallel.pipeline == 1:
        return lambda raw: raw
    specs = stage_specs(model, parallel)
    # PipelinedGPT.stage_name reads only these two attributes; the pipeline module itself needs the
    # old layout's process groups.
    names = SimpleNamespace(stage_names=[spec.name for spec in specs], tied_owners=owner_names(specs))
    return functools.partial(PipelinedGPT.stage_name, names)


def _shard_shape(param: torch.nn.Parameter, tp: int) -> list[int]:
    """Shape of one TP rank's shard of a TP=1 reference parameter."""
    shape = list(param.shape)
    if tp > 1 and getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] //= tp
    return shape


# ---------------------------------------------------------------------------- in the workers
def converted_checkpoint(run_dir: RunDir, tag: str, cfg: RunConfig, world_size: int) -> Optional[Path]:
    """The conversion to load instead of DeepSpeed's files, or None when this run's topology wrote the tag."""
    source, target = checkpoint_topology(run_dir, tag), run_topology(cfg, world_size)
    if source == target:
        return None
    if not is_converted(run_dir, tag):
        raise RuntimeError(f"checkpoint {tag} was written with {source} and this run is {target}, but it was not "
                           f"converted ({converted_dir(run_dir, tag)} is missing): start the run through "
                           "python -m pretrain.pretrain_ora, which converts it before the workers start")
    return converted_dir(run_dir, tag)


def load_converted(train_engine: TrainEngine, path: Path) -> None:
    """Set this rank's trainable parameters, fp32 masters, Adam moments and group steps from a conversion,
    then read them back (ds_internals.full_optimizer_state) and check they are exactly what was set."""
    meta = json.loads((path / META).read_text())
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    loaded, param_steps, missing = {}, {}, []
    for name, param in train_engine.named_parameters():
        if not param.requires_grad:
            continue  # frozen: regenerated from the seed, never state
        file = path / "params" / f"{name}.pt"
        if not file.is_file():
            missing.append(name)
            continue
        entry = safe_load(file)
        local = {key: _tp_shard(name, entry[key], param, tp_rank, tp_size) for key in STATES}
        _set_weight(param, local["fp32"])
        loaded[name], param_steps[id(param)] = (param, local), entry["step"]
    if missing:
        raise CheckpointMismatch(f"{path}: no state for the trainable parameter(s) {missing[:5]}")
    steps = _group_steps(train_engine, param_steps)
    _set_optimizer_state(train_engine.ds_engine, loaded, steps)
    _check_optimizer_state(train_engine.ds_engine, loaded, steps)
    train_engine.ds_engine.global_steps = meta["step"]
    train_engine.ds_engine.global_samples = meta["step"] * train_engine.ds_engine.train_batch_size()


def load_weights(train_engine: TrainEngine, state: dict[str, torch.Tensor]) -> int:
    """Set every parameter of this rank from full TP=1 tensors under the stage names (`state`, e.g. the
    weights a run imports): the module's copy, and for trainable ones the optimizer's fp32 master
    (ZeRO and mixed precision keep their own), TP-sliced, in any layout. A fresh engine's Adam state
    does not exist yet and stays so. Every master is read back and must be exactly what was set.
    Returns the number of parameters set."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    missing = [name for name, _ in train_engine.named_parameters() if name not in state]
    if missing:
        raise CheckpointMismatch(f"no weights for the parameter(s) {missing[:5]}")
    ds_engine, trainable, count = train_engine.ds_engine, [], 0
    for name, param in train_engine.named_parameters():
        local = _tp_shard(name, state[name].float(), param, tp_rank, tp_size)
        _set_weight(param, local)
        count += 1
        if param.requires_grad:
            trainable.append((name, param, local))
    masters = whole_tensor_masters(ds_engine)
    for _, param, local in trainable:
        set_full_fp32_master(ds_engine, param, local, masters)
    wrong = [name for name, param, local in trainable  # a collective under ZeRO: every rank, same order
             if not torch.equal(full_fp32_master(param, masters).cpu().flatten().float(), local.flatten().float())]
    if wrong:
        raise RuntimeError(f"DeepSpeed's optimizer does not hold the fp32 weights it was given: {wrong[:5]}")
    return count


def _tp_shard(name: str, full: torch.Tensor, param: torch.nn.Parameter, rank: int, size: int) -> torch.Tensor:
    """This TP rank's shard of a full tensor: with partition_stride s, rank r holds chunk j·size + r of
    the s·size chunks along partition_dim for j < s (the inverse of consolidation's merge)."""
    shard = full
    if size > 1 and getattr(param, "tensor_model_parallel", False):
        dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
        chunks = full.chunk(stride * size, dim)
        shard = torch.cat([chunks[j * size + rank] for j in range(stride)], dim)
    expected = tuple(getattr(param, "ds_shape", param.shape))  # ZeRO-3 keeps the unpartitioned shape aside
    if tuple(shard.shape) != expected:
        raise CheckpointMismatch(f"{name}: converted state {tuple(full.shape)} gives a TP shard of "
                                 f"{tuple(shard.shape)}, this rank's parameter is {expected}")
    return shard.contiguous()


def _set_weight(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """The module's copy of the weight (the fp32 master is set through the optimizer)."""
    if hasattr(param, "ds_id"):  # ZeRO-3: the whole tensor exists only while gathered
        with GatheredParameters([param], modifier_rank=0):
            param.data.copy_(value.to(param.device, param.dtype).view(param.shape))
    else:
        param.data.copy_(value.to(param.device, param.dtype).view(param.shape))


def _group_steps(train_engine: TrainEngine, param_steps: dict[int, int]) -> dict[str, torch.Tensor]:
    """The Adam step of each of the engine's parameter groups.

    One step count for all (the usual case): every group gets it. Several (weights unfrozen by a freeze
    schedule count their own steps): each group of the engine (as build_engine made them) must agree.
    Freeze schedules run with ZeRO-0/1/2 only, whose parameters keep their shapes, so `param_groups`
    classifies them as it did for build_engine (ZeRO-3's placeholders would look 1-d).
    """
    counts = set(param_steps.values())
    if len(counts) <= 1:
        return {group["name"]: torch.tensor(float(count))
                for count in counts for group in base_optimizer(train_engine.ds_engine).param_groups}
    steps = {}
    for group in param_groups(train_engine.module, 0.0):
        found = {param_steps[id(p)] for p in group["params"] if id(p) in param_steps}
        if len(found) > 1:
            raise CheckpointMismatch(
                f"the parameters of optimizer group {group['name']} were saved with different Adam steps "
                f"{sorted(found)}; one group keeps one step count")
        if found:
            steps[group["name"]] = torch.tensor(float(found.pop()))
    return steps


def _set_optimizer_state(ds_engine: DeepSpeedEngine, loaded: dict, steps: dict[str, torch.Tensor]) -> None:
    """Adam's state, created with the carried group steps (torch creates it lazily at the first step, and
    ZeRO-1/2 link their fragments to it then), then each parameter's moments and fp32 master."""
    base = base_optimizer(ds_engine)
    for flat, group in optimizer_flat_params(ds_engine):
        if group["name"] in steps:
            base.state[flat] = {"step": steps[group["name"]].clone(),
                                **{key: torch.zeros_like(flat) for key in MOMENTS}}
    link_optimizer_fragments(ds_engine)
    masters = whole_tensor_masters(ds_engine)
    for param, local in loaded.values():
        set_full_optimizer_state(ds_engine, param, local, masters)


def _check_optimizer_state(ds_engine: DeepSpeedEngine, loaded: dict, steps: dict[str, torch.Tensor]) -> None:
    """Read every loaded value back as DeepSpeed sees it; anything not exactly as set is an error."""
    base, wrong, masters = base_optimizer(ds_engine), [], whole_tensor_masters(ds_engine)
    for name, (param, local) in loaded.items():
        got = full_optimizer_state(ds_engine, param, masters)  # every rank reads the same parameters
        wrong += [f"{key} of {name}" for key in STATES
                  if got[key] is None or not torch.equal(got[key].detach().cpu().flatten().float(),
                                                         local[key].flatten().float())]
    wrong += [f"Adam step of group {group['name']}" for flat, group in optimizer_flat_params(ds_engine)
              if group["name"] in steps and float(base.state[flat]["step"]) != float(steps[group["name"]])]
    if wrong:
        raise RuntimeError(f"DeepSpeed's optimizer does not hold the converted state it was given: {wrong[:5]}")
