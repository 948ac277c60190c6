"""The fused output projection + cross entropy (TP 1) against megatron's cross entropy on the full
logits: same loss and gradients, without a [tokens × vocab] tensor kept for backward."""

from __future__ import annotations

import pytest
import torch
from model_fixtures import BATCH, SEQ, build

from ora_megatron import cross_entropy
from ora_megatron.cross_entropy import linear_cross_entropy, lm_loss
from ora_megatron.stages import output_weight

VOCAB, HIDDEN = 32000, 32
CHUNK_TOKENS = 24  # several chunks, the last one partial (64 tokens: 24 + 24 + 16; 32: 24 + 8)


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(cross_entropy, "LOGITS_CHUNK_BYTES", 4 * VOCAB * CHUNK_TOKENS)


def _inputs(batch: int = 4, seq: int = 16, seed: int = 0):
    """hidden [s, b, h], weight [V, h], labels and a loss mask with masked positions, [b, s]."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(seq, batch, HIDDEN, generator=generator, requires_grad=True)
    weight = torch.randn(VOCAB, HIDDEN, generator=generator).mul_(0.2).requires_grad_()
    labels = torch.randint(0, VOCAB, (batch, seq), generator=generator)
    mask = (torch.rand(batch, seq, generator=generator) > 0.3).float()
    return hidden, weight, labels, mask


def _reference(hidden, weight, labels, mask):
    return lm_loss((hidden @ weight.t()).transpose(0, 1), (labels, mask))


def _saved_bytes(fn, *args) -> int:
    """Bytes of the distinct storages autograd keeps for backward, the inputs' own left out."""
    inputs = {t.untyped_storage().data_ptr() for t in args}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in inputs:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(saved.values())


@pytest.mark.slow  # a vocabulary of 32k, in fp32 on CPU
def test_fused_loss_and_gradients_are_the_full_logits_ones(one_process_group):
    hidden, weight, labels, mask = _inputs()
    grads = []
    for loss_fn in (_reference, linear_cross_entropy):
        loss = loss_fn(hidden, weight, labels, mask)
        (2.5 * loss).backward()  # backward scales by the incoming gradient
        grads.append((loss.detach(), hidden.grad, weight.grad))
        hidden.grad = weight.grad = None
    (ref_loss, ref_hidden, ref_weight), (loss, grad_hidden, grad_weight) = grads
    assert 0 < mask.sum() < mask.numel()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad_hidden, ref_hidden, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad_weight, ref_weight, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("family", ["gpt2", "llama"])  # tied and untied output head
def test_model_loss_with_labels_is_lm_loss_of_its_logits(one_process_group, family):
    model = build("ora_qr", family, vocab_size=VOCAB, make_vocab_size_divisible_by=128)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    labels, mask = tokens.roll(-1, dims=1), torch.ones(BATCH, SEQ).index_fill_(1, torch.tensor([0, 5]), 0.0)
    logits = model(tokens)
    assert logits.transpose(0, 1).is_contiguous(), "the logits are a view of the head's [s, b, V] product"
    results = []
    for loss in (lm_loss(logits, (labels, mask)), model(tokens, (labels, mask))):
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
        model.zero_grad(set_to_none=True)
    (ref_loss, ref_grads), (loss, grads) = results
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    assert grads.keys() == ref_grads.keys()
    head = output_weight(getattr(model, model.order[-1][0]))
    assert next(n for n, p in model.named_parameters() if p is head) in grads
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_fused_loss_keeps_no_tokens_by_vocab_tensor_for_backward(one_process_group):
    hidden, weight, labels, mask = _inputs()
    logits_bytes = 4 * hidden.shape[0] * hidden.shape[1] * VOCAB
    assert _saved_bytes(_reference, hidden, weight, labels, mask) >= logits_bytes
    assert _saved_bytes(linear_cross_entropy, hidden, weight, labels, mask) < logits_bytes


def test_frozen_weight_gets_no_gradient(one_process_group):
    hidden, weight, labels, mask = _inputs()
    weight.requires_grad_(False)
    linear_cross_entropy(hidden, weight, labels, mask).backward()
    assert weight.grad is None
    expected = torch.autograd.grad(_reference(hidden, weight, labels, mask), hidden)[0]
    torch.testing.assert_close(hidden.grad, expected, rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        assert not linear_cross_entropy(hidden, weight, labels, mask).requires_grad
