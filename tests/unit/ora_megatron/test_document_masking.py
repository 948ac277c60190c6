"""Document masking (data.reset_attention_mask, data.reset_position_ids): with megatron-core's mask and
positions, a token sees only its own document in a packed sample."""

from __future__ import annotations

import pytest
import torch
from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids
from model_fixtures import SEQ, build

from ora_megatron.parallel import destroy_distributed, init_distributed

EOD = 99
CASES = [("gpt2", "vanilla"), ("gpt2", "ora_qr"), ("llama", "vanilla"), ("llama", "ora_hadamard"),
         ("gpt2", "synthesizer_random"), ("gpt2", "fixed_random_attention")]


@pytest.fixture(scope="module", autouse=True)
def one_process_group():
    init_distributed(1, 1, backend="gloo")
    yield
    destroy_distributed()


def packed(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    return torch.cat([first, torch.tensor([EOD]), second])


def documents(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """megatron-core's attention mask [1, 1, s, s] (True: masked) and positions [1, s], as its GPTDataset
    makes them with reset_attention_mask and reset_position_ids."""
    mask, _, positions = _get_ltor_masks_and_position_ids(tokens, EOD, True, True, False, True)
    return mask[None], positions[None]


@pytest.mark.parametrize("family, variant", CASES, ids=[f"{f}-{v}" for f, v in CASES])
def test_another_document_of_the_sample_changes_nothing(family, variant):
    """Changing the first document leaves the second's logits bitwise as they were; with Q·K attention
    (positions restarting at its start) they are the second document's logits alone, within 1e-5. The
    synthesizers' R is indexed by position in the sample, so theirs are not."""
    model = build(variant, family).eval()
    g = torch.Generator().manual_seed(0)
    first, other, second = (torch.randint(0, EOD, (n,), generator=g) for n in (5, 5, SEQ - 6))
    with torch.no_grad():
        logits, changed = (model(t[None], attention_mask=documents(t)[0], position_ids=documents(t)[1])
                           for t in (packed(first, second), packed(other, second)))
        alone = model(second[None])
    assert torch.equal(logits[0, 6:], changed[0, 6:])
    model.activation_checkpointing = True  # the recomputing path takes the mask and positions too
    with torch.no_grad():
        recomputed = model(packed(first, second)[None], attention_mask=documents(packed(first, second))[0],
                           position_ids=documents(packed(first, second))[1])
    assert torch.equal(recomputed, logits)
    assert not torch.allclose(logits[0, :6], changed[0, :6])
    if variant.startswith(("vanilla", "ora")):
        assert (logits[0, 6:] - alone[0]).abs().max() <= 1e-5


def test_without_documents_the_model_is_causal_as_before():
    """No mask, no positions: the model computes what it computed before document masking existed (the
    causal kernel); a mask of causal attention alone gives the same logits within 1e-5."""
    model = build("ora_qr").eval()
    tokens = torch.randint(0, EOD, (2, SEQ), generator=torch.Generator().manual_seed(3))
    causal = ~torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    with torch.no_grad():
        plain = model(tokens)
        masked = model(tokens, attention_mask=causal.expand(2, 1, SEQ, SEQ),
                       position_ids=torch.arange(SEQ).expand(2, SEQ))
    assert (plain - masked).abs().max() <= 1e-5
