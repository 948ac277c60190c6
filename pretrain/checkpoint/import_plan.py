"""Checking and converting the weights a run starts from (init_from.path, pretrain/config/init_from.py),
in the process that resolves the run, before any worker. `plan_import`:

1. reads the source's config and refuses, naming the field, a family other than model.family, a
   setting the model cannot compute (GPT-2's other activations or attention scalings, Llama's biases
   or RoPE scaling...) and a head count other than the model's. Settings that change the numerics
   and that the model can compute are taken over into the run's model config, so that the run
   computes what the source computes: the activation (published GPT-2 checkpoints use the tanh
   GELU), the norm epsilon, the RoPE base. Each is reported and recorded;
2. reads the weights (safetensors only: pickled `pytorch_model.bin` files can run code when loaded;
   a run's checkpoint is consolidated with the restricted unpickler) and compares every tensor with
   the run's model, refusing at the first that is missing, extra or of another shape (its name);
3. converts them into the run's model (TP=1, fp32, `{stage}.{param}` names): Q, K and V re-laid for
   the run's attention (megatron's fused QKV, or ORA's separate Q/K/V). For random-Q/K attention
   `init_from.qk` decides Q/K: `draw` keeps the ones the run draws from model.seed (the source's
   Q/K biases go with its Q/K), `imported` takes the source's, which then are the run's reference for
   frozen Q/K (checked and restored after every load, as the draw is otherwise; K's bias is dropped,
   which no attention weight depends on; a nonzero Q bias is refused). Vocabulary padding rows (never
   a token) are the source run's when it pads alike, else the run's own init.

`write_import` then writes RUN/init_from/weights.safetensors and the record RUN/init_from.json (the
source, the files read with their sha256, the Q/K choice, the settings taken over, the tokenizer
comparison).
"""


from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

import torch

from ora_megatron.families import family_of, hf_mapping_of
from ora_megatron.families.hf import QKV, HFConfigRefused, join_qkv, split_qkv
from ora_megatron.model_config import ModelConfig
from pretrain.config.init_from import ImportRefused
from pretrain.config.run_config import RunConfig, read_run_config
from pretrain.config.runtime_sections import DataConfig
from pretrain.run_files.run_dir import RunDir, file_sha256

VOCAB_KEYS = ("embedding.embedding.word_embeddings.weight", "output.output_layer.weight")
PICKLED_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
HF_INDEX = "model.safetensors.index.json"


@dataclass
class ImportPlan:
    """A checked and converted import, before anything is written."""

    cfg: RunConfig  # the run's config with the source's numerics taken over into its model
    record: dict  # what RUN/init_from.json will hold
    state: dict[str, torch.Tensor] = field(repr=False)  # the run's whole model, TP=1 names, fp32

    def notice(self) -> str:
        r = self.record
        taken = ", ".join(f"{k} {_text(old)} → {_text(new)}" for k, (old, new) in r["taken_over"].items())
        qk = f", Q/K {r['qk']}" if r["qk"] else ""
        return (f"init_from: {r['kind']} {r['source']}" + (f" ({r['checkpoint']})" if r["checkpoint"] else "")
                + f", {len(r['files'])} files{qk}" + (f"; taken over: {taken}" if taken else "")
                + f"; tokenizer: {r['tokenizer']}")


def _text(value: Any) -> str:
    return "null" if value is None else str(value)


@dataclass(frozen=True)
class Target:
    """What the source is checked against and converted into: the run's model, its init_from.qk choice and
    its sentencepiece model (None: mock data)."""

    model: ModelConfig
    qk: Optional[str]
    tokenizer: Optional[str]


def effective(model: ModelConfig, name: str) -> Any:
    """The value a numerics setting has in the model (model.activation null: the family's own)."""
    return model.activation_name if name == "activation" else getattr(model, name)


