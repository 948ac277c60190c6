"""The roofline cost of traced ops on a GPU kind, eager or compiled.

Each kernel takes max(FLOPs / GEMM or attention rate, bytes / achievable bandwidth) + `kernel_s`:

- GEMMs (mm, addmm, bmm): 2·M·N·K FLOPs at the GPU's bf16 peak × `gemm_efficiency` × the wave
  efficiency of its output tiles (128 × 256 tiles, K split as cuBLAS does when they are few, over the
  GPU's SMs: a GEMM of 1.2 waves runs two);
- attention (cuDNN / flash, FlexAttention): 4·b·heads·s²·d FLOPs forward, halved when causal, 2.5×
  that backward (its five matmuls against two), at peak × `attention_efficiency`;
- every other kernel moves the bytes of its inputs and outputs at HBM × `bandwidth_efficiency`.

Eager, each op that is not a view is one kernel. Compiled (Inductor), each run of memory-bound ops between
two GEMMs, attention calls or loss kernels is one kernel that reads its inputs from outside the run and
writes the outputs something after the run reads (`fused_groups`).

The host spends `host_s_per_op` on each op it issues eagerly (Python, the dispatcher, autograd, DeepSpeed's
loops; compiled graphs issue their kernels at `kernel_s`); a stretch of the step (one micro-batch's forward
and backward, the optimizer step) takes max(device time, host time).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pretrain.research.speed.gpus import GPUKind
from pretrain.research.speed.trace import Op, Tensor

GEMM_TILE = (128, 256)
MAX_SPLIT_K = 16
# aten ops that launch more than one kernel on CUDA: layer norm's backward (the input's gradient, then
# gamma and beta's), the embedding's backward (sort the indices, count, scatter the rows).
EXTRA_KERNELS = {"native_layer_norm_backward": 2, "embedding_dense_backward": 6}
CATEGORIES = ("gemm", "attention", "other", "optimizer")


@dataclass
class CategoryCost:
    """A category's kernels, the bytes they move, their FLOPs and their device time."""

    kernels: int = 0
    bytes: float = 0.0
    flops: float = 0.0
    device_s: float = 0.0

    def add(self, other: CategoryCost) -> None:
        self.kernels += other.kernels
        self.bytes += other.bytes
        self.flops += other.flops
        self.device_s += other.device_s


@dataclass
class StretchCost:
    """A stretch of a step (ops the device runs back to back): per category, and the host's time."""

    categories: dict[str, CategoryCost] = field(default_factory=lambda: {c: CategoryCost() for c in CATEGORIES})
    host_s: float = 0.0

    @property
    def device_s(self) -> float:
        return sum(c.device_s for c in self.categories.values())

    @property
    def kernels(self) -> int:
        return sum(c.kernels for c in self.categories.values())

    @property
    def seconds(self) -> float:
        return max(self.device_s, self.host_s)

    def add(self, other: StretchCost, times: int = 1) -> None:
        """Run `other`'s ops `times` more in this stretch."""
        for name, cost in other.categories.items():
            self.categories[name].add(CategoryCost(times * cost.kernels, times * cost.bytes, times * cost.flops,
                                                   times * cost.device_s))
        self.host_s += times * other.host_s


def _bytes(tensors: tuple[Tensor, ...]) -> int:
    return sum(t.nbytes for t in tensors)


# aten ops whose kernel reads one of their inputs only in part: that input's index, and the elements read.
# NLL's forward gathers one log-probability a row (the target's); its backward takes `self` for its shape.
PARTIAL_READS = {
    "nll_loss_forward": (0, lambda op: op.inputs[1].numel),
    "nll_loss_backward": (1, lambda op: 0),
}


def moved_bytes(op: Op) -> int:
    """The bytes a kernel reads and writes: its inputs (where `PARTIAL_READS` has the op, the part read)
    and its outputs."""
    partial = PARTIAL_READS.get(op.name)
    if partial is None:
        return _bytes(op.inputs) + _bytes(op.outputs)
    index, elements = partial
    inputs = [t.nbytes if i != index else elements(op) * t.itemsize for i, t in enumerate(op.inputs)]
    return sum(inputs) + _bytes(op.outputs)


def gemm_dims(op: Op) -> tuple[int, int, int, int]:
    """(batch, M, N, K) of a GEMM op: addmm and baddbmm read the added tensor first."""
    a, b = op.inputs[1:3] if op.name in ("addmm", "baddbmm") else op.inputs[:2]
    batch = a.shape[0] if len(a.shape) == 3 else 1
    return batch, a.shape[-2], b.shape[-1], a.shape[-1]


