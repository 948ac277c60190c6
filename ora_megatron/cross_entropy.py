"""The language-model loss: mean next-token cross entropy over the unmasked positions.

Two ways to it, the same definition (`masked_mean` of megatron-core's per-token cross entropy):

- `lm_loss(logits, (labels, loss_mask))` on vocab-parallel logits: megatron-core's
  `vocab_parallel_cross_entropy` (at TP 1 `_OneRankCrossEntropy`, the same steps without the
  collectives). It keeps the fp32 softmax of every token ([tokens × V/tp]) for backward. The
  pipeline uses it (its last stage sees the logits, not the labels), and so does the plain model at
  TP > 1.
- `linear_cross_entropy(hidden, weight, labels, loss_mask)` (the plain model at TP 1) fuses the output
  projection with the loss, as Liger-Kernel's fused linear cross entropy does: tokens are taken a
  chunk at a time, and each chunk's gradients w.r.t. the hidden states and the weight are computed
  in the forward, so backward keeps [tokens × h] + [V × h], never a [tokens × V] tensor. The matmuls
  run in the weight's dtype, the softmax in fp32; the weight gradient is summed over the chunks in
  fp32 and rounded to the weight's dtype once.

A chunk's elementwise work (log-softmax, loss, gradient softmax − one-hot written over the chunk's
logits) takes one of two paths, the same arithmetic:

- "eager": torch ops in place, six passes over [chunk × V] through an fp32 copy of the logits. The
  default on CPU: there the compiled chunks took 7-13% more CPU time (one thread, V 2048 and 32000;
  the exponential is the CPU's cost, and inductor's kernel computes it twice rather than store it).
- "compiled": the same steps written for `torch.compile` (`_fusable_chunk_losses_and_grad`), which
  inductor fuses into a reduction and one pass that reads the logits and writes their gradient in
  place: no fp32 [chunk × V] copy. The default on CUDA, where those passes are memory traffic.
  One graph serves every chunk length (the token dimension is marked dynamic); inside a caller that
  is itself being compiled, the steps are traced into its graph instead.

Chunk size (`chunk_tokens`): the chunk's [tokens × V] working buffer is kept within
`LOGITS_CHUNK_BYTES` (256 MiB, a small share of a GPU's memory), rounded down to whole 128-token
tiles of the matmuls. The buffer counted is the eager path's fp32 copy (fp32 logits themselves when
the weight is fp32) and the compiled path's logits in the weight's dtype, so in bf16 the compiled
path takes twice the tokens for the same bytes. Each chunk costs a few kernel launches and one
read and write of the fp32 [V × h] weight-gradient sum, so chunks are as large as the budget
allows: at V = 32000, 2,048 tokens (eager, 16 chunks for one 32,768-token micro-batch) or 4,096
(compiled in bf16, 8 chunks).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Literal

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy, vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.utils import VocabUtility

# The budget of one chunk's [tokens × V] working buffer in the fused loss (module docstring). The
# memory model (pretrain/research/memory_model.py) counts chunks of LOGITS_CHUNK_BYTES // (4·V) tokens
# with an fp32 copy and the logits beside it: what the eager path holds, more than the compiled one.
LOGITS_CHUNK_BYTES = 256 * 2**20
# Chunks are whole tiles of the matmuls' token dimension (cuBLAS's and inductor's tiles are 64-256 rows).
MATMUL_TILE_TOKENS = 128

ChunkPath = Literal["eager", "compiled"]
_HAS_TRITON = importlib.util.find_spec("triton") is not None  # what inductor generates CUDA kernels with


class _OneRankCrossEntropy(torch.autograd.Function):
    """megatron-core's vocab-parallel cross entropy (`_VocabParallelCrossEntropy`, no label smoothing)
    for a tensor-parallel group of one rank: the same `VocabParallelCrossEntropy` steps, without its
    three all-reduces (a max and two sums over one rank leave every value as it is). On CPU each of
    them is a round trip through gloo's worker thread, which waits for a core behind the OpenMP
    threads' spin-wait (~0.2 ms each on two cores)."""

    @staticmethod
    def softmax_and_loss(logits: torch.Tensor, target: torch.Tensor):
        """(fp32 softmax, target mask, flat targets, per-token loss); fp32 logits are overwritten."""
        logits, logits_max = VocabParallelCrossEntropy.calculate_logits_max(logits)
        start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(logits.size(-1), 0, 1)
        target_mask, masked_target_1d, predicted_logits, sum_exp_logits, exp_logits = (
            VocabParallelCrossEntropy.calculate_predicted_logits(logits, target, logits_max, start, end))
        softmax, loss = VocabParallelCrossEntropy.calculate_cross_entropy_loss(
            exp_logits, predicted_logits, sum_exp_logits)
        return softmax, target_mask, masked_target_1d, loss

    @staticmethod
    def logits_grad(softmax, target_mask, masked_target_1d, grad_loss):
        """d(loss · grad_loss)/d logits, in place of the softmax."""
        grad_2d, arange_1d, softmax_update, grad_input = (
            VocabParallelCrossEntropy.prepare_gradient_calculation_operands(softmax, target_mask))
        return VocabParallelCrossEntropy.calculate_gradients(
            grad_2d, arange_1d, masked_target_1d, softmax_update, grad_input, grad_loss)

    @staticmethod
    def forward(ctx, vocab_logits, target):
        softmax, target_mask, masked_target_1d, loss = _OneRankCrossEntropy.softmax_and_loss(vocab_logits, target)
        ctx.save_for_backward(softmax, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        return _OneRankCrossEntropy.logits_grad(*ctx.saved_tensors, grad_output), None


def masked_mean(losses: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    mask = loss_mask.float()
    return (losses * mask).sum() / mask.sum().clamp(min=1.0)


def lm_loss(logits: torch.Tensor, labels_and_mask) -> torch.Tensor:
    """Mean next-token cross entropy over unmasked positions of vocab-parallel logits [b, s, V/tp].

    megatron's cross entropy flattens the leading dimensions, so it runs on the [s, b, V/tp] storage
    the output stage's logits are a view of (logits laid out otherwise are copied once), with the
    labels and mask transposed to match.
    """
    labels, loss_mask = labels_and_mask
    seq_major = logits.transpose(0, 1).float().contiguous()
    target = labels.t().contiguous()
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        losses = _OneRankCrossEntropy.apply(seq_major, target)
    else:
        losses = vocab_parallel_cross_entropy(seq_major, target)
    return masked_mean(losses, loss_mask.t())


def chunk_tokens(vocab: int, element_bytes: int) -> int:
    """Tokens per chunk of the fused loss: as many as keep a [tokens × vocab] buffer of `element_bytes`
    elements within LOGITS_CHUNK_BYTES, in whole tiles of MATMUL_TILE_TOKENS (below one tile, as many
    as fit, at least 1)."""
    tokens = LOGITS_CHUNK_BYTES // (element_bytes * vocab)
    return tokens // MATMUL_TILE_TOKENS * MATMUL_TILE_TOKENS if tokens >= MATMUL_TILE_TOKENS else max(1, tokens)


def _eager_chunk_losses(logits: torch.Tensor, target: torch.Tensor, with_grad: bool) -> torch.Tensor:
    """Per-token losses of one chunk's logits [chunk × V]; `with_grad`: the logits are overwritten by
    their gradient, softmax − one-hot, in their own dtype.

    Six passes over [chunk × V]: the fp32 copy (fp32 logits are worked on in place), max, then
    subtract, exponential and sum in place, and the softmax written back over the logits."""
    target = target.unsqueeze(1)
    logits32 = logits.float()
    top_logit = logits32.amax(dim=-1, keepdim=True)
    target_logit = logits32.gather(1, target)
    exp_logits = logits32.sub_(top_logit).exp_()
    sum_exp = exp_logits.sum(dim=-1, keepdim=True)
    losses = (sum_exp.log() - (target_logit - top_logit)).squeeze(1)
    if with_grad:
        torch.div(exp_logits, sum_exp, out=logits)
        logits[torch.arange(logits.size(0), device=logits.device), target.squeeze(1)] -= 1.0
    return losses


def _log_softmax_terms(logits32: torch.Tensor, target: torch.Tensor):
    """(row max, row sum of exp(logit − max), per-token loss) of fp32 logits, in the eager path's order of
    operations, out of place: what inductor fuses into one reduction over each row."""
    top_logit = logits32.amax(dim=-1, keepdim=True)
    sum_exp = (logits32 - top_logit).exp().sum(dim=-1, keepdim=True)
    target_logit = logits32.gather(1, target.unsqueeze(1))
    return top_logit, sum_exp, (sum_exp.log() - (target_logit - top_logit)).squeeze(1)


def _fusable_chunk_losses(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """`_eager_chunk_losses` without the gradient, written for torch.compile."""
    return _log_softmax_terms(logits.float(), target)[2]


def _fusable_chunk_losses_and_grad(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """`_eager_chunk_losses` with the gradient, written for torch.compile: the fp32 logits are never
    stored, the gradient is one pass that reads the logits and writes over them (the one-hot from an
    index comparison, not a scatter)."""
    logits32 = logits.float()
    top_logit, sum_exp, losses = _log_softmax_terms(logits32, target)
    is_target = torch.arange(logits.size(1), device=logits.device) == target.unsqueeze(1)
    logits.copy_((logits32 - top_logit).exp() / sum_exp - is_target.float())
    return losses


@functools.cache
def _compiled(chunk_fn):
    return torch.compile(chunk_fn, fullgraph=True)


def _chunk_losses(path: ChunkPath, logits: torch.Tensor, target: torch.Tensor, with_grad: bool) -> torch.Tensor:
    """Per-token losses of one chunk, its logits overwritten by their gradient when `with_grad`."""
    if path == "eager":
        return _eager_chunk_losses(logits, target, with_grad)
    chunk_fn = _fusable_chunk_losses_and_grad if with_grad else _fusable_chunk_losses
    if torch.compiler.is_compiling():  # traced into the caller's graph, which fuses it
        return chunk_fn(logits, target)
    # One graph for every chunk length: the last chunk is shorter, and the token count varies.
    torch._dynamo.maybe_mark_dynamic(logits, 0)
    torch._dynamo.maybe_mark_dynamic(target, 0)
    return _compiled(chunk_fn)(logits, target)


@functools.cache
def _addmm_sums_16bit_into_fp32(device: torch.device) -> bool:
    """Whether this torch's addmm on `device` sums a product of bf16 matrices into an fp32 tensor in place
    (`out_dtype`, CUDA only, torch >= 2.8; some versions want the added tensor in the operands' dtype).
    Checked once by running it."""
    if device.type != "cuda":
        return False
    total = torch.ones(2, 2, device=device)
    ones = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
    try:
        torch.addmm(total, ones, ones, out_dtype=torch.float32, out=total)
    except (RuntimeError, TypeError):
        return False
    return bool((total == 3).all())


def _accumulate_weight_grad(grad_weight: torch.Tensor, grad_logits: torch.Tensor, rows: torch.Tensor) -> None:
    """grad_weight (fp32) += grad_logitsᵀ @ rows, the operands in the weight's dtype: in the matmul's
    epilogue where the BLAS can (same dtypes; 16-bit operands into fp32 on CUDA), else through a
    [V × h] product in the operands' dtype, one more pass over the fp32 sum per chunk."""
    if grad_logits.dtype == grad_weight.dtype:
        grad_weight.addmm_(grad_logits.t(), rows)
    elif not torch.compiler.is_compiling() and _addmm_sums_16bit_into_fp32(grad_weight.device):
        torch.addmm(grad_weight, grad_logits.t(), rows, out_dtype=torch.float32, out=grad_weight)
    else:
        grad_weight += grad_logits.t() @ rows


class _LinearCrossEntropy(torch.autograd.Function):
    """`masked_mean` of the cross entropy of `hidden @ weight.T`, chunk by chunk over the tokens; the
    gradients are computed in forward and only scaled by the loss's gradient in backward.

    The gradient w.r.t. the logits is softmax − one-hot, written over the chunk's logits; the tokens'
    weights (mask / masked count) scale the [chunk × h] operands, not [chunk × V]."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, loss_mask, path: ChunkPath, hidden_needs_grad: bool,
                weight_needs_grad: bool):
        tokens, vocab = hidden.size(0), weight.size(0)
        with_grad = hidden_needs_grad or weight_needs_grad
        chunk = chunk_tokens(vocab, 4 if path == "eager" else weight.element_size())
        mask = loss_mask.float()
        scale = 1.0 / mask.sum().clamp(min=1.0)  # d loss / d (each unmasked token's loss)
        losses = torch.empty(tokens, dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if hidden_needs_grad else None
        # Summed over chunks in fp32 whatever the weight's dtype, rounded to it once at the end.
        grad_weight = (torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
                       if weight_needs_grad else None)
        for start in range(0, tokens, chunk):
            rows = slice(start, start + chunk)
            logits = hidden[rows] @ weight.t()
            losses[rows] = _chunk_losses(path, logits, labels[rows], with_grad)
            if not with_grad:
                continue
            grad_logits = logits  # overwritten in place by `_chunk_losses`
            row_weights = mask[rows].unsqueeze(1)
            if grad_hidden is not None:
                grad_hidden[rows] = (grad_logits @ weight) * (row_weights * scale)
            if grad_weight is not None:
                _accumulate_weight_grad(grad_weight, grad_logits, (hidden[rows] * row_weights).to(weight.dtype))
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(scale).to(weight.dtype)
        ctx.save_for_backward(grad_hidden, grad_weight)
        return masked_mean(losses, mask)

    @staticmethod
    def backward(ctx, grad_loss):
        grads = tuple(None if g is None else g * grad_loss for g in ctx.saved_tensors)
        return *grads, None, None, None, None, None


def default_chunk_path(device: torch.device) -> ChunkPath:
    """The chunk path `linear_cross_entropy` takes on `device`: compiled where inductor generates Triton
    kernels (CUDA), eager elsewhere (see the module docstring)."""
    return "compiled" if device.type == "cuda" and _HAS_TRITON else "eager"


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         loss_mask: torch.Tensor, chunk_path: ChunkPath | None = None) -> torch.Tensor:
    """`lm_loss` of the logits `hidden @ weight.T` at TP 1, never holding more than one chunk of them.

    hidden [s, b, h] (the final norm's output), weight [V, h] (the output layer's, or the tied
    embedding's), labels and loss_mask [b, s]. A weight (or hidden state) that needs no gradient
    gets none computed; under no_grad neither is. `chunk_path`: "eager" or "compiled" (the module
    docstring); None picks `default_chunk_path` of the hidden states' device.
    """
    grad_on = torch.is_grad_enabled()
    return _LinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.size(-1)), weight, labels.t().reshape(-1), loss_mask.t().reshape(-1),
        chunk_path or default_chunk_path(hidden.device), grad_on and hidden.requires_grad,
        grad_on and weight.requires_grad)
