"""`speed.compile` makes one graph per layer, without a break, for every attention variant and family, so
that a layer's norms, activation and bias-dropout-adds can fuse; and the compiled layers and loss train
the model the eager ones train.

Graph breaks are decided by dynamo, whatever the backend: most cases count them with a backend that runs
the captured graphs as they are; one trains through inductor."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from model_fixtures import SEQ, build, tokens
from torch._dynamo.utils import counters

from pretrain.runtime.engine import compile_model

pytestmark = pytest.mark.usefixtures("one_process_group")  # conftest.py: one gloo rank

STEPS = 4
CASES = [("gpt2", "vanilla"), ("gpt2", "ora_qr"), ("gpt2", "ora_hadamard"), ("llama", "vanilla"),
         ("llama", "ora_hadamard")]


class GraphRecorder:
    """A torch.compile backend that keeps the operators of each graph dynamo captures and runs it as is."""

    def __init__(self):
        self.graphs: list[set[str]] = []

    def __call__(self, graph_module: torch.fx.GraphModule, example_inputs):
        self.graphs.append({str(node.target) for node in graph_module.graph.nodes if node.op == "call_function"})
        return graph_module.forward


def documents(step: int) -> torch.Tensor:
    """Document ids [2, s]: two documents in the first sample, one in the second."""
    ids = torch.zeros(2, SEQ, dtype=torch.long)
    ids[0, 5 + step:] = 1
    return ids


def train_losses(model: torch.nn.Module, with_documents: bool) -> list[float]:
    """STEPS optimizer steps on one batch, then the loss of an evaluation forward (eval mode, no_grad) on
    another."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(STEPS + 1):
        batch = tokens(int(step == STEPS))
        document_ids = documents(step) if with_documents else None
        if step == STEPS:
            model.eval()
        with torch.set_grad_enabled(step < STEPS):
            loss = model(batch, (batch, torch.ones_like(batch)), document_ids=document_ids)
        if step < STEPS:
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def compiled_and_eager(family: str, variant: str, backend, with_documents: bool = False):
    torch._dynamo.reset()
    counters.clear()
    compiled = build(variant, family)
    compile_model(compiled, backend=backend)
    return train_losses(compiled, with_documents), train_losses(build(variant, family), with_documents)


@pytest.mark.slow  # dynamo traces 4 graphs a case: about a second
@pytest.mark.parametrize("family, variant", CASES, ids=[f"{f}-{v}" for f, v in CASES])
def test_each_layer_compiles_to_one_graph_without_breaks(family, variant):
    """Training and evaluation: no graph break; one graph for the layers (all share it) and one for the
    loss in each mode, the layer's whole forward in it; the losses are eager's within 1e-4."""
    recorder = GraphRecorder()
    compiled, eager = compiled_and_eager(family, variant, recorder)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    layer_graphs = [g for g in recorder.graphs if any("scaled_dot_product_attention" in op for op in g)]
    assert len(recorder.graphs) == 4 and len(layer_graphs) == 2  # train and eval: layer, loss
    norm, activation = ("layer_norm", "gelu") if family == "gpt2" else ("rms_norm", "silu")
    for graph in layer_graphs:
        assert any(norm in op for op in graph) and any(activation in op for op in graph), sorted(graph)
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=0, atol=1e-4)
    assert eager[STEPS - 1] < eager[0]


@pytest.mark.slow
def test_document_masking_compiles_without_breaks():
    """The layers take the DocumentMask (dense on CPU) as an input of their graph."""
    compiled, eager = compiled_and_eager("llama", "ora_qr", GraphRecorder(), with_documents=True)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=0, atol=1e-4)


@pytest.mark.slow  # inductor builds the layer's and the loss's kernels with the C++ compiler: tens of seconds
def test_inductor_trains_frozen_hadamard_llama_like_eager():
    """Through inductor (the traced Hadamard Q/K, RoPE, RMSNorm, SwiGLU): eager's losses within 1e-4."""
    compiled, eager = compiled_and_eager("llama", "ora_hadamard", "inductor")
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=0, atol=1e-4)
