"""The kernels of the two parts of a step the trace does not run as the GPU does: the fused loss's chunks and
DeepSpeed's optimizer step, for the code of each revision a GPU measured.

The fused loss (`ora_megatron.cross_entropy`) is traced as one op; its kernels depend on the revision:

- 9e6204f: chunks of 64 MiB of fp32 logits (524 tokens at V 32k); megatron-core's steps over each chunk's
  [tokens × V]: cast, max, subtract, exp, sum, divide, the one-hot update, the token weights' scale, the
  cast back (52 B a logit in 8 kernels);
- 0ff5a15: 256 MiB fp32 (2,097 tokens); cast to fp32, fp32 log-softmax, exp written in bf16 (20 B, 3);
- 2f8f273: 256 MiB fp32 (2,097); cast, max, subtract, exp, sum, divide into bf16 (36 B, 6 kernels);
- HEAD: 256 MiB of bf16 (4,096 tokens); one compiled chunk: a reduction pass and a pointwise pass, two
  reads and one write of the bf16 logits (6 B, 2 kernels).

Each chunk also runs the logits GEMM and the two gradient GEMMs, a few [chunk × h] kernels (the token
weights, the casts, the copy into the hidden-state gradient) and sums the weight gradient in fp32: before
HEAD a bf16 [V × h] product added into the fp32 sum (one more kernel, 10 B an element), at HEAD in the
GEMM's epilogue (its output read and written in fp32).

Gradients: autograd adds each micro-batch's gradient after the first into the parameter's (one kernel a
tensor a micro-batch), and at the accumulation boundary ZeRO copies each tensor's gradient into its
reduction bucket and back out of it (two kernels a tensor, and the bucket's all-reduce).

The optimizer step of DeepSpeed's ZeRO-1 in bf16 on one GPU (deepspeed/runtime/zero/stage_1_and_2.py,
0.19.8; the project's torch AdamW with foreach=True, pretrain/runtime/optimizer.py) over the flat fp32
partition: the bf16 gradients flattened and copied into fp32 (6 B a parameter), the gradient norm (a read),
the clip's scale, AdamW's eight foreach kernels (80 B a parameter: p·(1−lr·wd), the lerp of m, v·β₂ and
+g², sqrt, the two bias-correction/eps passes, addcdiv), each launched once per 320 blocks of 65,536
elements, and the fp32 → bf16 copy back (6 B). Before 2f8f273 DeepSpeed also checked every gradient
tensor for non-finite values first: 13 small kernels a tensor (amax, amin, two isfinite, and, not, add)
reading each gradient twice.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from pretrain.research.speed.trace import Op, Tensor

MIB = 2**20
FOREACH_LAUNCH_ELEMENTS = 320 * 65536  # torch's multi_tensor_apply: blocks a launch × elements a block
ADAMW_BYTES_PER_PARAM = 80
NONFINITE_CHECK_KERNELS = 13


@dataclass(frozen=True)
class CodeVersion:
    """What a revision's fused loss and optimizer step launch (the module docstring)."""

    revision: str
    chunk_bytes: int
    chunk_element_bytes: int
    logit_kernels: tuple[int, ...]  # bytes a logit each [chunk × V] kernel moves
    small_chunk_kernels: int  # gathers, one-hot updates, [chunk] reductions: launches, no traffic to speak of
    weight_grad_in_epilogue: bool
    nonfinite_check: bool


CODE_VERSIONS = {
    "9e6204f": CodeVersion("9e6204f", 64 * MIB, 4, (6, 4, 8, 8, 4, 8, 8, 6), 6, False, True),
    "0ff5a15": CodeVersion("0ff5a15", 256 * MIB, 4, (6, 8, 6), 4, False, True),
    "2f8f273": CodeVersion("2f8f273", 256 * MIB, 4, (6, 4, 8, 8, 4, 6), 5, False, False),
    "HEAD": CodeVersion("HEAD", 256 * MIB, 2, (2, 4), 3, True, False),
}


def code_version(revision: str) -> CodeVersion:
    try:
        return CODE_VERSIONS[revision]
    except KeyError:
        raise ValueError(f"no op model for revision {revision!r}; known: {', '.join(CODE_VERSIONS)}") from None


_idents = itertools.count(-1, -1)  # synthesized tensors: identities apart from the trace's


def _tensor(*shape: int, itemsize: int) -> Tensor:
    return Tensor(tuple(shape), itemsize, next(_idents), math.prod(shape))


