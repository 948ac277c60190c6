"""Export a run's checkpoint to Hugging Face format, verified against the source model every time.

    python -m pretrain.convert_to_hf --run-dir RUN [--checkpoint TAG] --output DIR [--dtype fp32|bf16] [--no-verify]

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
from ora_megatron.model_config import ParallelConfig
from ora_megatron.stages import build_staged_gpt
from pretrain.config import RunConfig
from pretrain.consolidate import FP32_MASTER, MODULE, Consolidated, consolidated_state_dict, tp1_parallel_state
from pretrain.run_dir import RunDir

EXIT_ERROR, EXIT_VERIFY_FAILED = 2, 1
TOLERANCE = {"max_abs_logit": 1e-4, "mean_kl": 1e-9}
MAX_SHARD_SIZE = "2GB"
WEIGHT_SOURCES = {FP32_MASTER: "the optimizer's fp32 master copy", MODULE: "the module's saved weights"}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class ExportError(ValueError):
    """The run cannot be exported (no HF architecture, no checkpoint, ...); nothing was written."""


def check_exportable(cfg: RunConfig) -> None:
    """Refuse, before anything is read or written, what no HF architecture can hold."""
    if not cfg.model.attention.uses_qk:
        raise ExportError(f"attention type '{cfg.model.attention.type}' mixes values with an N×N matrix "
                          "(no query/key projection): no Hugging Face architecture holds it")
    try:
        hf_mapping_of(cfg.model).check_exportable(cfg.model)
    except ValueError as e:
        raise ExportError(str(e)) from None


def hf_weights(cfg: RunConfig, state: dict) -> dict[str, torch.Tensor]:
    """The consolidated state dict under the family's Hugging Face names."""
    return hf_mapping_of(cfg.model).hf_state_dict(state, cfg.model)


def special_token_ids(tokenizer_model: Optional[str]) -> dict:
    """bos/eos/pad ids of the run's sentencepiece model (None where it has none, or for mock data:
    transformers' own defaults, e.g. GPT-2's 50256, would name tokens this model never saw)."""
    ids = {"bos_token_id": -1, "eos_token_id": -1, "pad_token_id": -1}
    if tokenizer_model is not None:
        import sentencepiece

        sp = sentencepiece.SentencePieceProcessor(model_file=tokenizer_model)
        ids = {"bos_token_id": sp.bos_id(), "eos_token_id": sp.eos_id(), "pad_token_id": sp.pad_id()}
    return {k: v if v >= 0 else None for k, v in ids.items()}


def build_hf_model(cfg: RunConfig, state: dict, tokenizer_model: Optional[str]):
    """A transformers model holding the consolidated weights (fp32); every HF weight is set."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(hf_mapping_of(cfg.model).hf_config(cfg.model))
    config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs, **special_token_ids(tokenizer_model))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(hf_weights(cfg, state), strict=True)
    return model.eval()


def write_export(cfg: RunConfig, consolidated: Consolidated, out_dir: Path, dtype: str,
                 tokenizer_model: Optional[str], card: str) -> None:
    from transformers import GenerationConfig

    model = build_hf_model(cfg, consolidated.state_dict, tokenizer_model)
    model.to(DTYPES[dtype]).save_pretrained(out_dir, max_shard_size=MAX_SHARD_SIZE, safe_serialization=True)
    GenerationConfig(**special_token_ids(tokenizer_model)).save_pretrained(out_dir)
    if tokenizer_model is not None:
        from pretrain.hf_tokenizer import export_tokenizer

        export_tokenizer(tokenizer_model, out_dir, model_max_length=cfg.model.seq_length)
    (out_dir / "README.md").write_text(card)


# ---------------------------------------------------------------------------------- verification
def verification_tokens(cfg: RunConfig, rows: int = 4, random_rows: int = 2) -> torch.Tensor:
    """[rows + random_rows, seq] token ids: the run's first validation samples, then random ids."""
    from pretrain.data import build_datasets, build_tokenizer

    small = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=1, eval_iters=1))
    # megatron-core's dataset builders synchronise through torch.distributed, even alone.
    with tempfile.TemporaryDirectory(prefix="ora-export-data-") as cache, tp1_parallel_state():
        datasets = build_datasets(small, build_tokenizer(small), Path(cache))
        dataset = datasets["valid"] or datasets["train"]
        real = [torch.as_tensor(dataset[i % len(dataset)]["tokens"]) for i in range(rows)]
    generator = torch.Generator().manual_seed(0)
    noise = torch.randint(0, cfg.model.vocab_size, (random_rows, cfg.model.seq_length), generator=generator)
    return torch.cat([torch.stack(real).long(), noise])


