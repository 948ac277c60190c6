"""Document masking (data.reset_attention_mask, data.reset_position_ids): a token sees only its own document
in a packed sample, as megatron-core's dense mask defines it; on a GPU through FlexAttention's block mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids
from model_fixtures import SEQ, build

from ora_megatron.attention import (
    SDPACoreAttention,
    document_block_mask,
    flex_document_attention,
    visible_within_documents,
)
from ora_megatron.parallel import destroy_distributed, init_distributed
from pretrain.runtime.data import document_ids

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


def megatron_documents(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """megatron-core's attention mask [1, 1, s, s] (True: masked) and positions [1, s], as its GPTDataset
    makes them with reset_attention_mask and reset_position_ids."""
    mask, _, positions = _get_ltor_masks_and_position_ids(tokens, EOD, True, True, False, True)
    return mask[None], positions[None]


def ids_of(tokens: torch.Tensor) -> torch.Tensor:
    """[1, s]: the document ids a batch carries for `tokens` (pretrain.runtime.data)."""
    return document_ids({"position_ids": megatron_documents(tokens)[1][0]})[None]


def test_document_ids_give_megatrons_mask():
    """Documents read off megatron's reset positions mask exactly what megatron's own mask does: an
    end-of-document token closes its document, at the start, twice in a row and at the end of a sample."""
    tokens = torch.tensor([EOD, 3, 4, EOD, EOD, 5, 6, 7, EOD, 8, 9, EOD])
    ids = ids_of(tokens)
    assert ids[0].tolist() == [0, 1, 1, 1, 2, 3, 3, 3, 3, 4, 4, 4]
    assert torch.equal(~visible_within_documents(ids), megatron_documents(tokens)[0])


def attention_inputs(heads: int, groups: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, n, SEQ, 8, generator=g) for n in (heads, groups, groups)]


@pytest.mark.parametrize("heads, groups", [(4, 4), (4, 2), (2, 2)])  # (2, 2): one of two TP ranks' heads
def test_flex_attention_with_the_block_mask_is_sdpa_with_megatrons_mask(heads, groups):
    """The fused path's attention (FlexAttention, unfused on CPU: forward only there) equals SDPA with
    megatron's dense mask, GQA and a TP rank's share of the heads included."""
    g = torch.Generator().manual_seed(1)
    samples = [packed(torch.randint(0, EOD, (5,), generator=g), torch.randint(0, EOD, (SEQ - 6,), generator=g)),
               torch.randint(0, EOD, (SEQ,), generator=g)]  # a single document: causal
    mask = torch.cat([megatron_documents(t)[0] for t in samples])
    ids = torch.cat([ids_of(t) for t in samples])
    q, k, v = attention_inputs(heads, groups)
    fused = flex_document_attention(q, k, v, document_block_mask(ids), scale=0.3, enable_gqa=heads != groups)
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=~mask, scale=0.3, enable_gqa=heads != groups)
    torch.testing.assert_close(fused, dense, rtol=0, atol=1e-6)
    assert not torch.allclose(fused[0], F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3,
                                                                       enable_gqa=heads != groups)[0])


def test_flex_attention_runs_where_it_is_fused_and_has_no_dropout_to_miss():
    """FlexAttention on CUDA only (compiled there; on CPU it has no backward), and not while attention
    dropout is on (it has none): then SDPA's kernel takes the dense mask."""
    model = build("ora_qr", attention_dropout=0.1)
    attention = next(m for m in model.modules() if isinstance(m, SDPACoreAttention))
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert not attention.fuses_documents(cuda) and not attention.fuses_documents(cpu)
    model.eval()
    assert attention.fuses_documents(cuda) and not attention.fuses_documents(cpu)
    assert build("ora_qr").core_attentions[0].fuses_documents(cuda)