def wave_efficiency(batch: int, m: int, n: int, k: int, sms: int) -> float:
    """The share of the SMs' time a GEMM's output tiles keep busy (the last wave partly idle); with fewer
    tiles than SMs, the best split of K into up to MAX_SPLIT_K slices of at least 256 (as cuBLAS splits)."""
    tiles = batch * math.ceil(m / GEMM_TILE[0]) * math.ceil(n / GEMM_TILE[1])
    splits = range(1, max(1, min(MAX_SPLIT_K, k // 256)) + 1) if tiles < sms else (1,)
    return max(tiles * s / (math.ceil(tiles * s / sms) * sms) for s in splits)


def gemm_seconds(op: Op, gpu: GPUKind) -> tuple[float, float]:
    """(FLOPs, device seconds) of a GEMM op."""
    batch, m, n, k = gemm_dims(op)
    flops = 2.0 * batch * m * n * k
    rate = gpu.bf16_dense_flops * gpu.constants.gemm_efficiency * wave_efficiency(batch, m, n, k, gpu.sm_count)
    moved = moved_bytes(op)
    return flops, max(flops / rate, moved / gpu.achievable_bytes_per_s) + gpu.constants.kernel_s


def attention_flops(op: Op) -> float:
    q, k = op.inputs[-3], op.inputs[-2]  # forward (q, k, v); backward (grad, q, k, v)
    causal = op.args[0] if op.args else True
    forward = 4.0 * math.prod(q.shape[:-1]) * k.shape[-2] * q.shape[-1] * (0.5 if causal else 1.0)
    return forward * (2.5 if op.backward else 1.0)


def kernel_cost(op: Op, gpu: GPUKind) -> CategoryCost:
    """One kernel's cost (a memory-bound op, a GEMM or an attention call)."""
    moved = moved_bytes(op)
    if op.kind == "gemm":
        flops, seconds = gemm_seconds(op, gpu)
        return CategoryCost(1, moved, flops, seconds)
    if op.kind == "attention":
        flops = attention_flops(op)
        rate = gpu.bf16_dense_flops * gpu.constants.attention_efficiency
        return CategoryCost(1, moved, flops, max(flops / rate, moved / gpu.achievable_bytes_per_s)
                            + gpu.constants.kernel_s)
    kernels = EXTRA_KERNELS.get(op.name, 1)
    return CategoryCost(kernels, moved, 0.0, moved / gpu.achievable_bytes_per_s + kernels * gpu.constants.kernel_s)


def category_of(op: Op) -> str:
    if op.name.startswith(("optimizer.", "gradients.")):
        return "optimizer"
    return op.kind if op.kind in ("gemm", "attention") else "other"


def fused_groups(ops: list[Op]) -> list[Op]:
    """Inductor's view of `ops`: each run of memory-bound ops of the trace (not the loss's or the
    optimizer's kernels, costed as their code runs) between two other kernels becomes one op reading its
    inputs from outside the run and writing what later ops read."""
    read_at: dict[int, int] = {}
    for index, op in enumerate(ops):
        for tensor in op.inputs:
            read_at[tensor.ident] = index  # the last read
    out, run = [], []

    def close(end: int) -> None:
        if not run:
            return
        written = {t.ident for op in run for t in op.outputs}
        inputs = {t.ident: t for op in run for t in op.inputs if t.ident not in written}
        outputs = {t.ident: t for op in run for t in op.outputs if read_at.get(t.ident, -1) >= end}
        out.append(Op("fused", "memory", tuple(inputs.values()), tuple(outputs.values()), run[0].backward))
        run.clear()

    for index, op in enumerate(ops):
        fusable = op.kind in ("memory", "fused") and "." not in op.name
        if op.kind == "view":
            continue
        if fusable:
            run.append(op)
            continue
        close(index)
        out.append(op)
    close(len(ops))
    return out


def stretch_cost(ops: list[Op], gpu: GPUKind, compiled: bool) -> StretchCost:
    """The device and host time of ops run back to back. Eager, the host spends `host_s_per_op` on each
    op of the layers (views too) and on each kernel of the loss's chunk loop and the gradients' and
    optimizer's loops (named "part.kernel"); compiled layers launch their kernels from the graph's
    wrapper, at `kernel_s` each."""
    constants = gpu.constants
    stretch = StretchCost()
    kernels = fused_groups(ops) if compiled else [op for op in ops if op.kind != "view"]
    for op in kernels:
        stretch.categories[category_of(op)].add(kernel_cost(op, gpu))
        if "." in op.name:
            stretch.host_s += constants.host_s_per_op * EXTRA_KERNELS.get(op.name, 1)
        elif compiled:
            stretch.host_s += constants.kernel_s
    if not compiled:
        stretch.host_s += constants.host_s_per_op * sum("." not in op.name for op in ops)
    return stretch
