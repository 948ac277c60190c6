"""What frozen Q/K do to attention routing, measured on a trained run's own weights.

    python -m pretrain.research.analyze --run-dir RUN [--checkpoint TAG] [--out DIR] [--tokens N] [--device cpu|cuda]

The checkpoint (default: the latest) is consolidated to fp32 (pretrain/checkpoint/consolidate.py:
frozen Q/K regenerated) and run in eval mode, in fp32, on the first sequences of the run's
validation split holding N tokens (default 4096; its train split where it has none; a mock-data
run's mock validation samples). megatron shuffles the split with the run's seed: the batch is the
same at every call. The attention probabilities are materialised here only (training keeps the
fused SDPA kernel): a forward hook on each layer's core attention takes the q, k, v it receives
(after RoPE; Hadamard Q/K included) and recomputes P = softmax(q·kᵀ·scale + causal mask) in fp32;
P·V is checked against the module's own output (`recompute_max_abs_error`, per layer).
Synthesizers have no Q/K: P is softmax(R + causal mask) of the module's mixing logits, V the
output of its linear_v; their Q/K measures are null.

Measures per layer and head (natural logarithms):

- entropy: the mean over query rows of H_i = −Σ_j p_ij·log p_ij; entropy_ratio: the mean over rows
  with more than one key of H_i / log(i + 1), the entropy of row i of a uniform causal map
  (1: uniform over the prefix, 0: one key).
- attention_rank, output_rank: effective rank (Roy & Vetterli 2007: exp of the entropy of the
  singular values normalised to sum 1) of each sequence's attention map P [s × s] and head output
  P·V [s × d_k], averaged over the sequences.
- head_diversity (per layer): the mean over head pairs and query rows (more than one key) of the
  Jensen–Shannon divergence between the two heads' attention rows, in [0, log 2].
- q_distortion, k_distortion: how far a head's projection W [d_model × d_k] (x ↦ x·W) is from an
  isometry on what it reads. For sampled pairs of the layer's normed input rows (what linear_qkv
  projects), δ = x_i − x_j, the ratio r = ‖δ·W‖ / ‖δ·Π_W‖, Π_W the orthogonal projector onto the
  span of W's columns; distortion = mean |r − 1|, q/k_distance_ratio = mean r. Orthonormal
  columns (ORA) give r = 1 for every pair (distortion 0), c·W gives r = c; r ranges over W's
  singular values, weighted by where the data's differences lie. (The ratio to the whole ‖δ‖
  would be the share of δ inside W's d_k-dimensional span, ≈ sqrt(d_k/d_model) by
  Johnson–Lindenstrauss for any W: a property of the subspace, not of the map.)
- qk_orthogonality_error: max |WᵀW − I| of each Q and K head, with W rounded to the run's training
  dtype first (a bf16 run computes with bf16 Q/K): measured, not assumed; also Frobenius
  ‖WᵀW − I‖_F (per_head). Only ORA's W are meant to be orthonormal; for the others it says how far.

Writes RUN/evaluations/attention.json: summary (means over layers of the per-layer means over
heads), higher_is_better, per_layer, per_head ([layer][head], K heads = query groups) and the
batch it measured; and entropy_ratio.png, effective_rank.png in --out (default
RUN/evaluations/attention/). The directions in higher_is_better are the report's convention for
these descriptive measures: more selective routing (lower entropy ratio), higher rank, more
diverse heads, and less distortion and orthogonality error count as "better".
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ora_megatron.attention import RandomQKVLinear, SynthesizerAttention
from ora_megatron.stages import DecoderLayerStage, StagedGPT
from pretrain.checkpoint.consolidate import CheckpointMismatch, load_trained_model, tp1_parallel_state
from pretrain.checkpoint.unpickling import UnsafeCheckpointFile
from pretrain.config.run_config import RunConfig
from pretrain.job.extras import needs_extra
from pretrain.research.report.plots import _save
from pretrain.run_files.run_dir import RunDir

with needs_extra("research"):
    from matplotlib.figure import Figure

NAME = "attention"
DEFAULT_TOKENS = 4096
DISTANCE_PAIRS = 2048
SEED = 0
EXIT_ERROR = 2
TRAINING_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HIGHER_IS_BETTER = {
    "entropy_ratio": False,
    "attention_rank": True,
    "output_rank": True,
    "head_diversity": True,
    "q_distortion": False,
    "k_distortion": False,
    "qk_orthogonality_error": False,
}
ENTROPY_PLOT, RANK_PLOT = "entropy_ratio.png", "effective_rank.png"


# ---------------------------------------------------------------------------------- measures
def row_entropy(probs: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of each attention row: [..., s, s] → [..., s]."""
    return -torch.special.xlogy(probs, probs).sum(-1)