# ---------------------------------------------------------------------------- the launcher's side
def plan_import(cfg: RunConfig) -> ImportPlan:
    """Check `cfg.init_from.path` against the run's model and convert it; raises ImportRefused."""
    from pretrain.runtime.data import tokenizer_path

    source = Path(cfg.init_from.path).expanduser()
    if not source.exists():
        raise ImportRefused(f"config error at 'init_from.path': {source} does not exist")
    target = Target(cfg.model, cfg.init_from.qk, tokenizer_path(cfg.data))
    if source.is_dir() and (source / "config.json").is_file():
        model, record, state = _plan_hf(target, source.resolve())
    else:
        run, tag = _run_source(source)
        if run is None:
            raise ImportRefused(f"config error at 'init_from.path': {source} is neither a Hugging Face model "
                                "directory (config.json and *.safetensors) nor a run dir of this project "
                                "(config.yaml) nor one of its checkpoints (RUN/checkpoints/<tag>)")
        model, record, state = _plan_run(target, run, tag)
    return ImportPlan(replace(cfg, model=model), record, state)


def _run_source(source: Path) -> tuple[Optional[RunDir], Optional[str]]:
    """(run dir, checkpoint tag) for a run dir (its latest checkpoint) or a checkpoint directory of one."""
    source = source.resolve()
    if source.is_dir() and RunDir(source).config.is_file():
        run = RunDir(source)
        tag = run.latest_checkpoint()
        if tag is None:
            raise ImportRefused(f"config error at 'init_from.path': run dir {source} has no complete checkpoint "
                                f"({run.latest_pointer} is missing)")
        return run, tag
    owner = RunDir(source.parent.parent)
    if source.is_dir() and source.parent.name == RunDir.checkpoints.name and owner.config.is_file():
        return owner, source.name
    return None, None


def _reference_state(model: ModelConfig) -> dict[str, torch.Tensor]:
    """The run's own model at its init (the draw of Q/K, the padding rows), TP=1, fp32 tensors only."""
    from pretrain.checkpoint.consolidate import reference_model  # builds megatron modules

    state = reference_model(model).state_dict()
    return {k: v.detach().float() for k, v in state.items() if isinstance(v, torch.Tensor)}


def _take_over(target: Target, values: dict[str, Any], origin: str) -> tuple[Target, dict[str, list]]:
    """The target with the source's numerics; {"model.<field>": [old, new]} for every one that changed."""
    changed, model = {}, target.model
    for name, value in values.items():
        if effective(model, name) != value:
            changed[f"model.{name}"] = [getattr(model, name), value]
            model = replace(model, **{name: value})
    try:
        model.validate("model")
    except ValueError as e:
        raise ImportRefused(f"{origin}: the settings taken over do not fit the run's model: {e}") from None
    return replace(target, model=model), changed


Converted = tuple[ModelConfig, dict, dict[str, torch.Tensor]]  # ImportPlan's model, record and state


def _plan_hf(target: Target, source: Path) -> Converted:
    config_file = source / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise ImportRefused(f"config error at 'init_from.path': cannot read {config_file}: {e}") from None
    model_type = config.get("model_type")
    if model_type not in ("gpt2", "llama"):
        raise ImportRefused(f"{config_file}: model_type {model_type!r}: this project imports gpt2 and llama models")
    if model_type != target.model.family:
        raise ImportRefused(f"config error at 'model.family': {target.model.family}, but {config_file} holds a "
                            f"{model_type} model (model_type): set model.family={model_type} and its sizes")
    mapping = hf_mapping_of(target.model)
    try:
        numerics = mapping.model_fields(config, target.model)
    except HFConfigRefused as e:
        raise ImportRefused(f"{config_file}: {e}") from None
    target, taken_over = _take_over(target, numerics, str(config_file))
    from safetensors.torch import load_file

    weight_files = _hf_weight_files(source)
    hf = {}
    for path in weight_files:
        hf.update(load_file(path))
    normalise = getattr(mapping, "normalised_hf_keys", None)
    hf = normalise(hf) if normalise else hf
    hf = {k: v for k, v in hf.items() if not mapping.IGNORED_HF_KEYS.fullmatch(k)}
    base = _reference_state(target.model)
    expected = mapping.hf_state_dict(base, target.model)
    _compare_hf(hf, expected, mapping.optional_hf_keys(config), mapping.SHAPE_HINTS, source)
    rest, attention = mapping.from_hf_state_dict({k: v.float() for k, v in hf.items()}, target.model, config)
    state = _assemble(target, base, rest, attention, names=_hf_attention_names(mapping, target.model))
    files = [config_file, *weight_files] + ([source / HF_INDEX] if (source / HF_INDEX).is_file() else [])
    candidate = source / "tokenizer.model"
    tokenizer, tokenizer_file = _compare_tokenizer_file(target.tokenizer, candidate, str(candidate))
    if tokenizer_file is not None:
        files.append(tokenizer_file)
    entries = {str(p.relative_to(source)): _file_entry(p) for p in files}
    record = _record(target.qk, "hugging_face", source, None, entries, taken_over, tokenizer, source_attention=None)
    return target.model, record, state


