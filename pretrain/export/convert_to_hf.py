"""Export a run's checkpoint to Hugging Face format, verified against the source model every time.

    python -m pretrain.export.convert_to_hf --run-dir RUN [--checkpoint TAG] --output DIR [--dtype fp32|bf16]
        [--no-verify] [--force]

From any layout the trainer writes (TP, PP, ZeRO-0..3, bf16) through the consolidated fp32 state
dict (frozen Q/K regenerated), mapped by the family's table (ora_megatron/families/*_hf.py) into
`GPT2LMHeadModel` (gpt2) or `LlamaForCausalLM` (llama). The directory holds the safetensors
weights (sharded above 2 GB), config.json, generation_config.json, the tokenizer and a model card.

Verification: DIR is loaded with AutoModelForCausalLM and run beside the source model (built by
this project from the same checkpoint, one process) on a fixed batch of the run's validation data
plus random tokens; max |Δlogit| and the mean KL(source ‖ export) must stay within TOLERANCE.
A bf16 export is checked as what it is: the source model with its weights rounded to bf16,
computed in fp32, against the export upcast to fp32 — the same tolerance, so a mapping error
cannot hide behind bf16 rounding. The export is written to `DIR.partial` and moved to DIR only
once verified; a failed check leaves it at `DIR.unverified` for inspection and exits 1.

What may be replaced: each export holds `ora_export.json` (its run, checkpoint, verification and
the files it wrote). DIR and DIR.unverified are replaced when absent, empty or an earlier export
holding only its own files (rerunning an export is routine); DIR.partial when an earlier export
left it. Anything else is refused before anything is read, unless --force. Never, even with
--force: a DIR (or sibling) that is, contains or lies inside the run dir, or that is the current
directory or one above it. Nothing here reaches the network: transformers loads local files only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Optional

import torch
import yaml

from ora_megatron.config_io import to_dict
from ora_megatron.families import hf_mapping_of
from ora_megatron.model_config import ModelConfig
from pretrain.checkpoint.consolidate import (
    FP32_MASTER,
    MODULE,
    Consolidated,
    consolidated_state_dict,
    reference_model,
    tp1_parallel_state,
)
from pretrain.checkpoint.unpickling import UnsafeCheckpointFile
from pretrain.config.run_config import RunConfig, read_run_config
from pretrain.config.runtime_sections import DataConfig
from pretrain.export.export_record import (
    EXPORT_RECORD,
    files_under,
    holds_only_an_export,
    read_export_record,
    write_export_record,
)
from pretrain.run_files.run_dir import RunDir

EXIT_ERROR, EXIT_VERIFY_FAILED = 2, 1
TOLERANCE = {"max_abs_logit": 1e-4, "mean_kl": 1e-9}
MAX_SHARD_SIZE = "2GB"
WEIGHT_SOURCES = {FP32_MASTER: "the optimizer's fp32 master copy", MODULE: "the module's saved weights"}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class ExportError(ValueError):
    """The run cannot be exported (no HF architecture, no checkpoint, ...); nothing was written."""


def check_exportable(model: ModelConfig) -> None:
    """Refuse, before anything is read or written, what no HF architecture can hold."""
    if not model.attention.uses_qk:
        raise ExportError(f"attention type '{model.attention.type}' mixes values with an N×N matrix "
                          "(no query/key projection): no Hugging Face architecture holds it")
    try:
        hf_mapping_of(model).check_exportable(model)
    except ValueError as e:
        raise ExportError(str(e)) from None


def hf_weights(model: ModelConfig, state: dict) -> dict[str, torch.Tensor]:
    """The consolidated state dict under the family's Hugging Face names."""
    return hf_mapping_of(model).hf_state_dict(state, model)


