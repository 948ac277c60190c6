"""Every attention variant gives the same logits and gradients with tensor-parallel size 1 and 2, with
document masking too."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import run_on_ranks
from megatron.core import parallel_state
from model_fixtures import all_cases, build, tokens

pytestmark = pytest.mark.distributed
# Document masking under tensor parallelism: every rank takes the same documents for its share of the heads.
DOCUMENT_CASES = [("gpt2", "vanilla"), ("llama", "ora_hadamard"), ("gpt2", "synthesizer_factorized")]
CASES = [(*case, None) for case in all_cases()] + [(*case, "documents") for case in DOCUMENT_CASES]


def two_documents() -> torch.Tensor:
    ids = torch.zeros_like(tokens())
    ids[0, 6:] = 1
    return ids


def _gather(shard: torch.Tensor, dim: int) -> torch.Tensor:
    """Concatenate a vocab-sharded tensor across the tensor-parallel group (no autograd)."""
    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, shard.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def forward_backward_all_variants(rank: int, tensor: int) -> dict:
    """Logits and the word-embedding gradient (which sees the whole backward pass) per variant."""
    results = {}
    for family, variant, documents in CASES:
        model = build(variant, family, tensor=tensor)
        logits = model(tokens(), document_ids=two_documents() if documents else None)  # [b, s, V/tp]
        # The loss is a fixed random projection of the full logits; each rank backpropagates its
        # vocab slice, and megatron's TP backward all-reduces the hidden-state gradient.
        vocab_shard = logits.size(-1)
        weights = torch.randn(*logits.shape[:-1], vocab_shard * tensor,
                              generator=torch.Generator().manual_seed(1))
        weights = weights[..., rank % tensor * vocab_shard:(rank % tensor + 1) * vocab_shard]
        ((logits * weights).sum() / logits[..., 0].numel()).backward()  # per-token mean
        grad = _gather(model.embedding.word_embeddings.weight.grad, dim=0)
        results[(family, variant, documents)] = (_gather(logits.detach(), dim=-1), grad)
    return results


@pytest.fixture(scope="module")
def tp1_and_tp2():
    tp1 = run_on_ranks(forward_backward_all_variants, 1, 1, tensor=1)[0]
    tp2 = run_on_ranks(forward_backward_all_variants, 2, 2, tensor=2)
    return tp1, tp2


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(filter(None, c)))
def test_tensor_parallel_2_matches_1(tp1_and_tp2, case):
    tp1, tp2 = tp1_and_tp2
    logits1, grad1 = tp1[case]
    for rank_result in tp2:
        logits2, grad2 = rank_result[case]
        assert logits1.shape == logits2.shape
        assert (logits1 - logits2).abs().max() <= 1e-5
        assert (grad1 - grad2).abs().max() <= 1e-5
    assert grad1.abs().sum() > 0
