"""The fused output projection + cross entropy (TP 1) against megatron's cross entropy on the full
logits: same loss and gradients, on both chunk paths (eager; compiled, by inductor's CPU backend
here and by Triton in the gpu-marked test), without a [tokens × vocab] tensor kept for backward."""

from __future__ import annotations

import functools

import pytest
import torch
from model_fixtures import BATCH, SEQ, build

from ora_megatron import cross_entropy
from ora_megatron.cross_entropy import chunk_tokens, default_chunk_path, linear_cross_entropy, lm_loss
from ora_megatron.stages import output_weight

VOCAB, HIDDEN = 32000, 32
CHUNK_TOKENS = 24  # fp32: several chunks, the last one partial (64 tokens: 24 + 24 + 16); bf16 compiled: 48 + 16
PATHS = ["eager", pytest.param("compiled", marks=pytest.mark.slow)]  # compiling: seconds, then cached on disk


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(cross_entropy, "LOGITS_CHUNK_BYTES", 4 * VOCAB * CHUNK_TOKENS)


def _inputs(batch: int = 4, seq: int = 16, seed: int = 0, dtype: torch.dtype = torch.float32,
            hidden_size: int = HIDDEN, device: str = "cpu"):
    """hidden [s, b, h], weight [V, h], labels and a loss mask with masked positions, [b, s]."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(seq, batch, hidden_size, generator=generator)
    weight = torch.randn(VOCAB, hidden_size, generator=generator).mul_(0.2 * (HIDDEN / hidden_size) ** 0.5)  # logits ~1
    labels = torch.randint(0, VOCAB, (batch, seq), generator=generator)
    mask = (torch.rand(batch, seq, generator=generator) > 0.3).float()
    hidden, weight = (t.to(device, dtype).requires_grad_() for t in (hidden, weight))
    return hidden, weight, labels.to(device), mask.to(device)


def _reference(hidden, weight, labels, mask):
    return lm_loss((hidden @ weight.t()).transpose(0, 1), (labels, mask))


def _loss_and_grads(loss_fn, hidden, weight, labels, mask):
    """The loss and the gradients of 2.5 × loss (backward scales by the incoming gradient)."""
    loss = loss_fn(hidden, weight, labels, mask)
    (2.5 * loss).backward()
    grads = (loss.detach(), hidden.grad, weight.grad)
    hidden.grad = weight.grad = None
    return grads


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
@pytest.mark.parametrize("path", PATHS)
def test_fused_loss_and_gradients_are_the_full_logits_ones(one_process_group, path):
    hidden, weight, labels, mask = _inputs()
    ref_loss, ref_hidden, ref_weight = _loss_and_grads(_reference, hidden, weight, labels, mask)
    loss, grad_hidden, grad_weight = _loss_and_grads(
        functools.partial(linear_cross_entropy, chunk_path=path), hidden, weight, labels, mask)
    assert 0 < mask.sum() < mask.numel()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad_hidden, ref_hidden, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad_weight, ref_weight, rtol=1e-5, atol=1e-8)


def _relative_errors(results, exact) -> list[float]:
    return [((r.double() - e).norm() / e.norm()).item() for r, e in zip(results, exact)]


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
def test_bf16_fused_loss_is_as_exact_as_megatrons(one_process_group, path):
    """bf16 rounds the gradients' operands differently in the two (megatron-core rounds the scaled logits'
    gradient, the fused loss the unscaled one and then the products), so elementwise they differ by more than
    rounding: both are compared with the same bf16 inputs' loss through float64 logits, and the fused loss
    may be off by at most 1.5 × megatron's own relative error."""
    hidden, weight, labels, mask = _inputs(dtype=torch.bfloat16)
    exact = _loss_and_grads(_reference, *(t.detach().double().requires_grad_() for t in (hidden, weight)), labels, mask)
    ref_errors = _relative_errors(_loss_and_grads(_reference, hidden, weight, labels, mask), exact)
    fused = _loss_and_grads(functools.partial(linear_cross_entropy, chunk_path=path), hidden, weight, labels, mask)
    assert fused[1].dtype == fused[2].dtype == torch.bfloat16
    errors = _relative_errors(fused, exact)
    assert max(ref_errors) < 2**-7  # the comparison is about bf16 rounding, not a broken reference
    for name, error, ref_error in zip(("loss", "grad hidden", "grad weight"), errors, ref_errors):
        assert error <= 1.5 * ref_error + 1e-7, f"{name}: {error:.2e} vs megatron's {ref_error:.2e}"


def test_chunks_are_whole_matmul_tiles_within_the_budget(monkeypatch):
    monkeypatch.setattr(cross_entropy, "LOGITS_CHUNK_BYTES", 256 * 2**20)
    assert chunk_tokens(32000, 4) == 2048  # 2,097 fit in fp32: 16 tiles of 128
    assert chunk_tokens(32000, 2) == 4096  # 4,194 in bf16
    assert chunk_tokens(2**30, 4) == 1  # a vocabulary larger than the budget: one token at a time


def test_cpu_takes_the_eager_chunks():
    """On CPU the compiled chunks measured slower (ora_megatron.cross_entropy's docstring)."""
    assert default_chunk_path(torch.device("cpu")) == "eager"


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


@pytest.mark.parametrize("path", PATHS)
def test_frozen_weight_gets_no_gradient(one_process_group, path):
    hidden, weight, labels, mask = _inputs()
    weight.requires_grad_(False)
    linear_cross_entropy(hidden, weight, labels, mask, chunk_path=path).backward()
    assert weight.grad is None
    expected = torch.autograd.grad(_reference(hidden, weight, labels, mask), hidden)[0]
    torch.testing.assert_close(hidden.grad, expected, rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, labels, mask, chunk_path=path)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, _reference(hidden, weight, labels, mask).detach(), rtol=1e-6, atol=0)


@pytest.mark.gpu
def test_default_cuda_path_is_compiled_and_as_exact_as_megatrons_in_bf16(one_process_group, monkeypatch):
    """Base's width on a GPU, the shipped chunk budget: Triton kernels from inductor, the weight gradient
    summed in fp32 (through addmm's out_dtype where this torch has it), chunks of 4,096 tokens and a
    shorter last one. Judged as the bf16 test above is; and the peak memory stays below one fp32 copy of
    the logits."""
    monkeypatch.setattr(cross_entropy, "LOGITS_CHUNK_BYTES", 256 * 2**20)
    hidden, weight, labels, mask = _inputs(batch=2, seq=5000, dtype=torch.bfloat16, hidden_size=768, device="cuda")
    assert default_chunk_path(hidden.device) == "compiled"
    exact = _loss_and_grads(_reference, *(t.detach().double().requires_grad_() for t in (hidden, weight)), labels, mask)
    ref_errors = _relative_errors(_loss_and_grads(_reference, hidden, weight, labels, mask), exact)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fused = _loss_and_grads(linear_cross_entropy, hidden, weight, labels, mask)
    assert torch.cuda.max_memory_allocated() - before < 4 * labels.numel() * VOCAB
    errors = _relative_errors(fused, exact)
    assert max(ref_errors) < 2**-7
    for name, error, ref_error in zip(("loss", "grad hidden", "grad weight"), errors, ref_errors):
        assert error <= 1.5 * ref_error + 1e-7, f"{name}: {error:.2e} vs megatron's {ref_error:.2e}"