def uniform_causal_entropy(s: int) -> torch.Tensor:
    """log(i + 1) for rows i = 0 … s − 1: row i of a causal map attends to i + 1 keys."""
    return torch.arange(1, s + 1, dtype=torch.float64).log()


def entropy_ratio(probs: torch.Tensor) -> torch.Tensor:
    """Mean over the rows with more than one key of H_i / log(i + 1): [..., s, s] → [...]."""
    uniform = uniform_causal_entropy(probs.size(-1))[1:].to(probs.device, probs.dtype)
    return (row_entropy(probs)[..., 1:] / uniform).mean(-1)


def effective_rank(matrices: torch.Tensor) -> torch.Tensor:
    """exp(−Σ p_i·log p_i), p = the singular values normalised to sum 1: [..., m, n] → [...]."""
    singular = torch.linalg.svdvals(matrices)
    p = singular / singular.sum(-1, keepdim=True)
    return torch.exp(-torch.special.xlogy(p, p).sum(-1))


def head_diversity(probs: torch.Tensor) -> Optional[float]:
    """Mean Jensen–Shannon divergence between the rows of every pair of heads, over the rows with
    more than one key: [b, heads, s, s] → 0 for identical heads, log 2 for disjoint; None for one head."""
    rows = probs[:, :, 1:]
    heads = rows.size(1)
    if heads < 2:
        return None
    divergences = []
    for a in range(heads):
        for b in range(a + 1, heads):
            p, q = rows[:, a], rows[:, b]
            m = (p + q) / 2
            kl_sum = (torch.special.xlogy(p, p) - torch.special.xlogy(p, m)
                      + torch.special.xlogy(q, q) - torch.special.xlogy(q, m))
            divergences.append(0.5 * kl_sum.sum(-1).mean())
    return torch.stack(divergences).mean().item()


def distance_ratios(inputs: torch.Tensor, weights: torch.Tensor, pairs: int,
                    generator: torch.Generator) -> torch.Tensor:
    """‖δ·W‖ / ‖δ·Π_W‖ per head for `pairs` sampled pairs of distinct rows of inputs [n, d_model]
    (δ = x_i − x_j), W = weights [heads, d_model, d_k], Π_W the orthogonal projector onto the span
    of W's columns: [heads, pairs], NaN where δ·Π_W = 0. In float64."""
    n = inputs.size(0)
    first = torch.randint(n, (pairs,), generator=generator)
    second = torch.randint(n - 1, (pairs,), generator=generator)
    second = second + (second >= first)  # never the same row
    delta = (inputs[first.to(inputs.device)] - inputs[second.to(inputs.device)]).double()
    basis, singular, _ = torch.linalg.svd(weights.double(), full_matrices=False)  # W = U·S·Vᵀ
    # Directions W maps to 0 are outside its column span; keep U's columns of nonzero singular values.
    tolerance = singular.amax(-1, keepdim=True) * max(weights.shape[-2:]) * torch.finfo(torch.float64).eps
    read = (delta @ basis) * (singular > tolerance).unsqueeze(1)  # δ's coordinates in the span: [heads, pairs, d_k]
    return (read * singular.unsqueeze(1)).norm(dim=-1) / read.norm(dim=-1)  # ‖δ·U·S·Vᵀ‖ = ‖δ·U·S‖