def special_token_ids(tokenizer_model: Optional[str]) -> dict:
    """bos/eos/pad ids of the run's sentencepiece model (None where it has none, or for mock data:
    transformers' own defaults, e.g. GPT-2's 50256, would name tokens this model never saw)."""
    ids = {"bos_token_id": -1, "eos_token_id": -1, "pad_token_id": -1}
    if tokenizer_model is not None:
        import sentencepiece

        sp = sentencepiece.SentencePieceProcessor(model_file=tokenizer_model)
        ids = {"bos_token_id": sp.bos_id(), "eos_token_id": sp.eos_id(), "pad_token_id": sp.pad_id()}
    return {k: v if v >= 0 else None for k, v in ids.items()}


def build_hf_model(model: ModelConfig, state: dict, tokenizer_model: Optional[str]):
    """A transformers model holding the consolidated weights (fp32); every HF weight is set."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(hf_mapping_of(model).hf_config(model))
    config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs, **special_token_ids(tokenizer_model))
    hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    hf_model.load_state_dict(hf_weights(model, state), strict=True)
    return hf_model.eval()


def write_export(model: ModelConfig, consolidated: Consolidated, out_dir: Path, dtype: str,
                 tokenizer_model: Optional[str], card: str) -> None:
    from transformers import GenerationConfig

    hf_model = build_hf_model(model, consolidated.state_dict, tokenizer_model)
    hf_model.to(DTYPES[dtype]).save_pretrained(out_dir, max_shard_size=MAX_SHARD_SIZE, safe_serialization=True)
    GenerationConfig(**special_token_ids(tokenizer_model)).save_pretrained(out_dir)
    if tokenizer_model is not None:
        from pretrain.export.hf_tokenizer import export_tokenizer

        export_tokenizer(tokenizer_model, out_dir, model_max_length=model.seq_length)
    (out_dir / "README.md").write_text(card)


# ---------------------------------------------------------------------------------- verification
def verification_tokens(cfg: RunConfig, rows: int = 4, random_rows: int = 2) -> torch.Tensor:
    """[rows + random_rows, seq] token ids: the run's first validation samples, then random ids."""
    from pretrain.runtime.data import build_datasets, build_tokenizer

    small = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=1),
                                eval=dataclasses.replace(cfg.eval, iters=1))
    # megatron-core's dataset builders synchronise through torch.distributed, even alone.
    with tempfile.TemporaryDirectory(prefix="ora-export-data-") as cache, tp1_parallel_state():
        datasets = build_datasets(small, build_tokenizer(small.data, small.model.vocab_size), Path(cache))
        dataset = datasets["valid"] or datasets["train"]
        real = [torch.as_tensor(dataset[i % len(dataset)]["tokens"]) for i in range(rows)]
    generator = torch.Generator().manual_seed(0)
    noise = torch.randint(0, cfg.model.vocab_size, (random_rows, cfg.model.seq_length), generator=generator)
    return torch.cat([torch.stack(real).long(), noise])