def _hf_weight_files(source: Path) -> list[Path]:
    index = source / HF_INDEX
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (source / n).is_file()]
        if missing:
            raise ImportRefused(f"{index} names {missing[0]}, which is not in {source}")
        return [source / n for n in names]
    files = sorted(source.glob("*.safetensors"))
    if files:
        return files
    pickled = sorted(p.name for pattern in PICKLED_WEIGHTS for p in source.glob(pattern))
    if pickled:
        raise ImportRefused(
            f"config error at 'init_from.path': {source} holds its weights as {pickled[0]} (pickle), which can run "
            "code when loaded: this project reads safetensors only. Convert them where you trust the file, e.g. "
            "AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(NEW_DIR) (writes model.safetensors)")
    raise ImportRefused(f"config error at 'init_from.path': {source} holds no *.safetensors weights")


def _compare_hf(hf: dict, expected: dict, optional: tuple, hints: dict, source: Path) -> None:
    """Every tensor the run's model needs, with its shape, in the model's order; then nothing else."""
    for name, want in expected.items():
        got = hf.get(name)
        if got is None:
            if name in optional:
                continue
            raise ImportRefused(f"{source}: the weights lack {name} {list(want.shape)}, which the run's model needs")
        if tuple(got.shape) != tuple(want.shape):
            hint = hints.get(name)
            raise ImportRefused(f"{source}: {name} has shape {list(got.shape)}, the run's model needs "
                                f"{list(want.shape)}" + (f" ({hint})" if hint else "")
                                + ": set the run's model sizes to the source's")
    extra = [name for name in hf if name not in expected]
    if extra:
        raise ImportRefused(f"{source}: {extra[0]} {list(hf[extra[0]].shape)} has no place in the run's model "
                            "(a model of its family and sizes has no such tensor)")


def _hf_attention_names(mapping, model: ModelConfig) -> dict[str, str]:
    """Attention prefix → the source tensor its Q and K come from, for messages."""
    if mapping.ARCHITECTURE == "GPT2LMHeadModel":
        return {f"layer{i}.layer.self_attention": f"transformer.h.{i - 1}.attn.c_attn.bias"
                for i in range(1, model.num_layers + 1)}
    return {f"layer{i}.layer.self_attention": f"model.layers.{i - 1}.self_attn.q_proj"
            for i in range(1, model.num_layers + 1)}