def orthogonality_error(weights: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """max |WᵀW − I| and ‖WᵀW − I‖_F of each W in weights [heads, d_model, d_k], W rounded to `dtype`
    (what the model computes with), the product in float64: ([heads], [heads])."""
    rounded = weights.to(dtype).double()
    error = rounded.transpose(-1, -2) @ rounded - torch.eye(weights.size(-1), dtype=torch.float64,
                                                            device=weights.device)
    return error.abs().amax((-2, -1)), torch.linalg.matrix_norm(error)


# ---------------------------------------------------------------------------------- the model's attention
def qk_head_weights(attention: torch.nn.Module) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """Each head's Q and K projection as the d_model × d_k matrix W of x ↦ x·W, as the layer's
    linear_qkv applies it: ([heads, d_model, d_k], [query groups, d_model, d_k]), fp32; None for a
    synthesizer (it has no Q/K)."""
    if isinstance(attention, SynthesizerAttention):
        return None
    heads, groups = attention.num_attention_heads_per_partition, attention.num_query_groups_per_partition
    d_k = attention.hidden_size_per_attention_head
    linear = attention.linear_qkv
    if isinstance(linear, RandomQKVLinear):  # Hadamard Q/K too: the model keeps their dense weights
        q, k = linear.q_weight, linear.k_weight
    else:  # megatron's fused rows, per query group: [its query heads | its key | its value]
        per_group = linear.weight.view(groups, (heads // groups + 2) * d_k, -1)
        q_rows = heads // groups * d_k
        q, k = per_group[:, :q_rows], per_group[:, q_rows:q_rows + d_k]
    return (q.reshape(heads, d_k, -1).transpose(1, 2).detach().float(),
            k.reshape(groups, d_k, -1).transpose(1, 2).detach().float())


def causal_softmax(scores: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim with keys after the query masked out: [..., s, s]."""
    s = scores.size(-1)
    future = torch.ones(s, s, dtype=torch.bool, device=scores.device).triu(1)
    return torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)


@dataclass
class LayerAttention:
    """What one layer's attention computed on the batch, recomputed in fp32."""

    attention: torch.nn.Module  # the layer's self_attention
    probs: torch.Tensor  # [b, heads, s, s]
    values: torch.Tensor  # [b, heads, s, d_k] (a query group's V repeated for each of its heads)
    output: torch.Tensor  # [b, heads, s, d_k]: the module's own result, which probs·values must give
    qkv_input: Optional[torch.Tensor]  # [b·s, d_model]: the normed rows linear_qkv projected; None: synthesizer


def _heads(attention: torch.nn.Module) -> tuple[int, int]:
    if isinstance(attention, SynthesizerAttention):
        return attention.heads, attention.head_dim
    return attention.num_attention_heads_per_partition, attention.hidden_size_per_attention_head


def _to_heads(t: torch.Tensor, heads: int, d_k: int) -> torch.Tensor:
    """megatron's [s, b, heads(·d_k)] → [b, heads, s, d_k], fp32."""
    return t.float().reshape(t.size(0), t.size(1), heads, d_k).permute(1, 2, 0, 3)


def capture_attention(model: StagedGPT, tokens: torch.Tensor) -> list[LayerAttention]:
    """One forward of `model` on tokens [b, s]; per decoder layer, its attention probabilities
    recomputed from what its core attention received, with the values and its own output."""
    layers = [m.layer.self_attention for m in model.modules() if isinstance(m, DecoderLayerStage)]
    seen: list[dict] = [{} for _ in layers]
    handles = []
    for attention, store in zip(layers, seen):
        if isinstance(attention, SynthesizerAttention):
            handles += [
                attention.linear_v.register_forward_hook(lambda _m, _a, out, store=store: store.update(value=out[0])),
                attention.linear_proj.register_forward_pre_hook(lambda _m, a, store=store: store.update(output=a[0])),
            ]
        else:  # megatron calls core_attention(query, key, value, attention_mask, ...)
            handles += [
                attention.linear_qkv.register_forward_pre_hook(lambda _m, a, store=store: store.update(x=a[0])),
                attention.core_attention.register_forward_hook(
                    lambda _m, a, out, store=store: store.update(qkv=a[:3], output=out)),
            ]
    try:
        with torch.no_grad():
            model(tokens)
    finally:
        for handle in handles:
            handle.remove()
    return [_recompute(attention, store) for attention, store in zip(layers, seen)]


def _recompute(attention: torch.nn.Module, seen: dict) -> LayerAttention:
    heads, d_k = _heads(attention)
    output = _to_heads(seen["output"], heads, d_k)
    s, b = seen["output"].shape[:2]
    with torch.no_grad():
        if isinstance(attention, SynthesizerAttention):
            probs = causal_softmax(attention.mixing_logits(s).float()).expand(b, -1, -1, -1)
            return LayerAttention(attention, probs, _to_heads(seen["value"], heads, d_k), output, None)
        query, key, value = (t.float().permute(1, 2, 0, 3) for t in seen["qkv"])  # [b, heads | groups, s, d_k]
        repeat = query.size(1) // key.size(1)  # grouped-query attention: each K/V group serves `repeat` heads
        key, value = key.repeat_interleave(repeat, 1), value.repeat_interleave(repeat, 1)
        scale = attention.core_attention.softmax_scale or 1.0 / math.sqrt(d_k)  # SDPA's default
        probs = causal_softmax(query @ key.transpose(-1, -2) * scale)
    x = seen["x"]
    return LayerAttention(attention, probs, value, output, x.float().reshape(-1, x.size(-1)))


def layer_measures(layer: LayerAttention, dtype: torch.dtype, pairs: int,
                   generator: torch.Generator) -> tuple[dict[str, Optional[list[float]]], dict[str, Optional[float]]]:
    """(per head, per layer) measures of one layer; the Q/K ones None for a synthesizer."""
    probs = layer.probs
    per_head = {
        "entropy": row_entropy(probs).mean((0, 2)),
        "entropy_ratio": entropy_ratio(probs).mean(0),
        "attention_rank": effective_rank(probs).mean(0),
        "output_rank": effective_rank(probs @ layer.values).mean(0),
    }
    weights = qk_head_weights(layer.attention)
    for role, w in zip("qk", weights or (None, None)):
        if w is None:
            per_head.update(dict.fromkeys(f"{role}_{key}" for key in (
                "distortion", "distance_ratio", "orthogonality_error", "orthogonality_error_fro")))
            continue
        ratios = distance_ratios(layer.qkv_input, w.to(layer.qkv_input.device), pairs, generator)
        max_error, fro_error = orthogonality_error(w, dtype)
        per_head.update({f"{role}_distortion": (ratios - 1).abs().nanmean(-1),
                         f"{role}_distance_ratio": ratios.nanmean(-1),
                         f"{role}_orthogonality_error": max_error,
                         f"{role}_orthogonality_error_fro": fro_error})
    per_head = {k: None if v is None else [_finite(x) for x in v.tolist()] for k, v in per_head.items()}
    per_layer = {key: _mean(per_head[key]) for key in ("entropy_ratio", "attention_rank", "output_rank",
                                                        "q_distortion", "k_distortion")}
    per_layer["head_diversity"] = _finite(head_diversity(probs))
    errors = per_head["q_orthogonality_error"]
    per_layer["qk_orthogonality_error"] = None if errors is None else _mean(errors + per_head["k_orthogonality_error"])
    per_layer["recompute_max_abs_error"] = _finite((probs @ layer.values - layer.output).abs().max().item())
    return per_head, per_layer


def _finite(value: Optional[float]) -> Optional[float]:
    """The number, None where there is none (the JSON's null: NaN is not JSON)."""
    return float(value) if value is not None and math.isfinite(value) else None


def _mean(values: Optional[list]) -> Optional[float]:
    """The mean, None if any value is missing or the result is not a number."""
    if values is None or any(v is None for v in values):
        return None
    mean = sum(values) / len(values)
    return mean if math.isfinite(mean) else None


# ---------------------------------------------------------------------------------- the batch
def validation_tokens(cfg: RunConfig, count: int) -> tuple[torch.Tensor, str]:
    """The first sequences of the run's validation split (its train split when it has none) that
    hold at least `count` tokens: ([rows, seq_length], the split's name)."""
    from pretrain.runtime.data import build_datasets, build_tokenizer

    rows = max(1, math.ceil(count / cfg.model.seq_length))
    batches = math.ceil(rows / cfg.train.global_batch_size)
    # The run's own validation set when it is large enough; a training split of a few batches only.
    sized = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=batches),
                                eval=dataclasses.replace(cfg.eval, iters=max(cfg.eval.iters, batches)))
    # megatron-core's dataset builders synchronise through torch.distributed, even alone.
    with tempfile.TemporaryDirectory(prefix="ora-analyze-data-") as cache, tp1_parallel_state():
        datasets = build_datasets(sized, build_tokenizer(sized.data, sized.model.vocab_size), Path(cache))
        split = "valid" if datasets["valid"] is not None else "train"
        samples = [torch.as_tensor(datasets[split][i]["tokens"]) for i in range(rows)]
    return torch.stack(samples).long(), split


# ---------------------------------------------------------------------------------- the command
def analyze(run_dir: RunDir, tag: Optional[str] = None, out: Optional[Path] = None, tokens: int = DEFAULT_TOKENS,
            pairs: int = DISTANCE_PAIRS, device: str = "cpu") -> dict:
    """Measure checkpoint `tag` (default: the latest) of the run; write the evaluation and the plots."""
    generator = torch.Generator().manual_seed(SEED)
    with tp1_parallel_state(), torch.no_grad():
        trained = load_trained_model(run_dir, tag)
        cfg, tag = trained.cfg, trained.tag
        batch, split = validation_tokens(cfg, tokens)
        dtype = TRAINING_DTYPES[cfg.deepspeed.precision]
        layers = capture_attention(trained.model.to(device), batch.to(device))
        measured = []
        while layers:  # each layer's captured tensors are let go once measured
            measured.append(layer_measures(layers.pop(0), dtype, pairs, generator))
    per_head = {key: [heads[key] for heads, _ in measured] for key in measured[0][0]}
    per_layer = {key: [layer[key] for _, layer in measured] for key in HIGHER_IS_BETTER}
    record = {
        "name": NAME,
        "checkpoint": tag,
        "summary": {key: _mean(values) for key, values in per_layer.items()},
        "higher_is_better": dict(HIGHER_IS_BETTER),
        "per_layer": per_layer,
        "per_head": {key: None if any(v is None for v in values) else values for key, values in per_head.items()},
        "attention_type": cfg.model.attention.type,
        "training_dtype": cfg.deepspeed.precision,
        "tokens": {"split": split, "sequences": batch.size(0), "seq_length": batch.size(1),
                   "distance_pairs": pairs, "seed": SEED},
        "recompute_max_abs_error": [layer["recompute_max_abs_error"] for _, layer in measured],
    }
    run_dir.write_evaluation(record)
    out = Path(out) if out is not None else run_dir.evaluations / NAME
    out.mkdir(parents=True, exist_ok=True)
    plot_by_layer(record["per_head"], {"entropy_ratio": "entropy / uniform causal entropy"},
                  "entropy ratio", "Attention entropy over the uniform causal map's, by layer", out / ENTROPY_PLOT)
    ranks = {"attention_rank": "attention map P [s×s]", "output_rank": "head output P·V [s×d_k]"}
    plot_by_layer(record["per_head"], ranks, "effective rank", "Effective rank by layer (points: heads, line: mean)",
                  out / RANK_PLOT)
    return record


def plot_by_layer(per_head: dict, labels: dict[str, str], ylabel: str, title: str, path: Path) -> Path:
    """Per measure: each head's value as a point, the mean over heads as a line, by layer."""
    figure = Figure(figsize=(7, 4.5))
    axes = figure.subplots()
    for key, label in labels.items():
        values = per_head[key]
        layers = list(range(1, len(values) + 1))
        line, = axes.plot(layers, [_mean(v) for v in values], marker="o", label=label)
        points = [(layer, x) for layer, heads in zip(layers, values) for x in heads if x is not None]
        axes.scatter(*zip(*points), color=line.get_color(), alpha=0.35, s=14)
        axes.set_xticks(layers)
    axes.set(xlabel="layer", ylabel=ylabel, title=title)
    axes.legend()
    return _save(figure, path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--checkpoint", help="checkpoint tag (default: the latest)")
    parser.add_argument("--out", type=Path, help="folder for the plots (default: RUN/evaluations/attention/)")
    parser.add_argument("--tokens", type=int, default=DEFAULT_TOKENS,
                        help="validation tokens to measure on, rounded up to whole sequences (default: %(default)s)")
    parser.add_argument("--pairs", type=int, default=DISTANCE_PAIRS,
                        help="input-row pairs per layer for the Q/K distortion (default: %(default)s)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the model runs (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.pairs < 1:
        parser.error("--tokens and --pairs must be >= 1")
    run_dir = RunDir(args.run_dir)
    try:
        record = analyze(run_dir, args.checkpoint, args.out, args.tokens, args.pairs, args.device)
    except (CheckpointMismatch, UnsafeCheckpointFile, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    width = max(map(len, record["summary"]))
    for key, value in record["summary"].items():
        print(f"{key:<{width}}  {'n/a' if value is None else f'{value:.4g}'}")
    print(f"wrote {run_dir.evaluation_file(NAME)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
