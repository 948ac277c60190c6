"""The language-model loss: mean next-token cross entropy over the unmasked positions.

Two ways to it, the same definition (`masked_mean` of megatron-core's per-token cross entropy):

- `lm_loss(logits, (labels, loss_mask))` on vocab-parallel logits: megatron-core's
  `vocab_parallel_cross_entropy` (at TP 1 `_OneRankCrossEntropy`, the same steps without the
  collectives). It keeps the fp32 softmax of every token ([tokens × V/tp]) for backward. The
  pipeline uses it (its last stage sees the logits, not the labels), and so does the plain model at
  TP > 1.
- `linear_cross_entropy(hidden, weight, labels, loss_mask)` (the plain model at TP 1) fuses the output
  projection with the loss, as Liger-Kernel's fused linear cross entropy does: tokens are taken
  `LOGITS_CHUNK_BYTES` of fp32 logits at a time, and each chunk's gradients w.r.t. the hidden states and
  the weight are computed in the forward, so backward keeps [tokens × h] + [V × h], never a
  [tokens × V] tensor. The matmuls run in the weight's dtype, the softmax in fp32.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy, vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.utils import VocabUtility

# fp32 logits of one chunk of tokens in the fused loss (some 2,000 tokens at a vocabulary of 32k): each chunk costs
# a dozen kernel launches and one fp32 sum of the [V × h] weight gradient, so chunks are as large as
# a small share of a GPU's memory allows.
LOGITS_CHUNK_BYTES = 256 * 2**20


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


class _LinearCrossEntropy(torch.autograd.Function):
    """`masked_mean` of the cross entropy of `hidden @ weight.T`, chunk by chunk over the tokens; the
    gradients are computed in forward and only scaled by the loss's gradient in backward.

    A chunk's logits take six passes over [chunk × V]: their fp32 copy, then max, subtract,
    exponential and sum in place, the softmax written once in the weight's dtype; and the two matmuls
    of the gradients. The gradient w.r.t. the logits is softmax − one-hot; the tokens' weights
    (mask / masked count) scale the [chunk × h] operands, not [chunk × V]. megatron-core's steps make
    some ten passes over fp32 logits: on an H100 they took half of Small's kernel time
    (docs/results/gpu/)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, loss_mask, hidden_needs_grad: bool, weight_needs_grad: bool):
        tokens, vocab = hidden.size(0), weight.size(0)
        chunk = max(1, LOGITS_CHUNK_BYTES // (4 * vocab))
        mask = loss_mask.float()
        scale = 1.0 / mask.sum().clamp(min=1.0)  # d loss / d (each unmasked token's loss)
        losses = torch.empty(tokens, dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if hidden_needs_grad else None
        # Summed over chunks in fp32 whatever the weight's dtype, rounded to it once at the end.
        grad_weight = (torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
                       if weight_needs_grad else None)
        for start in range(0, tokens, chunk):
            rows = slice(start, start + chunk)
            target = labels[rows].unsqueeze(1)
            logits = (hidden[rows] @ weight.t()).float()
            top_logit = logits.amax(dim=-1, keepdim=True)
            target_logit = logits.gather(1, target)
            exp_logits = logits.sub_(top_logit).exp_()  # in place: one fp32 copy of the chunk
            sum_exp = exp_logits.sum(dim=-1, keepdim=True)
            losses[rows] = (sum_exp.log() - (target_logit - top_logit)).squeeze(1)
            if grad_hidden is None and grad_weight is None:
                continue
            # The softmax, written once in the weight's dtype (in place for fp32 weights).
            same_dtype = weight.dtype == exp_logits.dtype
            softmax = exp_logits if same_dtype else torch.empty_like(exp_logits, dtype=weight.dtype)
            grad_logits = torch.div(exp_logits, sum_exp, out=softmax)
            del logits, exp_logits
            grad_logits[torch.arange(grad_logits.size(0), device=target.device), target.squeeze(1)] -= 1.0
            row_weights = mask[rows].unsqueeze(1)
            if grad_hidden is not None:
                grad_hidden[rows] = (grad_logits @ weight) * (row_weights * scale)
            if grad_weight is not None:
                grad_weight += grad_logits.t() @ (hidden[rows] * row_weights).to(weight.dtype)
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(scale).to(weight.dtype)
        ctx.save_for_backward(grad_hidden, grad_weight)
        return masked_mean(losses, mask)

    @staticmethod
    def backward(ctx, grad_loss):
        grads = tuple(None if g is None else g * grad_loss for g in ctx.saved_tensors)
        return *grads, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         loss_mask: torch.Tensor) -> torch.Tensor:
    """`lm_loss` of the logits `hidden @ weight.T` at TP 1, never holding more than one chunk of them.

    hidden [s, b, h] (the final norm's output), weight [V, h] (the output layer's, or the tied
    embedding's), labels and loss_mask [b, s]. A weight (or hidden state) that needs no gradient
    gets none computed; under no_grad neither is.
    """
    grad_on = torch.is_grad_enabled()
    return _LinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.size(-1)), weight, labels.t().reshape(-1), loss_mask.t().reshape(-1),
        grad_on and hidden.requires_grad, grad_on and weight.requires_grad)