@pytest.mark.parametrize("family, variant", [("gpt2", "ora_qr"), ("llama", "ora_hadamard")])
def test_the_model_through_flex_attention_computes_what_the_dense_mask_does(family, variant, monkeypatch):
    """Every layer given the block mask (forced on CPU, where FlexAttention runs unfused, forward only)
    computes the logits of the dense-mask path."""
    model = build(variant, family).eval()
    tokens = packed(torch.randint(0, EOD, (6,)), torch.randint(0, EOD, (SEQ - 7,)))[None]
    with torch.no_grad():
        dense = model(tokens, document_ids=ids_of(tokens[0]))
        monkeypatch.setattr(SDPACoreAttention, "fuses_documents", lambda self, device: True)
        documents = model.document_mask(ids_of(tokens[0]))
        assert documents.block_mask is not None and documents.visible is None
        fused = model(tokens, document_ids=ids_of(tokens[0]))
    torch.testing.assert_close(fused, dense, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family, variant", CASES, ids=[f"{f}-{v}" for f, v in CASES])
def test_another_document_of_the_sample_changes_nothing(family, variant):
    """Changing the first document leaves the second's logits bitwise as they were; with Q·K attention
    (positions restarting at its start) they are the second document's logits alone, within 1e-5. The
    synthesizers' R is indexed by position in the sample, so theirs are not."""
    model = build(variant, family).eval()
    g = torch.Generator().manual_seed(0)
    first, other, second = (torch.randint(0, EOD, (n,), generator=g) for n in (5, 5, SEQ - 6))

    def documents(tokens):
        return {"document_ids": ids_of(tokens), "position_ids": megatron_documents(tokens)[1]}

    with torch.no_grad():
        logits, changed = (model(t[None], **documents(t)) for t in (packed(first, second), packed(other, second)))
        alone = model(second[None])
    assert torch.equal(logits[0, 6:], changed[0, 6:])
    model.activation_checkpointing = True  # the recomputing path takes the documents and positions too
    with torch.no_grad():
        recomputed = model(packed(first, second)[None], **documents(packed(first, second)))
    assert torch.equal(recomputed, logits)
    assert not torch.allclose(logits[0, :6], changed[0, :6])
    if variant.startswith(("vanilla", "ora")):
        assert (logits[0, 6:] - alone[0]).abs().max() <= 1e-5


def test_without_documents_the_model_is_causal_as_before():
    """No documents, no positions: the model computes what it computed before document masking existed
    (the causal kernel); one document a sample gives the same logits within 1e-5."""
    model = build("ora_qr").eval()
    tokens = torch.randint(0, EOD, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        plain = model(tokens)
        masked = model(tokens, document_ids=torch.zeros(2, SEQ, dtype=torch.long),
                       position_ids=torch.arange(SEQ).expand(2, SEQ))
    assert (plain - masked).abs().max() <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 2e-5), (torch.bfloat16, 5e-2)])
def test_compiled_flex_attention_on_cuda_is_sdpa_with_the_dense_mask(dtype, tolerance):
    """On a GPU the fused path (compiled FlexAttention) gives the dense-mask SDPA's outputs and gradients."""
    g = torch.Generator().manual_seed(2)
    ids = torch.sort(torch.randint(0, 5, (3, 512), generator=g), dim=1).values.cuda()
    inputs = [torch.randn(3, n, 512, 64, generator=g).cuda().to(dtype).requires_grad_() for n in (8, 2, 2)]
    out = {}
    for path in ("fused", "dense"):
        q, k, v = (t.detach().clone().requires_grad_() for t in inputs)
        if path == "fused":
            y = flex_document_attention(q, k, v, document_block_mask(ids), scale=None, enable_gqa=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=visible_within_documents(ids),
                                               enable_gqa=True)
        y.float().square().sum().backward()
        out[path] = [y, q.grad, k.grad, v.grad]
    for fused, dense in zip(out["fused"], out["dense"]):
        torch.testing.assert_close(fused.float(), dense.float(), rtol=tolerance, atol=tolerance)
