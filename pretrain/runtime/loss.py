"""The language-model loss: next-token cross entropy of a micro-batch (the pipeline's `loss_fn` and
the plain engine's `batch_loss`), and its mean over the data-parallel ranks."""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy, vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.utils import VocabUtility


class _OneRankCrossEntropy(torch.autograd.Function):
    """megatron-core's vocab-parallel cross entropy (`_VocabParallelCrossEntropy`, no label smoothing)
    for a tensor-parallel group of one rank: the same `VocabParallelCrossEntropy` steps, without its
    three all-reduces (a max and two sums over one rank leave every value as it is). On CPU each of
    them is a round trip through gloo's worker thread, which waits for a core behind the OpenMP
    threads' spin-wait (~0.2 ms each on two cores)."""

    @staticmethod
    def forward(ctx, vocab_logits, target):
        vocab_logits, logits_max = VocabParallelCrossEntropy.calculate_logits_max(vocab_logits)
        start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(vocab_logits.size(-1), 0, 1)
        target_mask, masked_target_1d, predicted_logits, sum_exp_logits, exp_logits = (
            VocabParallelCrossEntropy.calculate_predicted_logits(vocab_logits, target, logits_max, start, end))
        softmax, loss = VocabParallelCrossEntropy.calculate_cross_entropy_loss(
            exp_logits, predicted_logits, sum_exp_logits)
        ctx.save_for_backward(softmax, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        grad_2d, arange_1d, softmax_update, grad_input = (
            VocabParallelCrossEntropy.prepare_gradient_calculation_operands(softmax, target_mask))
        return VocabParallelCrossEntropy.calculate_gradients(
            grad_2d, arange_1d, masked_target_1d, softmax_update, grad_input, grad_output), None


def lm_loss(logits: torch.Tensor, labels_and_mask) -> torch.Tensor:
    """Mean next-token cross entropy over unmasked positions; logits are vocab-parallel [b, s, V/tp]."""
    labels, loss_mask = labels_and_mask
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        losses = _OneRankCrossEntropy.apply(logits.float(), labels)
    else:
        losses = vocab_parallel_cross_entropy(logits.float(), labels)
    mask = loss_mask.float()
    return (losses * mask).sum() / mask.sum().clamp(min=1.0)


def batch_loss(engine, batch: dict) -> torch.Tensor:
    """Loss of one micro-batch through a plain (not pipelined) engine."""
    # DeepSpeed's plain engine does not move inputs (its pipeline engine does); batches are host tensors.
    tokens, labels, loss_mask = (batch[k].to(engine.device, non_blocking=True)
                                 for k in ("tokens", "labels", "loss_mask"))
    return lm_loss(engine(tokens), (labels, loss_mask))


def data_parallel_mean(value: torch.Tensor) -> float:
    """Mean of a per-rank scalar over the data-parallel group (every rank gets it)."""
    size = parallel_state.get_data_parallel_world_size()
    if size > 1:  # over one rank the sum is the value itself: no collective
        torch.distributed.all_reduce(value, group=parallel_state.get_data_parallel_group())
    return value.item() / size