def _plan_run(target: Target, run: RunDir, tag: str) -> Converted:
    from pretrain.checkpoint.consolidate import CheckpointMismatch, consolidated_state_dict
    from pretrain.checkpoint.unpickling import UnsafeCheckpointFile

    where = run.checkpoint(tag)
    problems = run.verify_checkpoint(tag)
    if problems:
        raise ImportRefused(f"config error at 'init_from.path': checkpoint {where} is damaged: {problems[0]}")
    try:
        source_cfg = read_run_config(run)
    except (ValueError, OSError) as e:
        raise ImportRefused(f"config error at 'init_from.path': cannot read {run.config}: {e}") from None
    src, model = source_cfg.model, target.model
    if src.family != model.family:
        raise ImportRefused(f"config error at 'model.family': {model.family}, but {run.path} trained a {src.family} "
                            "model")
    if not src.attention.uses_qk:
        raise ImportRefused(f"config error at 'init_from.path': {run.path} trained attention type "
                            f"'{src.attention.type}', which has no Q/K projections to import")
    for name in ("num_attention_heads", "query_groups", "vocab_size"):  # shapes may not show these
        if getattr(src, name) != getattr(model, name):
            key = "num_query_groups" if name == "query_groups" else name
            first = VOCAB_KEYS[0] if name == "vocab_size" else "layer1.layer.self_attention.linear_qkv"
            raise ImportRefused(f"config error at 'model.{key}': {getattr(model, name)}, the source run {run.path} "
                                f"has {getattr(src, name)} (first tensor that differs: {first})")
    numerics = {"activation": src.activation_name, "layernorm_epsilon": src.layernorm_epsilon}
    if family_of(model).position_embedding == "rope":
        numerics["rotary_base"] = src.rotary_base
    target, taken_over = _take_over(target, numerics, str(run.config))
    try:
        consolidated = consolidated_state_dict(source_cfg, where)
    except (CheckpointMismatch, UnsafeCheckpointFile, OSError) as e:
        raise ImportRefused(f"config error at 'init_from.path': {where}: {e}") from None
    source_state = {k: v for k, v in consolidated.state_dict.items() if isinstance(v, torch.Tensor)}
    rest, attention = split_attention(source_state, src)
    base = _reference_state(target.model)
    base_rest, base_attention = split_attention(base, target.model)
    _compare_ours(rest, attention, base_rest, base_attention, target.model, run.path)
    state = _assemble(target, base, rest, attention, names={p: f"{p}.linear_qkv" for p in attention})
    integrity = json.loads(run.integrity_record_file(tag).read_text())["files"]
    files = {"config.yaml": _file_entry(run.config),
             **{f"checkpoints/{tag}/{name}": entry for name, entry in sorted(integrity.items())}}
    tokenizer = _compare_run_tokenizer(target.tokenizer, source_cfg.data, run)
    record = _record(target.qk, "run", run.path.resolve(), tag, files, taken_over, tokenizer,
                     source_attention=src.attention.type)
    return target.model, record, state


def split_attention(state: dict[str, torch.Tensor], model: ModelConfig) -> tuple[dict, dict[str, QKV]]:
    """(every tensor but the attention input projections; each layer's Q, K, V and biases)."""
    attention, rest = {}, dict(state)
    for i in range(1, model.num_layers + 1):
        prefix = f"layer{i}.layer.self_attention"
        attention[prefix] = split_qkv(state, prefix, model)
        for key in [k for k in rest if k.startswith(f"{prefix}.linear_qkv.")]:
            del rest[key]
    return rest, attention


def _compare_ours(rest: dict, attention: dict, base_rest: dict, base_attention: dict, model: ModelConfig,
                  source: Path) -> None:
    for name, want in base_rest.items():
        got = rest.get(name)
        if got is None:
            raise ImportRefused(f"{source}: the source lacks {name} {list(want.shape)}, which the run's model needs")
        if tuple(got.shape) != tuple(want.shape) and not _vocab_fits(name, got, want, model):
            raise ImportRefused(f"{source}: {name} has shape {list(got.shape)}, the run's model needs "
                                f"{list(want.shape)}: set the run's model sizes to the source's")
    for prefix, want in base_attention.items():
        for role in ("q", "k", "v"):
            got = getattr(attention[prefix], role)
            if tuple(got.shape) != tuple(getattr(want, role).shape):
                raise ImportRefused(f"{source}: the {role.upper()} weight of {prefix} has shape {list(got.shape)}, the "
                                    f"run's model needs {list(getattr(want, role).shape)}: set the run's model sizes "
                                    "to the source's")
    extra = [name for name in rest if name not in base_rest]
    if extra:
        raise ImportRefused(f"{source}: {extra[0]} has no place in the run's model")


def _vocab_fits(name: str, got: torch.Tensor, want: torch.Tensor, model: ModelConfig) -> bool:
    """An embedding or output table whose real vocabulary rows fit the run's (only the padding differs)."""
    return (name in VOCAB_KEYS and got.dim() == want.dim() and got.shape[1:] == want.shape[1:]
            and min(got.size(0), want.size(0)) >= model.vocab_size)