def source_logits(model: ModelConfig, state: dict, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of this project's model (TP=1, one process) holding `state`: [b, s, vocab]."""
    source = reference_model(model)
    source.load_state_dict(state, strict=True)
    with tp1_parallel_state(), torch.no_grad():
        return source.eval()(tokens)[..., : model.vocab_size].float()


def compare_logits(source: torch.Tensor, exported: torch.Tensor) -> dict:
    """max |Δlogit| and the mean over positions of KL(source ‖ export), in float64."""
    log_p, log_q = (torch.log_softmax(t.double(), dim=-1) for t in (source, exported))
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return {"max_abs_logit": (source.double() - exported.double()).abs().max().item(), "mean_kl": kl.mean().item()}


def verify(cfg: RunConfig, state: dict, out_dir: Path, dtype: str) -> dict:
    """Load `out_dir` with AutoModelForCausalLM and compare its logits with the source model's."""
    from transformers import AutoModelForCausalLM

    tokens = verification_tokens(cfg)
    if dtype != "fp32":  # the export holds the weights rounded once to `dtype`
        state = {k: v.to(DTYPES[dtype]).float() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    expected = source_logits(cfg.model, state, tokens)
    exported = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32, local_files_only=True).eval()
    with torch.no_grad():
        got = exported(tokens).logits.float()
    figures = compare_logits(expected, got)
    figures["passed"] = all(figures[k] <= bound for k, bound in TOLERANCE.items())
    figures["tokens"] = list(tokens.shape)
    return figures


# ---------------------------------------------------------------------------------- model card
def model_card(cfg: RunConfig, run_dir: RunDir, tag: str, consolidated: Consolidated) -> str:
    state = run_dir.read_train_state(tag)
    valid = [r for r in run_dir.read_records("valid") if r.step <= state["step"]]
    test = [r for r in run_dir.read_records("test") if r.step <= state["step"]]
    arch = hf_mapping_of(cfg.model).ARCHITECTURE
    att = cfg.model.attention
    frozen = consolidated.frozen_qk
    imported = run_dir.read_init_from() or {}
    lines = [
        "---", "library_name: transformers", f"tags: [{', '.join(sorted({'ora', att.type, cfg.model.family}))}]",
        "---", "",
        f"# {run_dir.path.name} ({arch})", "",
        f"Exported from checkpoint `{tag}` of an ORA run: {cfg.model.num_layers} layers, d_model "
        f"{cfg.model.hidden_size}, {cfg.model.num_attention_heads} heads, attention `{att.type}`"
        + (f" ({att.orthogonal_method})" if att.type == "ora" else "") + ".", "",
        "## Training", "",
        f"- steps: {state['step']:,} ({state['skipped_steps']} skipped), tokens seen: {state['tokens_seen']:,}",
        f"- data: {data_description(cfg.data)}",
        f"- final validation loss: {valid[-1].loss:.4f} (step {valid[-1].step})" if valid else "- no validation",
        f"- test loss: {test[-1].loss:.4f}" if test else "- no test evaluation at this checkpoint",
        f"- weights: {WEIGHT_SOURCES[consolidated.source]}, consolidated to fp32 from the DeepSpeed checkpoint",
        *([f"- started from the weights of {imported['source']} (init_from.path)"] if imported else []),
        "", "## Frozen Q/K", "",
    ]
    if frozen:
        origin = (f"imported from {imported['source']} at the run's start" if imported.get("qk") == "imported" else
                  f"random, {'orthogonal' if att.type == 'ora' else att.type.removeprefix('frozen_')}, drawn from "
                  f"model.seed {cfg.model.seed}")
        lines += [
            f"{len(frozen)} query/key projections were frozen for the whole run ({origin}): "
            + ", ".join(f"`{n.split('.')[0]}.{n.rsplit('.', 1)[1][0].upper()}`" for n in frozen) + ".",
            "", "To keep them frozen when fine-tuning, as in pretraining:", "", "```python",
            *hf_mapping_of(cfg.model).keep_frozen_snippet(cfg.model), "```",
        ]
    else:
        lines.append("All query/key projections were trained.")
    lines += ["", "## Resolved training config", "", "```yaml", yaml.safe_dump(to_dict(cfg), sort_keys=False).rstrip(),
              "```", ""]
    return "\n".join(lines)


def data_description(data: DataConfig) -> str:
    if data.mock:
        return "megatron-core mock data (random tokens)"
    if data.manifest:
        return f"data_tools manifest `{data.manifest}`"
    entries = data.blend or data.train_blend
    return ", ".join(f"`{e.path}` (weight {e.weight})" for e in entries)


# ---------------------------------------------------------------------------------- where it goes
@dataclasses.dataclass(frozen=True)
class OutputPaths:
    """The directories an export of DIR writes or replaces, as absolute paths."""

    final: Path
    partial: Path  # written first
    unverified: Path  # where a failed verification leaves it

    @classmethod
    def of(cls, output: Path) -> "OutputPaths":
        final = output.resolve()
        return cls(final, final.with_name(final.name + ".partial"), final.with_name(final.name + ".unverified"))


def check_output(output: Path, run_dir: Path, force: bool) -> OutputPaths:
    """Refuse, before anything is read or written, an output whose replacement could lose data."""
    paths = OutputPaths.of(output)
    run, here = run_dir.resolve(), Path.cwd().resolve()
    for path in (paths.final, paths.partial, paths.unverified):
        if path == run or path in run.parents or run in path.parents:
            raise ExportError(f"--output {output}: {path} would be written over or into the run dir {run} "
                              "being exported (refused even with --force); name a directory outside it")
        if path == here or path in here.parents:
            raise ExportError(f"--output {output}: {path} is the current directory or one above it "
                              "(refused even with --force); name a new directory for the export")
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            raise ExportError(f"--output {output}: {path} exists and is not a directory")
    for path, ours in ((paths.final, holds_only_an_export), (paths.unverified, holds_only_an_export),
                       (paths.partial, read_export_record)):
        if path.exists() and not force and any(path.iterdir()) and not ours(path):
            raise ExportError(f"--output {output}: {path} exists and holds files no earlier export wrote "
                              f"(an export holds {EXPORT_RECORD} listing its files); remove it, choose another "
                              "directory, or pass --force to replace it")
    return paths


# ---------------------------------------------------------------------------------- the command
def export(run_dir: RunDir, output: Path, tag: Optional[str] = None, dtype: str = "fp32",
           verify_export: bool = True, force: bool = False) -> Optional[dict]:
    """Write the export of `tag` (default: latest) to `output`; returns the verification figures."""
    from pretrain.runtime.data import tokenizer_path

    paths = check_output(output, run_dir.path, force)
    cfg = read_run_config(run_dir)
    check_exportable(cfg.model)
    tag = tag or run_dir.latest_checkpoint()
    if tag is None or not run_dir.checkpoint(tag).is_dir():
        raise ExportError(f"{run_dir.path}: no checkpoint {tag or '(latest)'} to export")
    consolidated = consolidated_state_dict(cfg, run_dir.checkpoint(tag))
    shutil.rmtree(paths.partial, ignore_errors=True)
    paths.partial.mkdir(parents=True)
    record = {"run_dir": str(run_dir.path.resolve()), "checkpoint": tag, "dtype": dtype, "files": []}
    write_export_record(paths.partial, record)  # first, so that a DIR.partial left behind is recognisably ours
    write_export(cfg.model, consolidated, paths.partial, dtype, tokenizer_path(cfg.data),
                 model_card(cfg, run_dir, tag, consolidated))
    figures = verify(cfg, consolidated.state_dict, paths.partial, dtype) if verify_export else None
    record.update(verification=figures, files=sorted(files_under(paths.partial) - {EXPORT_RECORD}))
    write_export_record(paths.partial, record)
    final = paths.final if figures is None or figures["passed"] else paths.unverified
    if final.exists():
        shutil.rmtree(final)
    paths.partial.rename(final)
    return figures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--checkpoint", help="checkpoint tag (default: the latest)")
    parser.add_argument("--output", required=True, type=Path)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--no-verify", action="store_true",
                        help="skip the logit comparison (not recommended: it is what catches a wrong mapping)")
    parser.add_argument("--force", action="store_true",
                        help="replace DIR, DIR.partial and DIR.unverified whatever they hold (never the run dir, "
                             "a directory holding it, or the current directory)")
    args = parser.parse_args(argv)
    try:
        figures = export(RunDir(args.run_dir), args.output, args.checkpoint, args.dtype, not args.no_verify,
                         args.force)
    except (ExportError, UnsafeCheckpointFile, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    if figures is None:
        print(f"exported (not verified) to {args.output}")
        return 0
    verdict = "ok" if figures["passed"] else "FAILED"
    print(f"verification {verdict}: max |Δlogit| {figures['max_abs_logit']:.3e} (≤ {TOLERANCE['max_abs_logit']:g}), "
          f"mean KL {figures['mean_kl']:.3e} (≤ {TOLERANCE['mean_kl']:g}) on {figures['tokens'][0]} sequences "
          f"of {figures['tokens'][1]} tokens")
    print(json.dumps(figures))
    if not figures["passed"]:
        print(f"error: export does not match the source model; left at {args.output}.unverified", file=sys.stderr)
        return EXIT_VERIFY_FAILED
    print(f"exported to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
