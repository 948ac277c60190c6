"""Parameter counts, training FLOPs per token and training-state bytes of a model config.

    python -m ora_megatron.summary --config pretrain/configs/base.yaml [--set k=v ...] [--json]

Parameter counts are read from the real megatron-core model (built on CPU, one process).
FLOPs follow Megatron's convention: 2 FLOPs per multiply-add, attention scores over the full
sequence (no causal halving), training = forward + input-gradient + weight-gradient, where the
weight-gradient term is dropped for frozen weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from ora_megatron.builder import padded_vocab_size
from ora_megatron.config_io import ConfigError
from ora_megatron.families import family_of
from ora_megatron.hadamard import kronecker_split
from ora_megatron.model_config import ModelConfig, ModelSection, load_model_section
from ora_megatron.stages import build_staged_gpt

COMPONENTS = ("embeddings", "attention_qk", "attention_v", "attention_out", "attention_mixing",
              "mlp", "norms", "output_layer")
# Bytes per trainable parameter: (gradient, fp32 master copy, Adam m+v). Mixed precision keeps
# half-precision grads plus an fp32 master; fp32 training updates the weights themselves.
STATE_BYTES = {"fp32": (4, 0, 8), "bf16": (2, 4, 8), "fp16": (2, 4, 8)}


def _component(name: str) -> str:
    if "embedding" in name:
        return "embeddings"
    if "output_layer" in name:
        return "output_layer"
    if "layernorm" in name or "norm." in name:
        return "norms"
    if ".mlp." in name:
        return "mlp"
    if "linear_proj" in name:
        return "attention_out"
    if name.endswith((".q_weight", ".k_weight")):
        return "attention_qk"
    if name.endswith((".r", ".r1", ".r2")):
        return "attention_mixing"
    return "attention_v"


def _fused_qk_share(model: ModelConfig) -> float:
    """Share of megatron's fused linear_qkv rows that are Q and K (vanilla)."""
    q, kv = model.num_attention_heads, model.query_groups
    return (q + kv) / (q + 2 * kv)


def parameter_counts(gpt, model: ModelConfig) -> dict:
    counts = {c: {"trainable": 0, "frozen": 0} for c in COMPONENTS}
    for name, param in gpt.named_parameters():
        kind = "trainable" if param.requires_grad else "frozen"
        n = param.numel()
        if name.endswith(("linear_qkv.weight", "linear_qkv.bias")):
            qk = round(n * _fused_qk_share(model))
            counts["attention_qk"][kind] += qk
            counts["attention_v"][kind] += n - qk
        else:
            counts[_component(name)][kind] += n
    return counts


def train_flops_per_token(model: ModelConfig, vocab: int) -> float:
    d, s, L = model.hidden_size, model.seq_length, model.num_layers
    width = model.num_attention_heads * model.head_dim
    kv_width = model.query_groups * model.head_dim
    att = model.attention
    mlp_params = d * model.ffn_size * family_of(model).mlp_matrices

    def matmul(params: int, trainable: bool = True) -> float:
        return 2 * params * (3 if trainable else 2)

    per_layer = matmul(mlp_params) + matmul(width * d)  # MLP + output projection
    if att.uses_qk:
        per_layer += matmul(kv_width * d)  # V
        per_layer += 3 * 4 * s * width  # scores QKᵀ and P·V: forward + 2× backward
        frozen_q = att.custom_qkv and not att.train_q
        frozen_k = att.custom_qkv and not att.train_k
        for params, frozen in ((width * d, frozen_q), (kv_width * d, frozen_k)):
            if frozen and att.hadamard_qk:
                # two Kronecker contractions (hadamard.HadamardRows), forward + input gradient
                per_layer += 2 * 2 * d * sum(kronecker_split(d))
            else:
                per_layer += matmul(params, trainable=not frozen)
    else:
        per_layer += matmul(width * d)  # V
        per_layer += 3 * 2 * s * width  # P·V forward, dV and dP backward
    return L * per_layer + matmul(vocab * d)


def train_state_bytes(trainable: int, precision: str) -> dict:
    grad, master, moments = STATE_BYTES[precision]
    out = {"gradients": grad * trainable, "master_weights": master * trainable,
           "adam_moments": moments * trainable}
    out["total"] = sum(out.values())
    return out


def summarize(section: ModelSection, precision: str = "bf16") -> dict:
    model = section.model
    gpt = build_staged_gpt(model, dataclasses.replace(section.parallel, tensor=1, pipeline=1))
    counts = parameter_counts(gpt, model)
    trainable = sum(c["trainable"] for c in counts.values())
    frozen = sum(c["frozen"] for c in counts.values())
    vocab = padded_vocab_size(model)
    flops = train_flops_per_token(model, vocab)
    vanilla = dataclasses.replace(model, attention=dataclasses.replace(model.attention, type="vanilla",
                                                                       train_q=False, train_k=False))
    state = train_state_bytes(trainable, precision)
    return {
        "attention": model.attention.type,
        "family": model.family,
        "padded_vocab_size": vocab,
        "total_params": trainable + frozen,
        "trainable_params": trainable,
        "frozen_params": frozen,
        "params_by_component": counts,
        "train_flops_per_token": flops,
        "vanilla_train_flops_per_token": train_flops_per_token(vanilla, vocab),
        "train_flops_ratio_to_vanilla": flops / train_flops_per_token(vanilla, vocab),
        "precision": precision,
        "train_state_bytes": state["total"],
        "train_state_bytes_breakdown": state,
    }


def _table(summary: dict) -> str:
    lines = [f"attention: {summary['attention']} ({summary['family']}, padded vocab {summary['padded_vocab_size']})",
             f"{'component':<18}{'trainable':>14}{'frozen':>14}"]
    for name, c in summary["params_by_component"].items():
        if c["trainable"] or c["frozen"]:
            lines.append(f"{name:<18}{c['trainable']:>14,}{c['frozen']:>14,}")
    lines += [
        f"{'total':<18}{summary['trainable_params']:>14,}{summary['frozen_params']:>14,}"
        f"   (all: {summary['total_params']:,})",
        f"train FLOPs/token: {summary['train_flops_per_token']:.4e} "
        f"({summary['train_flops_ratio_to_vanilla']:.4f} × vanilla)",
        f"train state ({summary['precision']} grads + fp32 master + Adam): "
        f"{summary['train_state_bytes'] / 2**20:,.1f} MiB",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="dotted override, e.g. model.attention.type=vanilla (repeatable)")
    parser.add_argument("--precision", choices=sorted(STATE_BYTES), default="bf16")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    try:
        section = load_model_section(args.config, args.set)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from ora_megatron.parallel import destroy_distributed, init_distributed

    init_distributed(1, 1, backend="gloo")
    try:
        summary = summarize(section, args.precision)
    finally:
        destroy_distributed()
    print(json.dumps(summary, indent=2) if args.json else _table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