def source_logits(cfg: RunConfig, state: dict, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of this project's model (TP=1, one process) holding `state`: [b, s, vocab]."""
    with tp1_parallel_state(), torch.random.fork_rng(devices=[]), torch.no_grad():
        model = build_staged_gpt(cfg.model, ParallelConfig())
        model.load_state_dict(state, strict=True)
        return model.eval()(tokens)[..., : cfg.model.vocab_size].float()


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
    expected = source_logits(cfg, state, tokens)
    exported = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
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
    lines = [
        "---", "library_name: transformers", f"tags: [{', '.join(sorted({'ora', att.type, cfg.model.family}))}]",
        "---", "",
        f"# {run_dir.path.name} ({arch})", "",
        f"Exported from checkpoint `{tag}` of an ORA run: {cfg.model.num_layers} layers, d_model "
        f"{cfg.model.hidden_size}, {cfg.model.num_attention_heads} heads, attention `{att.type}`"
        + (f" ({att.orthogonal_method})" if att.type == "ora" else "") + ".", "",
        "## Training", "",
        f"- steps: {state['step']:,} ({state['skipped_steps']} skipped), tokens seen: {state['tokens_seen']:,}",
        f"- data: {data_description(cfg)}",
        f"- final validation loss: {valid[-1].loss:.4f} (step {valid[-1].step})" if valid else "- no validation",
        f"- test loss: {test[-1].loss:.4f}" if test else "- no test evaluation at this checkpoint",
        f"- weights: {WEIGHT_SOURCES[consolidated.source]}, consolidated to fp32 from the DeepSpeed checkpoint",
        "", "## Frozen Q/K", "",
    ]
    if frozen:
        lines += [
            f"{len(frozen)} query/key projections were frozen for the whole run (random, "
            f"{'orthogonal' if att.type == 'ora' else att.type.removeprefix('frozen_')}, drawn from model.seed "
            f"{cfg.model.seed}): " + ", ".join(f"`{n.split('.')[0]}.{n.rsplit('.', 1)[1][0].upper()}`" for n in frozen)
            + ".", "", "To keep them frozen when fine-tuning, as in pretraining:", "", "```python",
            *hf_mapping_of(cfg.model).keep_frozen_snippet(cfg.model), "```",
        ]
    else:
        lines.append("All query/key projections were trained.")
    lines += ["", "## Resolved training config", "", "```yaml", yaml.safe_dump(to_dict(cfg), sort_keys=False).rstrip(),
              "```", ""]
    return "\n".join(lines)


def data_description(cfg: RunConfig) -> str:
    data = cfg.data
    if data.mock:
        return "megatron-core mock data (random tokens)"
    if data.manifest:
        return f"data_tools manifest `{data.manifest}`"
    entries = data.blend or data.train_blend
    return ", ".join(f"`{e.path}` (weight {e.weight})" for e in entries)


# ---------------------------------------------------------------------------------- the command
def export(run_dir: RunDir, output: Path, tag: Optional[str] = None, dtype: str = "fp32",
           verify_export: bool = True) -> Optional[dict]:
    """Write the export of `tag` (default: latest) to `output`; returns the verification figures."""
    from pretrain.data import tokenizer_path

    cfg = run_dir.read_config()
    check_exportable(cfg)
    tag = tag or run_dir.latest_checkpoint()
    if tag is None or not run_dir.checkpoint(tag).is_dir():
        raise ExportError(f"{run_dir.path}: no checkpoint {tag or '(latest)'} to export")
    consolidated = consolidated_state_dict(cfg, run_dir.checkpoint(tag))
    partial = output.with_name(output.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    write_export(cfg, consolidated, partial, dtype, tokenizer_path(cfg), model_card(cfg, run_dir, tag, consolidated))
    figures = verify(cfg, consolidated.state_dict, partial, dtype) if verify_export else None
    final = output if figures is None or figures["passed"] else output.with_name(output.name + ".unverified")
    shutil.rmtree(final, ignore_errors=True)
    partial.rename(final)
    return figures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--checkpoint", help="checkpoint tag (default: the latest)")
    parser.add_argument("--output", required=True, type=Path)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--no-verify", action="store_true",
                        help="skip the logit comparison (not recommended: it is what catches a wrong mapping)")
    args = parser.parse_args(argv)
    try:
        figures = export(RunDir(args.run_dir), args.output, args.checkpoint, args.dtype, not args.no_verify)
    except (ExportError, FileNotFoundError) as e:
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
