"""An op audit of our training step against a reference GPT (nanoGPT's model.py) at the same shape.

    python -m pretrain.research.speed.audit --config base --gpu h200 --reference /tmp/nanogpt/model.py
        [--micro-batch 64] [--revision HEAD] [--set k=v ...] [--json]

Both steps are costed by the speed model (`pretrain.research.speed.cost`), eager and compiled: ours as
`step_time` models it (the preset's model and arm traced on CPU with its CUDA branches, the fused loss and
DeepSpeed's optimizer as `code_versions` models them at `--revision`), the reference as its trainer runs
it (`pretrain.research.speed.reference`: bf16 autocast, dropout, F.cross_entropy on the full logits,
`clip_grad_norm_` and fused AdamW). Per category (`CATEGORIES`), one step's kernels, bytes, FLOPs and
device milliseconds, side by side, with ours ÷ the reference; then the step's time (each stretch the
larger of device and host time) and, where the GPU measured both at this shape (`MEASURED`), the
modeled ratios of our step at the measured revision to the reference's eager and compiled steps against
the measured ones. docs/speed_audit.md holds the findings.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from pretrain.research.speed.cost import CategoryCost, fused_groups, kernel_cost, stretch_cost
from pretrain.research.speed.gpus import GPU_KINDS, GPUKind, gpu_kind
from pretrain.research.speed.reference import ReferenceShape, reference_optimizer_ops, trace_reference
from pretrain.research.speed.step_time import (
    TRACE_CACHE,
    TRACE_FORMAT,
    _ops_json,
    _ops_of,
    load_config,
    micro_batch_of,
    micro_batches_of,
    model_of,
    step_ops,
)
from pretrain.research.speed.trace import Op, Trace

CATEGORIES = ("gemm", "attention", "norms", "activations", "dropout", "casts_copies", "loss", "optimizer", "rest")
NORMS = {"native_layer_norm", "native_layer_norm_backward", "_fused_rms_norm", "_fused_rms_norm_backward",
         "rms_norm", "layer_norm"}
ACTIVATIONS = {"gelu", "gelu_backward", "silu", "silu_backward", "tanh", "tanh_backward", "relu",
               "threshold_backward"}
DROPOUT = {"native_dropout", "native_dropout_backward", "bernoulli_", "bias_dropout_add",
           "bias_dropout_add_backward"}
CASTS_COPIES = {"_to_copy", "copy_", "clone", "cat", "contiguous", "_unsafe_view", "stack", "index_copy_"}

# One H200, bf16, seq 512, vocab 32000, dropout 0.1, 65,536 tokens a step, micro-batch 64 (DESIGN.md §4b):
# our step (ORA, eager) at MEASURED_REVISION, nanoGPT's eager and compiled, in ms.
MEASURED_REVISION = "2f8f273"
MEASURED = {
    ("small", "h200", 64): {"ours": 89.1, "reference_eager": 66.7, "reference_compiled": 48.7},
    ("base", "h200", 64): {"ours": 170.3, "reference_eager": 150.0, "reference_compiled": 120.5},
}


def audit_category(op: Op, logits_elements: int) -> str:
    """The audit's category of one op. Memory-bound ops over [tokens × vocab] tensors are the loss's
    (the reference's cast of the logits, its log-softmax and their backward)."""
    if op.name.startswith(("optimizer.", "gradients.")):
        return "optimizer"
    if op.kind in ("gemm", "attention"):
        return op.kind
    if op.name.startswith("loss.") or any(t.numel >= logits_elements for t in (*op.inputs, *op.outputs)):
        return "loss"
    for category, names in (("norms", NORMS), ("activations", ACTIVATIONS), ("dropout", DROPOUT),
                            ("casts_copies", CASTS_COPIES)):
        if op.name in names:
            return category
    return "rest"


@dataclass
class StepCosts:
    """One step of one side, eager or compiled: per category (all micro-batches and the optimizer)."""

    categories: dict[str, CategoryCost] = field(default_factory=lambda: {c: CategoryCost() for c in CATEGORIES})
    device_s: float = 0.0
    host_s: float = 0.0
    step_s: float = 0.0


def _fusable(op: Op) -> bool:
    """What `cost.fused_groups` gathers into a run: memory-bound ops of the trace."""
    return op.kind in ("memory", "fused") and "." not in op.name


def _kernels_by_category(ops: list[Op], compiled: bool, logits_elements: int) -> list[tuple[str, Op]]:
    """The kernels `stretch_cost` runs, each with its category. Compiled, a fused run of memory-bound ops
    takes the category of the members that move most of its bytes eager."""
    if not compiled:
        return [(audit_category(op, logits_elements), op) for op in ops if op.kind != "view"]
    runs, run = [], []
    for op in (op for op in ops if op.kind != "view"):
        if _fusable(op):
            run.append(op)
        elif run:
            runs.append(run)
            run = []
    if run:
        runs.append(run)
    runs.reverse()
    out = []
    for kernel in fused_groups(ops):
        if kernel.name != "fused" or kernel.kind != "memory":
            out.append((audit_category(kernel, logits_elements), kernel))
            continue
        weights = Counter()
        for op in runs.pop():
            weights[audit_category(op, logits_elements)] += sum(t.nbytes for t in (*op.inputs, *op.outputs))
        out.append((weights.most_common(1)[0][0], kernel))
    return out


def step_costs(micro_batch_ops: list[Op], optimizer: list[Op], micro_batches: int, gpu: GPUKind,
               compiled: bool, logits_elements: int) -> StepCosts:
    costs = StepCosts()
    for count, ops, stretch_compiled in ((micro_batches, micro_batch_ops, compiled), (1, optimizer, False)):
        stretch = stretch_cost(ops, gpu, stretch_compiled)
        costs.device_s += count * stretch.device_s
        costs.host_s += count * stretch.host_s
        costs.step_s += count * stretch.seconds
        for category, kernel in _kernels_by_category(ops, stretch_compiled, logits_elements):
            cost = kernel_cost(kernel, gpu)
            cost.kernels, cost.bytes, cost.flops, cost.device_s = (
                cost.kernels * count, cost.bytes * count, cost.flops * count, cost.device_s * count)
            costs.categories[category].add(cost)
    return costs


@dataclass(frozen=True)
class StepOpsOfSide:
    """One side's step: a micro-batch's ops, the optimizer's, how many micro-batches."""

    micro_batch: list[Op]
    optimizer: list[Op]
    micro_batches: int
    logits_elements: int

    def costs(self, gpu: GPUKind, compiled: bool) -> StepCosts:
        return step_costs(self.micro_batch, self.optimizer, self.micro_batches, gpu, compiled, self.logits_elements)


def reference_shape(cfg) -> ReferenceShape:
    model = model_of(cfg)
    return ReferenceShape(model.num_layers, model.hidden_size, model.num_attention_heads, model.seq_length,
                          model.vocab_size, model.hidden_dropout)


def ours(cfg, micro_batch: int, revision: str, cache: Path | None = TRACE_CACHE) -> StepOpsOfSide:
    """Our step as `step_time` models it at `revision`."""
    step = step_ops(cfg, micro_batch, revision, cache)
    model = model_of(cfg)
    return StepOpsOfSide(step.micro_batch, step.optimizer, step.micro_batches,
                         micro_batch * model.seq_length * model.vocab_size)


def cached_reference_trace(path: str | Path, shape: ReferenceShape, accumulation: int,
                           cache: Path | None = TRACE_CACHE) -> Trace:
    """`trace_reference`, kept as JSON under `cache` per file content and shape (None: not kept)."""
    source = Path(path).read_bytes()
    key = hashlib.sha256(repr((TRACE_FORMAT, source, shape, accumulation, torch.__version__)).encode()).hexdigest()[:16]
    file = None if cache is None else cache / f"reference-{key}.json"
    if file is not None and file.exists():
        data = json.loads(file.read_text())
        return Trace(_ops_of(data["at_two"]), _ops_of(data["at_three"]), tuple(map(tuple, data["parameters"])))
    traced = trace_reference(path, shape, accumulation)
    if file is not None:
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(json.dumps({"at_two": _ops_json(traced.at_two), "at_three": _ops_json(traced.at_three),
                                    "parameters": [list(s) for s in traced.parameters]}))
    return traced


def reference(cfg, path: str | Path, micro_batch: int, cache: Path | None = TRACE_CACHE) -> StepOpsOfSide:
    """The reference's step at our model's shape, micro-batch and accumulation."""
    shape = reference_shape(cfg)
    micro_batches = micro_batches_of(cfg, micro_batch)
    traced = cached_reference_trace(path, shape, micro_batches, cache)
    return StepOpsOfSide(traced.at(micro_batch), reference_optimizer_ops(list(traced.parameters), micro_batches),
                         micro_batches, micro_batch * shape.seq * shape.vocab)


def _side(costs: StepCosts) -> dict:
    return {"categories": {name: {**asdict(c), "ms": c.device_s * 1e3} for name, c in costs.categories.items()},
            "device_ms": costs.device_s * 1e3, "host_ms": costs.host_s * 1e3, "step_ms": costs.step_s * 1e3}


def audit(cfg, preset: str, gpu_key: str, reference_path: str | Path, micro_batch: int, revision: str = "HEAD",
          cache: Path | None = TRACE_CACHE) -> dict:
    """Both sides eager and compiled, per category; the measured ratios where `MEASURED` has the shape."""
    gpu = gpu_kind(gpu_key)
    theirs = reference(cfg, reference_path, micro_batch, cache)
    mine = ours(cfg, micro_batch, revision, cache)
    report = {"gpu": gpu.name, "micro_batch": micro_batch, "micro_batches": mine.micro_batches,
              "revision": revision, "modes": {}}
    for mode, compiled in (("eager", False), ("compiled", True)):
        sides = {"ours": _side(mine.costs(gpu, compiled)), "reference": _side(theirs.costs(gpu, compiled))}
        sides["ratio"] = sides["ours"]["step_ms"] / sides["reference"]["step_ms"]
        report["modes"][mode] = sides
    measured = MEASURED.get((Path(preset).stem, gpu_key.lower(), micro_batch))
    if measured is not None:
        at_measured = ours(cfg, micro_batch, MEASURED_REVISION, cache).costs(gpu, compiled=False).step_s * 1e3
        modeled = {"ours": at_measured, "reference_eager": report["modes"]["eager"]["reference"]["step_ms"],
                   "reference_compiled": report["modes"]["compiled"]["reference"]["step_ms"]}
        report["measured"] = {"revision": MEASURED_REVISION, "ms": measured, "modeled_ms": modeled, "ratios": {
            against: _ratio_check(modeled["ours"] / modeled[against], measured["ours"] / measured[against])
            for against in ("reference_eager", "reference_compiled")}}
    return report


def _ratio_check(modeled: float, measured: float) -> dict:
    return {"modeled": modeled, "measured": measured, "error": modeled / measured - 1}


def _mode_table(mode: str, sides: dict) -> list[str]:
    lines = [f"{mode}: ours ÷ reference step {sides['ratio']:.3f}",
             f"{'category':<13}{'kernels':>15}{'GB':>17}{'TFLOP':>15}{'ms':>17}{'ms ÷':>7}",
             f"{'':<13}{'ours':>8}{'ref':>7}{'ours':>9}{'ref':>8}{'ours':>8}{'ref':>7}{'ours':>9}{'ref':>8}"]
    for name in CATEGORIES:
        a, b = sides["ours"]["categories"][name], sides["reference"]["categories"][name]
        ratio = f"{a['ms'] / b['ms']:7.2f}" if b["ms"] > 0 else f"{'–':>7}"
        lines.append(f"{name:<13}{a['kernels']:>8}{b['kernels']:>7}{a['bytes'] / 1e9:>9.2f}{b['bytes'] / 1e9:>8.2f}"
                     f"{a['flops'] / 1e12:>8.2f}{b['flops'] / 1e12:>7.2f}{a['ms']:>9.2f}{b['ms']:>8.2f}{ratio}")
    for key in ("device_ms", "host_ms", "step_ms"):
        lines.append(f"{key:<13}{'':>46}{sides['ours'][key]:>9.2f}{sides['reference'][key]:>8.2f}")
    return lines


def table(report: dict) -> str:
    lines = [f"{report['gpu']}: micro-batch {report['micro_batch']} × {report['micro_batches']}, "
             f"ours at {report['revision']}"]
    for mode, sides in report["modes"].items():
        lines += ["", *_mode_table(mode, sides)]
    measured = report.get("measured")
    if measured is not None:
        lines += ["", f"measured (ours eager at {measured['revision']}): " + ", ".join(
            f"ours ÷ {against} modeled {r['modeled']:.3f}, measured {r['measured']:.3f} ({r['error']:+.1%})"
            for against, r in measured["ratios"].items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="base", help="a preset name or a config file")
    parser.add_argument("--gpu", default="h200", choices=sorted(GPU_KINDS))
    parser.add_argument("--reference", required=True, help="the reference model file (nanoGPT's model.py)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--micro-batch", type=int, default=None, help="default: the config's")
    parser.add_argument("--revision", default="HEAD", help="whose loss and optimizer code (code_versions)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    report = audit(cfg, args.config, args.gpu, args.reference, args.micro_batch or micro_batch_of(cfg),
                   args.revision)
    print(json.dumps(report, indent=1) if args.json else table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
