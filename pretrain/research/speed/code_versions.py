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

Gradients (`gradient_ops`, by ZeRO stage; deepspeed/runtime/zero/stage_1_and_2.py and engine.py, 0.19.8,
contiguous gradients as the run's config leaves them): ZeRO-1 lets autograd add each micro-batch's
gradient after the first into the parameter's (one kernel a tensor a micro-batch) and at the accumulation
boundary copies each tensor's gradient into its reduction bucket and from it into the partition (two
kernels a tensor); ZeRO-2 and ZeRO-3 reduce every micro-batch, two copies a tensor each time, autograd
accumulating nothing; ZeRO-0 accumulates as ZeRO-1, then DeepSpeed's all-reduce flattens its buckets (a
pass over every gradient) and copies each gradient back out (one kernel a tensor). On one GPU, NCCL's
all-reduce of the buckets is one more pass (`one_rank_all_reduce`).

The optimizer step of DeepSpeed's ZeRO-1 in bf16 on one GPU (deepspeed/runtime/zero/stage_1_and_2.py,
0.19.8; the project's torch AdamW with foreach=True, pretrain/runtime/optimizer.py) over the flat fp32
partition: the bf16 gradients flattened and copied into fp32 (6 B a parameter), the gradient norm (a read),
the clip's scale, AdamW's eight foreach kernels (80 B a parameter: p·(1−lr·wd), the lerp of m, v·β₂ and
+g², sqrt, the two bias-correction/eps passes, addcdiv), each launched once per 320 blocks of 65,536
elements (at HEAD, torch's fused AdamW on CUDA: one kernel a launch, 28 B a parameter), and the
fp32 → bf16 copy back (6 B). Before 2f8f273 DeepSpeed also checked every gradient
tensor for non-finite values first: 13 small kernels a tensor (amax, amin, two isfinite, and, not, add)
reading each gradient twice.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from pretrain.research.speed.trace import Op, Tensor

MIB = 2**20
# torch's multi_tensor_apply (CUDA): tensors a launch at each depth (lists read), blocks a launch, elements
# a block. Fused AdamW reads four lists (params, grads, exp_avg, exp_avg_sq); the foreach norm and the
# foreach scale, one.
FOREACH_TENSORS_A_LAUNCH = {1: 110, 4: 36}
FOREACH_BLOCK_ELEMENTS = 65536
FOREACH_BLOCKS_A_LAUNCH = 320
FOREACH_LAUNCH_ELEMENTS = FOREACH_BLOCKS_A_LAUNCH * FOREACH_BLOCK_ELEMENTS
ADAMW_BYTES_PER_PARAM = 80
FUSED_ADAMW_BYTES_PER_PARAM = 28  # read p, g, m, v; write p, m, v (fp32)
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
    fused_adamw: bool = False  # torch's fused AdamW kernel instead of foreach's eight passes


CODE_VERSIONS = {
    "9e6204f": CodeVersion("9e6204f", 64 * MIB, 4, (6, 4, 8, 8, 4, 8, 8, 6), 6, False, True),
    "0ff5a15": CodeVersion("0ff5a15", 256 * MIB, 4, (6, 8, 6), 4, False, True),
    "2f8f273": CodeVersion("2f8f273", 256 * MIB, 4, (6, 4, 8, 8, 4, 6), 5, False, False),
    "HEAD": CodeVersion("HEAD", 256 * MIB, 2, (2, 4), 3, True, False, fused_adamw=True),
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


def foreach_launches(sizes: list[int], depth: int) -> int:
    """Kernels one multi_tensor_apply call launches over tensors of `sizes`: a launch holds at most
    FOREACH_TENSORS_A_LAUNCH[depth] tensors and FOREACH_BLOCKS_A_LAUNCH blocks of FOREACH_BLOCK_ELEMENTS."""
    blocks = sum(math.ceil(size / FOREACH_BLOCK_ELEMENTS) for size in sizes)
    return max(1, math.ceil(len(sizes) / FOREACH_TENSORS_A_LAUNCH[depth]),
               math.ceil(blocks / FOREACH_BLOCKS_A_LAUNCH))


def launched_ops(name: str, sizes: list[int], depth: int, bytes_per_element: float) -> list[Op]:
    """One multi_tensor_apply call over tensors of `sizes`, as the kernels it launches."""
    launches = foreach_launches(sizes, depth)
    return [_memory(name, math.ceil(sum(sizes) / launches), bytes_per_element) for _ in range(launches)]


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


@dataclass(frozen=True)
class GradientWork:
    """What one GPU does with its gradients in a step: its trainable tensors' sizes (its tensor-parallel
    and pipeline shard), over how many micro-batches, under which ZeRO stage (`gradient_ops`)."""

    tensor_sizes: tuple[int, ...]
    micro_batches: int
    zero_stage: int


def gradient_op_groups(tensor_sizes: list[int], micro_batches: int, zero_stage: int = 1) -> list[tuple[int, list[Op]]]:
    """The gradients' accumulation over a step's micro-batches and ZeRO's copies of them (module docstring),
    as (times repeated, ops): the work each micro-batch repeats is listed once."""
    copies = [_memory("gradients.bucket_copy", size, 4) for size in tensor_sizes for _ in range(2)]
    if zero_stage >= 2:
        return [(micro_batches, copies)]
    accumulate = (micro_batches - 1, [_memory("gradients.accumulate", size, 6) for size in tensor_sizes])
    if zero_stage == 1:
        return [accumulate, (1, copies)]
    return [accumulate, (1, [_memory("gradients.flatten", sum(tensor_sizes), 4),
                             *(_memory("gradients.copy_back", size, 4) for size in tensor_sizes)])]


def gradient_ops(tensor_sizes: list[int], micro_batches: int, zero_stage: int = 1) -> list[Op]:
    """`gradient_op_groups` as the ops in the order they run."""
    return [op for times, ops in gradient_op_groups(tensor_sizes, micro_batches, zero_stage)
            for _ in range(times) for op in ops]


def one_rank_all_reduce(tensor_sizes: list[int]) -> Op:
    """NCCL's all-reduce of the gradient buckets on a single GPU: one pass over them."""
    return _memory("gradients.all_reduce", sum(tensor_sizes), 4)


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
    passes, moved = (1, FUSED_ADAMW_BYTES_PER_PARAM) if code.fused_adamw else (8, ADAMW_BYTES_PER_PARAM / 8)
    ops += [_memory("optimizer.adamw", math.ceil(params / launches), moved) for _ in range(passes * launches)]
    ops.append(_memory("optimizer.params_to_bf16", params, 6))
    return ops


UNFUSED_OVERFLOW_SCALARS = 10  # has_inf_or_nan's kernels on its two reductions' results


def unfused_optimizer_ops(code: CodeVersion, tensor_sizes: list[int]) -> list[Op]:
    """DeepSpeed's bf16 step without ZeRO (FP16_UnfusedOptimizer, deepspeed/runtime/fp16/unfused_optimizer.py,
    0.19.8), tensor by tensor, as its ops dispatch: the overflow check (amax and amin of the gradient, ten
    scalar kernels, and a copy of the verdict to the host, which waits for the device), the gradient norm
    (an fp32 copy, its norm and two scalar kernels), the fp32 gradient, the clip's scale; torch's AdamW
    over the fp32 parameters (a multi-tensor call); the copy back into the bf16 weight."""
    ops = []
    for size in tensor_sizes:
        ops += [_memory("optimizer.overflow_read", size, 2) for _ in range(2)]
        ops += [_memory("optimizer.overflow_scalar", 1, 4) for _ in range(UNFUSED_OVERFLOW_SCALARS)]
        ops.append(_memory("optimizer.overflow_sync", 1, 4))
        ops += [_memory("optimizer.norm_fp32_copy", size, 6), _memory("optimizer.norm", size, 4),
                _memory("optimizer.norm_scalar", 1, 4), _memory("optimizer.norm_scalar", 1, 4)]
        ops += [_memory("optimizer.grad_to_fp32", size, 6), _memory("optimizer.clip_scale", size, 8)]
    if code.fused_adamw:
        ops += launched_ops("optimizer.adamw", tensor_sizes, 4, FUSED_ADAMW_BYTES_PER_PARAM)
    else:
        ops += [op for _ in range(8)
                for op in launched_ops("optimizer.adamw", tensor_sizes, 4, ADAMW_BYTES_PER_PARAM / 8)]
    return ops + [_memory("optimizer.params_to_bf16", size, 6) for size in tensor_sizes]