def _memory(name: str, elements: int, bytes_per_element: float, backward: bool = False) -> Op:
    """A memory-bound kernel moving `bytes_per_element` over `elements` (one flat read and write)."""
    moved = max(0, round(elements * bytes_per_element))
    return Op(name, "memory", (_tensor(moved, itemsize=1),), (), backward)


def _gemm(name: str, m: int, n: int, k: int, out_itemsize: int = 2) -> Op:
    return Op(name, "gemm", (_tensor(m, k, itemsize=2), _tensor(k, n, itemsize=2)),
              (_tensor(m, n, itemsize=out_itemsize),), False)


def chunk_size(code: CodeVersion, vocab: int) -> int:
    tokens = code.chunk_bytes // (code.chunk_element_bytes * vocab)
    return tokens // 128 * 128 if code.chunk_element_bytes == 2 and tokens >= 128 else max(1, tokens)


def loss_ops(code: CodeVersion, tokens: int, hidden: int, vocab: int) -> list[Op]:
    """The kernels of the fused loss over `tokens` [tokens × hidden] against a [vocab × hidden] weight."""
    ops = [_memory("loss.zero_weight_grad", vocab * hidden, 4)]
    chunk = chunk_size(code, vocab)
    for start in range(0, tokens, chunk):
        rows = min(chunk, tokens - start)
        ops.append(_gemm("loss.logits", rows, vocab, hidden))
        ops += [_memory(f"loss.logits_pass{i}", rows * vocab, b) for i, b in enumerate(code.logit_kernels)]
        ops += [_memory("loss.small", rows, 8) for _ in range(code.small_chunk_kernels)]
        ops.append(_gemm("loss.grad_hidden", rows, hidden, vocab))
        ops += [_memory("loss.row_weights", rows * hidden, 6) for _ in range(3)]
        if code.weight_grad_in_epilogue:
            weight_grad = _gemm("loss.grad_weight", vocab, hidden, rows, out_itemsize=4)
            ops.append(Op(weight_grad.name, "gemm", (*weight_grad.inputs, _tensor(vocab, hidden, itemsize=4)),
                          weight_grad.outputs, False))
        else:
            ops += [_gemm("loss.grad_weight", vocab, hidden, rows), _memory("loss.fp32_sum", vocab * hidden, 10)]
    ops += [_memory("loss.scale_weight_grad", vocab * hidden, 8), _memory("loss.cast_weight_grad", vocab * hidden, 6)]
    return ops


def loss_backward_ops(tokens: int, hidden: int, vocab: int) -> list[Op]:
    """Backward of the fused loss: both saved gradients scaled by the loss's gradient."""
    return [_memory("loss.backward_hidden", tokens * hidden, 4, True),
            _memory("loss.backward_weight", vocab * hidden, 4, True)]


def gradient_ops(tensor_sizes: list[int], micro_batches: int) -> list[Op]:
    """The gradient accumulation of a step's micro-batches and ZeRO's bucket copies at its boundary."""
    ops = [_memory("gradients.accumulate", size, 6) for _ in range(micro_batches - 1) for size in tensor_sizes]
    ops += [_memory("gradients.bucket_copy", size, 4) for size in tensor_sizes for _ in range(2)]
    ops.append(_memory("gradients.all_reduce", sum(tensor_sizes), 4))
    return ops


def optimizer_ops(code: CodeVersion, tensor_sizes: list[int]) -> list[Op]:
    """DeepSpeed's bf16 ZeRO-1 step over tensors of these sizes held by one GPU (the module docstring)."""
    params = sum(tensor_sizes)
    ops = []
    if code.nonfinite_check:
        for size in tensor_sizes:
            ops += [_memory("optimizer.nonfinite_read", size, 2) for _ in range(2)]
            ops += [_memory("optimizer.nonfinite_scalar", 1, 4) for _ in range(NONFINITE_CHECK_KERNELS - 2)]
    ops += [_memory("optimizer.flatten_grads", params, 4), _memory("optimizer.grads_to_fp32", params, 6),
            _memory("optimizer.grad_norm", params, 4), _memory("optimizer.clip_scale", params, 8)]
    launches = max(1, math.ceil(params / FOREACH_LAUNCH_ELEMENTS))
    per_kernel = ADAMW_BYTES_PER_PARAM / 8
    ops += [_memory("optimizer.adamw", math.ceil(params / launches), per_kernel) for _ in range(8 * launches)]
    ops.append(_memory("optimizer.params_to_bf16", params, 6))
    return ops