def _assemble(target: Target, base: dict[str, torch.Tensor], rest: dict, attention: dict[str, QKV],
              names: dict[str, str]) -> dict[str, torch.Tensor]:
    """The run's whole model: `rest` (the padding rows as `_vocab_fits` allows), Q/K/V joined into the
    run's attention layout, Q/K drawn or imported as init_from.qk says."""
    model = target.model
    separate = model.attention.custom_qkv
    base_rest, base_attention = split_attention(base, model)
    state = {}
    for name, want in base_rest.items():
        got = rest[name].float()
        if tuple(got.shape) != tuple(want.shape):  # vocabulary padding: real rows from the source
            got = torch.cat([got[: model.vocab_size], want[model.vocab_size:]])
        state[name] = got.contiguous()
    for prefix, qkv in attention.items():
        drawn = base_attention[prefix]
        if separate and target.qk == "draw":
            qkv = qkv._replace(q=drawn.q, k=drawn.k, q_bias=None, k_bias=None)
        elif separate:  # imported: K's bias adds q·b_k to every score of a query alike; softmax ignores it
            if qkv.q_bias is not None and bool(qkv.q_bias.ne(0).any()):
                raise ImportRefused(
                    f"config error at 'init_from.qk': imported, but the source's Q bias ({names[prefix]}) is "
                    f"nonzero, and {model.attention.type}'s frozen Q carries none: use draw, or import into vanilla "
                    "attention")
            qkv = qkv._replace(q_bias=None, k_bias=None)
        state.update({k: v.float().contiguous()
                      for k, v in join_qkv(qkv, prefix, model, separate, family_of(model).bias).items()})
    missing = [k for k in base if k not in state]
    wrong = [k for k in base if k in state and state[k].shape != base[k].shape]
    if missing or wrong:  # the checks before make this unreachable
        raise RuntimeError(f"import assembled a model without {missing[:3]} / with wrong shapes {wrong[:3]}")
    return {k: state[k] for k in base}


# ---------------------------------------------------------------------------- tokenizer
def _compare_tokenizer_file(ours: Optional[str], candidate: Path, label: str) -> tuple[str, Optional[Path]]:
    """(what the record says about the tokenizer, the file compared if any), `ours` the run's."""
    if ours is None:
        return "not compared: the run reads mock data", None
    if not candidate.is_file():
        return f"not compared: the source has no sentencepiece model ({label})", None
    if file_sha256(candidate) != file_sha256(Path(ours)):
        raise ImportRefused(f"config error at 'data.tokenizer': {ours} is not the tokenizer the source was trained "
                            f"with ({label}, another sha256): its token ids would mean other pieces")
    return f"the same sentencepiece model as {label} (sha256)", candidate


def _compare_run_tokenizer(ours: Optional[str], source_data: DataConfig, run: RunDir) -> str:
    from pretrain.runtime.data import tokenizer_path

    try:
        theirs = tokenizer_path(source_data)
    except (OSError, ValueError, KeyError):
        return f"not compared: the tokenizer of {run.path} cannot be found (its manifest moved?)"
    if theirs is None:
        return f"not compared: {run.path} trained on mock data"
    return _compare_tokenizer_file(ours, Path(theirs), theirs)[0]


# ---------------------------------------------------------------------------- the record
def _file_entry(path: Path) -> dict:
    return {"size": path.stat().st_size, "sha256": file_sha256(path)}


def _record(qk: Optional[str], kind: str, source: Path, tag: Optional[str], files: dict, taken_over: dict,
            tokenizer: str, source_attention: Optional[str]) -> dict:
    return {"source": str(source), "kind": kind, "checkpoint": tag, "source_attention": source_attention,
            "files": files, "qk": qk, "taken_over": taken_over, "tokenizer": tokenizer,
            "weights": None, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def write_import(run_dir: RunDir, plan: ImportPlan) -> None:
    """RUN/init_from/weights.safetensors, then the record (which names the weights' sha256)."""
    from safetensors.torch import save_file

    run_dir.init_from_dir.mkdir(parents=True, exist_ok=True)
    partial = run_dir.init_from_weights.with_name(run_dir.init_from_weights.name + ".partial")
    save_file(plan.state, str(partial), metadata={"format": "pt"})
    partial.replace(run_dir.init_from_weights)
    weights = str(run_dir.init_from_weights.relative_to(run_dir.path))
    run_dir.write_init_from({**plan.record, "weights": {"file": weights,
                                                        **_file_entry(run_dir.init_from_weights)}})
