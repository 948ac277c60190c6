"""A training step's time on a GPU kind, from the ops it dispatches (docs/speed_model.md).

    python -m pretrain.research.speed.step_time --config base --gpu h100 [--set k=v ...]
        [--micro-batch 64] [--compiled] [--revision HEAD] [--json]

prints, per category (GEMMs, attention, the other kernels, the optimizer step): kernels, bytes, FLOPs and
milliseconds of one step (all its micro-batches and the optimizer), then the step's time, tokens/s and
MFU against the project's FLOP count. The cluster plan reads `micro_batch_time` (one micro-batch's
forward and backward on one GPU, its tensor-parallel shard) and `optimizer_step_time` (for the
parameters one GPU holds, so ZeRO's partitioning scales it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from pretrain.research.speed.code_versions import (
    CodeVersion,
    GradientWork,
    code_version,
    gradient_op_groups,
    gradient_ops,
    loss_backward_ops,
    loss_ops,
    one_rank_all_reduce,
    optimizer_ops,
    unfused_optimizer_ops,
)
from pretrain.research.speed.cost import StretchCost, stretch_cost
from pretrain.research.speed.gpus import GPU_KINDS, GPUKind, gpu_kind
from pretrain.research.speed.trace import Op, Tensor, Trace, trace, trace_at_one

TRACE_CACHE = Path(__file__).resolve().parents[3] / "runs" / "speed_traces"
TRACE_FORMAT = 4  # bumped when the cached JSON's fields change


# --------------------------------------------------------------------------- the run config's values

def model_of(cfg):
    return cfg.model


def documents_masked(cfg) -> bool:
    return bool(cfg.data.reset_attention_mask)


def compiled_of(cfg) -> bool:
    return bool(cfg.speed.compile)


def micro_batch_of(cfg) -> int:
    return cfg.train.micro_batch_size


def tokens_per_step(cfg) -> int:
    return cfg.tokens_per_step


def flops_per_token(cfg) -> float:
    from pretrain.runtime.accounting import flops_per_token as count

    return count(cfg.model)


def load_config(config: str, overrides: list[str]):
    from pretrain.config.run_config import load_run_config
    from pretrain.research.memory_plan import config_path

    return load_run_config(str(config_path(config)), overrides)


# --------------------------------------------------------------------------- the trace, cached

def _trace_key(cfg) -> str:
    what = repr((TRACE_FORMAT, model_of(cfg), documents_masked(cfg), torch.__version__))
    return hashlib.sha256(what.encode()).hexdigest()[:16]


def _ops_json(ops) -> list:
    def tensors(items):
        return [[list(t.shape), t.itemsize, t.ident, t.elements] for t in items]

    return [[op.name, op.kind, tensors(op.inputs), tensors(op.outputs), op.backward, list(op.args)] for op in ops]


def _ops_of(rows) -> tuple[Op, ...]:
    def tensors(items):
        return tuple(Tensor(tuple(shape), itemsize, ident, elements) for shape, itemsize, ident, elements in items)

    return tuple(Op(name, kind, tensors(ins), tensors(outs), backward, tuple(args))
                 for name, kind, ins, outs, backward, args in rows)


# Traces parsed in this process, one per cache file: read once, however many layouts a plan prices.
_PARSED: dict[Path, object] = {}


def _cached(path: Path | None, build, to_json, from_json):
    if path is not None and path in _PARSED:
        return _PARSED[path]
    if path is not None and path.exists():
        value = from_json(json.loads(path.read_text()))
    else:
        value = build()
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(to_json(value)))
    if path is not None:
        _PARSED[path] = value
    return value


def _trace_json(traced: Trace) -> dict:
    return {"at_two": _ops_json(traced.at_two), "at_three": _ops_json(traced.at_three),
            "parameters": [list(s) for s in traced.parameters]}


def _trace_of(data: dict) -> Trace:
    return Trace(_ops_of(data["at_two"]), _ops_of(data["at_three"]), tuple(tuple(s) for s in data["parameters"]))


def cached_trace(cfg, cache: Path | None = TRACE_CACHE) -> Trace:
    """`trace(cfg)`, kept as JSON under `cache` per model shape and in memory once read (None: not kept)."""
    path = None if cache is None else cache / f"{_trace_key(cfg)}.json"
    return _cached(path, lambda: trace(cfg), _trace_json, _trace_of)


def micro_batch_ops(cfg, micro_batch: int, cache: Path | None = TRACE_CACHE) -> list[Op]:
    """One micro-batch's ops: micro-batch 1 from its own trace (kept as cached_trace keeps), larger ones
    extended from the trace at 2 and 3."""
    if micro_batch < 1:
        raise ValueError(f"a micro-batch holds at least 1 sequence, got {micro_batch}")
    if micro_batch > 1:
        return cached_trace(cfg, cache).at(micro_batch)
    path = None if cache is None else cache / f"{_trace_key(cfg)}.at_one.json"
    return list(_cached(path, lambda: trace_at_one(cfg), _ops_json, _ops_of))


# --------------------------------------------------------------------------- the interface


def _expanded_loss(ops: list[Op], revision: str) -> list[Op]:
    """The trace's one loss op each way replaced by the revision's loss kernels."""
    code = code_version(revision)
    out = []
    for op in ops:
        if op.kind != "loss":
            out.append(op)
            continue
        (tokens, hidden), vocab = op.inputs[-2].shape, op.inputs[-1].shape[0]  # backward reads the grad first
        out += loss_backward_ops(tokens, hidden, vocab) if op.backward else loss_ops(code, tokens, hidden, vocab)
    return out


def _sharded(op: Op, tensor_parallel: int, split_sizes: set[int]) -> Op:
    """Op `op` on one rank of `tensor_parallel` (docs/speed_model.md, "Tensor parallelism")."""
    def shard(t: Tensor) -> Tensor:
        shape = tuple(d // tensor_parallel if d in split_sizes else d for d in t.shape)
        return replace(t, shape=shape, elements=t.elements * math.prod(shape) // max(1, math.prod(t.shape)))

    if op.kind == "gemm":
        a_index = 1 if op.name in ("addmm", "baddbmm") else 0
        a, b = op.inputs[a_index], op.inputs[a_index + 1]
        tp = tensor_parallel
        if b.shape[-1] in split_sizes:  # column-parallel: N split
            b = replace(b, shape=(*b.shape[:-1], b.shape[-1] // tp), elements=b.elements // tp)
        else:  # row-parallel: K split
            a = replace(a, shape=(*a.shape[:-1], a.shape[-1] // tp), elements=a.elements // tp)
        inputs = (*op.inputs[:a_index], a, b, *op.inputs[a_index + 2:])
        return replace(op, inputs=inputs, outputs=tuple(shard(t) for t in op.outputs))
    return replace(op, inputs=tuple(shard(t) for t in op.inputs), outputs=tuple(shard(t) for t in op.outputs))


def micro_batch_time(cfg, gpu: GPUKind, micro_batch: int, tensor_parallel: int = 1, compiled: bool = False,
                     revision: str = "HEAD", cache: Path | None = TRACE_CACHE) -> StretchCost:
    """One micro-batch's forward and backward on one GPU (its tensor-parallel shard, communication left
    out), per category, with the host's time: `.seconds` is max(device, host). `cfg`: a RunConfig (the
    preset with its overrides); `revision`: whose loss code (code_versions.CODE_VERSIONS)."""
    ops = _expanded_loss(micro_batch_ops(cfg, micro_batch, cache), revision)
    if tensor_parallel > 1:
        model = model_of(cfg)
        split = {model.ffn_size, 3 * model.hidden_size, model.num_attention_heads, ops_vocab(ops)}
        ops = [_sharded(op, tensor_parallel, split) for op in ops]
    return stretch_cost(ops, gpu, compiled)


def ops_vocab(ops: list[Op]) -> int:
    """The padded vocabulary of the loss's kernels (the logits GEMM's N)."""
    return next(op.outputs[0].shape[-1] for op in ops if op.name == "loss.logits")


def optimizer_step_time(gpu: GPUKind, parameters: int, tensors: int = 1, revision: str = "HEAD",
                        gradients: GradientWork | None = None) -> StretchCost:
    """DeepSpeed's bf16 optimizer step over `parameters` held by one GPU in `tensors` gradient tensors (only
    revisions with the per-tensor non-finite check launch kernels per tensor), after the step's work on
    its gradients (`gradients`: their accumulation and ZeRO's copies), in one stretch as `step_ops` has it.
    Without ZeRO (`gradients.zero_stage` 0) the step runs tensor by tensor over `gradients.tensor_sizes`."""
    code = code_version(revision)
    if gradients is None:
        share, extra = divmod(parameters, tensors)
        return stretch_cost(optimizer_ops(code, [share + (1 if i < extra else 0) for i in range(tensors)]), gpu,
                            compiled=False)
    sizes = list(gradients.tensor_sizes)
    step = unfused_optimizer_ops(code, sizes) if gradients.zero_stage == 0 else optimizer_ops(code, [parameters])
    stretch = stretch_cost(step, gpu, compiled=False)
    for times, ops in gradient_op_groups(sizes, gradients.micro_batches, gradients.zero_stage):
        stretch.add(stretch_cost(ops, gpu, compiled=False), times)  # a micro-batch's share, costed once
    return stretch


@dataclass
class StepTime:
    micro_batches: int
    micro_batch: StretchCost
    optimizer: StretchCost
    tokens: int
    flops: float

    @property
    def seconds(self) -> float:
        return self.micro_batches * self.micro_batch.seconds + self.optimizer.seconds

    def totals(self) -> StretchCost:
        """The whole step's kernels, bytes, FLOPs and device time per category, and its host time."""
        whole = StretchCost()
        whole.add(self.micro_batch, self.micro_batches)
        whole.add(self.optimizer)
        return whole


@dataclass(frozen=True)
class StepOps:
    """A step's ops: one micro-batch's forward and backward, and the gradients' and optimizer's kernels."""

    micro_batch: list[Op]
    optimizer: list[Op]
    micro_batches: int
    tokens: int
    flops: float

    def time(self, gpu: GPUKind, compiled: bool) -> StepTime:
        return StepTime(self.micro_batches, stretch_cost(self.micro_batch, gpu, compiled),
                        stretch_cost(self.optimizer, gpu, compiled=False), self.tokens, self.flops)


def one_gpu_optimizer_ops(tensor_sizes: list[int], micro_batches: int, code: CodeVersion) -> list[Op]:
    """One GPU's optimizer stretch under ZeRO-1: the gradients' accumulation and copies, the one-rank
    all-reduce, and the optimizer step over every trainable tensor."""
    return [*gradient_ops(tensor_sizes, micro_batches), one_rank_all_reduce(tensor_sizes),
            *optimizer_ops(code, tensor_sizes)]


def micro_batches_of(cfg, micro_batch: int) -> int:
    """Micro-batches of a step on one GPU: `tokens_per_step / (micro_batch · seq)`, at least one."""
    return max(1, tokens_per_step(cfg) // (micro_batch * model_of(cfg).seq_length))


def parameter_sizes(cfg, cache: Path | None = TRACE_CACHE) -> list[int]:
    """The elements of each trainable parameter, as the trace found them."""
    return [int(torch.Size(shape).numel()) for shape in cached_trace(cfg, cache).parameters]


def step_ops(cfg, micro_batch: int, revision: str = "HEAD", cache: Path | None = TRACE_CACHE) -> StepOps:
    """One training step on one GPU at tensor size 1: `micro_batches_of` micro-batches, the gradients'
    accumulation and bucket copies, and the optimizer step over every trainable parameter."""
    tokens = tokens_per_step(cfg)
    micro_batches = micro_batches_of(cfg, micro_batch)
    optimizer = one_gpu_optimizer_ops(parameter_sizes(cfg, cache), micro_batches, code_version(revision))
    return StepOps(_expanded_loss(micro_batch_ops(cfg, micro_batch, cache), revision), optimizer, micro_batches, tokens,
                   tokens * flops_per_token(cfg))


def step_time(cfg, gpu: GPUKind, micro_batch: int, compiled: bool, revision: str = "HEAD",
              cache: Path | None = TRACE_CACHE) -> StepTime:
    return step_ops(cfg, micro_batch, revision, cache).time(gpu, compiled)


def step_summary(step: StepTime, gpu: GPUKind) -> dict:
    """Per category of the whole step: kernels, bytes, FLOPs, ms; the step's ms, tokens/s and MFU."""
    whole = step.totals()
    rows = {name: {**asdict(cost), "ms": cost.device_s * 1e3} for name, cost in whole.categories.items()}
    seconds = step.seconds
    return {"gpu": gpu.name, "categories": rows, "micro_batches": step.micro_batches,
            "device_ms": whole.device_s * 1e3, "host_ms": whole.host_s * 1e3,
            "step_ms": seconds * 1e3, "tokens_per_s": step.tokens / seconds,
            "mfu": step.flops / seconds / gpu.bf16_dense_flops}


def _table(summary: dict) -> str:
    lines = [f"{summary['gpu']}: {summary['micro_batches']} micro-batches a step",
             f"{'category':<10} {'kernels':>8} {'GB':>8} {'TFLOP':>8} {'ms':>8}"]
    for name, row in summary["categories"].items():
        lines.append(f"{name:<10} {row['kernels']:>8} {row['bytes'] / 1e9:>8.2f} {row['flops'] / 1e12:>8.2f} "
                     f"{row['ms']:>8.1f}")
    lines.append(f"device {summary['device_ms']:.1f} ms, host {summary['host_ms']:.1f} ms → step "
                 f"{summary['step_ms']:.1f} ms, {summary['tokens_per_s']:,.0f} tokens/s, MFU {summary['mfu']:.1%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="base", help="a preset name or a config file")
    parser.add_argument("--gpu", default="h100", choices=sorted(GPU_KINDS))
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--micro-batch", type=int, default=None, help="default: the config's")
    parser.add_argument("--compiled", action="store_true", help="layers compiled (default: speed.compile)")
    parser.add_argument("--revision", default="HEAD", help="whose loss and optimizer code (code_versions)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    gpu = gpu_kind(args.gpu)
    micro_batch = args.micro_batch or micro_batch_of(cfg)
    summary = step_summary(step_time(cfg, gpu, micro_batch, args.compiled or compiled_of(cfg), args.revision), gpu)
    print(json.dumps(summary, indent=1) if args.json else _table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
