"""The GPT model as an ordered list of named stages built from megatron-core parts.

embedding → layer1 … layerL (TransformerLayers) → final_norm → output. This is the one model
definition: it is assembled either as a plain module (`StagedGPT`, pipeline size 1, any ZeRO
stage) or by the trainer as a DeepSpeed PipelineModule (pipeline size > 1). Both expose the same
parameter names, `{stage name}.{parameter}` (e.g. `layer3.layer.mlp.linear_fc1.weight`), which
checkpoints consolidate to and export maps from. A stage tied to an earlier one (the gpt2 output
head reusing the embedding) owns no names of its own.

The output head returns vocab-parallel logits [b, s, V/tp] as a view of its [s, b, V/tp] product.
Given labels, the plain module returns the loss instead (at TP 1 fused with the output projection,
ora_megatron.cross_entropy); the pipeline's last stage returns logits, since labels reach only its
`loss_fn` (`lm_loss`).

Each stage seeds the torch RNG from (seed, stage name) before drawing its weights, so every
assembly and every pipeline split holds the same model; the master-weight-then-slice init of
megatron's CPU path makes it the same for every TP size too.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.utils.checkpoint
from megatron.core import parallel_state
from megatron.core import utils as megatron_utils
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer.spec_utils import build_module

from ora_megatron.attention import DocumentMask, SDPACoreAttention, document_block_mask, visible_within_documents
from ora_megatron.builder import HostRotaryEmbedding, layer_spec, padded_vocab_size, transformer_config
from ora_megatron.cross_entropy import linear_cross_entropy, lm_loss
from ora_megatron.families import family_of
from ora_megatron.linear import ColumnLinear
from ora_megatron.model_config import ModelConfig, ParallelConfig


@torch.compiler.substitute_in_graph(megatron_utils.make_viewless_tensor)
def _traceable_make_viewless_tensor(inp, requires_grad, keep_graph):
    """megatron-core's `make_viewless_tensor` as a compiled layer (speed.compile) traces it.

    TransformerLayer passes its output through it so that the output is no view (megatron's own
    checkpointing and pipeline free activations through `.data`). The original moves `.data` into a
    new tensor, which dynamo cannot trace: the graph broke at the end of every layer whose output
    is a view (a biased layer's in-place bias-dropout-add under no_grad). A copy holds the same
    values without a `_base`, on the same autograd graph. Only a new leaf (keep_graph False with
    requires_grad) has no traceable form, and breaks as the original does. Eager runs the original.
    """
    if inp._base is None:
        return inp
    if keep_graph:
        return inp.clone()
    return inp.detach().clone().requires_grad_(requires_grad)


def seed_stage(seed: int, name: str) -> None:
    digest = hashlib.sha256(f"{seed}/stage/{name}".encode()).digest()
    torch.manual_seed(int.from_bytes(digest[:8], "big") >> 1)


class EmbeddingStage(torch.nn.Module):
    """Token (+ learned position) embedding: tokens [b, s] → hidden [s, b, h]."""

    def __init__(self, model: ModelConfig, parallel: ParallelConfig):
        super().__init__()
        seed_stage(model.seed, "embedding")
        self.embedding = LanguageModelEmbedding(
            config=transformer_config(model, parallel), vocab_size=padded_vocab_size(model),
            max_sequence_length=model.seq_length,
            position_embedding_type=family_of(model).position_embedding)

    def forward(self, tokens: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`position_ids` [b, s]: each token's position (restarting per document); default 0..s-1."""
        if position_ids is None:
            position_ids = torch.arange(tokens.size(1), device=tokens.device).unsqueeze(0).expand_as(tokens)
        return self.embedding(tokens, position_ids)

    @property
    def word_embeddings(self) -> torch.nn.Module:
        return self.embedding.word_embeddings


class DecoderLayerStage(torch.nn.Module):
    """One megatron-core TransformerLayer with the configured attention variant."""

    def __init__(self, model: ModelConfig, parallel: ParallelConfig, layer_number: int):
        super().__init__()
        seed_stage(model.seed, f"layer{layer_number}")
        config = transformer_config(model, parallel)
        # Global layer number: frozen Q/K are drawn for it, whichever pipeline stage holds it.
        self.layer = build_module(layer_spec(model), config=config, layer_number=layer_number)
        self.rotary = None
        if family_of(model).position_embedding == "rope":
            self.rotary = HostRotaryEmbedding(kv_channels=model.head_dim, rotary_percent=1.0,
                                              rotary_base=model.rotary_base, use_cpu_initialization=True)

    def forward(self, hidden: torch.Tensor, documents: Optional[DocumentMask] = None,
                position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`documents`: each token attends within its own document (megatron's attention_mask argument
        carries it to the core attention); `position_ids` [b, s] rotate RoPE by each token's own
        position. None: causal, 0..s-1."""
        rotary = self.rotary(hidden.size(0)) if self.rotary is not None else None
        if rotary is not None and position_ids is not None:  # [s, 1, 1, d] by position → [s, b, 1, d]
            rotary = rotary[:, 0, 0][position_ids].transpose(0, 1).unsqueeze(2)
        return self.layer(hidden, attention_mask=documents, rotary_pos_emb=rotary)[0]


class FinalNormStage(torch.nn.Module):
    def __init__(self, model: ModelConfig, parallel: ParallelConfig):
        super().__init__()
        config = transformer_config(model, parallel)
        norm = layer_spec(model).submodules.input_layernorm
        self.norm = build_module(norm, config=config, hidden_size=model.hidden_size,
                                 eps=model.layernorm_epsilon)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden)


class OutputStage(torch.nn.Module):
    """Untied output projection: hidden [s, b, h] → vocab-parallel logits [b, s, V/tp] (a view of
    the projection's [s, b, V/tp] result: no copy)."""

    def __init__(self, model: ModelConfig, parallel: ParallelConfig):
        super().__init__()
        seed_stage(model.seed, "output")
        config = transformer_config(model, parallel)
        self.output_layer = ColumnLinear(
            model.hidden_size, padded_vocab_size(model), config=config, init_method=config.init_method,
            bias=False, skip_bias_add=False, gather_output=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.output_layer(hidden)[0].transpose(0, 1)


def tied_logits(embedding: EmbeddingStage, hidden: torch.Tensor) -> torch.Tensor:
    """Output head that reuses the input embedding (tied families): logits [b, s, V/tp], a view as
    OutputStage's are."""
    hidden = copy_to_tensor_model_parallel_region(hidden)  # identity forward, TP all-reduce backward
    return torch.matmul(hidden, embedding.word_embeddings.weight.t()).transpose(0, 1)


def output_weight(head: torch.nn.Module) -> torch.nn.Parameter:
    """The output projection's weight [V/tp, h]: the untied output layer's, or the tied embedding's."""
    if isinstance(head, EmbeddingStage):
        return head.word_embeddings.weight
    return head.output_layer.weight


@dataclass
class StageSpec:
    """How to build one stage; `tied_key` marks a stage sharing its module with another."""

    name: str
    cls: type
    kwargs: dict = field(default_factory=dict)
    tied_key: Optional[str] = None
    forward_fn: Optional[Callable] = None


def stage_specs(model: ModelConfig, parallel: ParallelConfig) -> list[StageSpec]:
    common = {"model": model, "parallel": parallel}
    tied = family_of(model).tied_output
    specs = [StageSpec("embedding", EmbeddingStage, common, tied_key="embedding" if tied else None)]
    specs += [StageSpec(f"layer{i}", DecoderLayerStage, {**common, "layer_number": i})
              for i in range(1, model.num_layers + 1)]
    specs.append(StageSpec("final_norm", FinalNormStage, common))
    if tied:
        specs.append(StageSpec("output", EmbeddingStage, common, tied_key="embedding", forward_fn=tied_logits))
    else:
        specs.append(StageSpec("output", OutputStage, common))
    return specs


def owner_names(specs: list[StageSpec]) -> dict[str, str]:
    """Tied key → name of the first stage holding it (the one whose names the module carries)."""
    owners: dict[str, str] = {}
    for spec in specs:
        if spec.tied_key is not None:
            owners.setdefault(spec.tied_key, spec.name)
    return owners


class StagedGPT(torch.nn.Module):
    """All stages in one module (pipeline size 1): tokens [b, s] → logits [b, s, V/tp], or with
    `labels_and_mask` ([b, s] each) the mean masked next-token loss.

    The loss never materialises the logits at TP 1: `linear_cross_entropy` takes the final norm's
    output and the output weight (read here, inside the forward, so ZeRO-3 gathers it as it does
    for the logits) chunk by chunk. At TP > 1 it is `lm_loss` of the logits. Each stage is a
    submodule under its stage name, so parameter names are `{stage}.{param}`.
    """

    def __init__(self, specs: list[StageSpec]):
        super().__init__()
        self.order: list[tuple[str, Optional[Callable]]] = []  # (module name, forward_fn) per stage
        owners = owner_names(specs)
        for spec in specs:
            owner = owners.get(spec.tied_key, spec.name)
            if owner == spec.name:
                self.add_module(spec.name, spec.cls(**spec.kwargs))
            self.order.append((owner, spec.forward_fn))
        self.activation_checkpointing = False
        self.fused_loss = linear_cross_entropy  # or its torch.compile'd self (speed.compile)
        self.core_attentions = [m for m in self.modules() if isinstance(m, SDPACoreAttention)]

    def document_mask(self, document_ids: torch.Tensor) -> DocumentMask:
        """The layers' DocumentMask, each form built once for all of them: FlexAttention's block mask where
        their attention runs fused, the dense mask where one does not (or the layers mix no Q·K)."""
        fused = [attention.fuses_documents(document_ids.device) for attention in self.core_attentions]
        return DocumentMask(visible=None if fused and all(fused) else visible_within_documents(document_ids),
                            block_mask=document_block_mask(document_ids) if any(fused) else None)

    def forward(self, tokens: torch.Tensor, labels_and_mask=None, position_ids: Optional[torch.Tensor] = None,
                document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`position_ids` [b, s] and `document_ids` [b, s] (`DocumentMask`): document masking, positions as
        megatron-core's GPTDataset makes them (reset_position_ids) and attention within each document
        (reset_attention_mask); None: causal attention over positions 0..s-1."""
        documents = None if document_ids is None else self.document_mask(document_ids)
        x = tokens
        *body, (head_name, head_fn) = self.order
        for name, forward_fn in body:
            module = getattr(self, name)
            if forward_fn is not None:
                x = forward_fn(module, x)
            elif isinstance(module, EmbeddingStage):
                x = module(x, position_ids)
            elif self.activation_checkpointing and isinstance(module, DecoderLayerStage):
                x = torch.utils.checkpoint.checkpoint(module, x, documents, position_ids, use_reentrant=False)
            elif isinstance(module, DecoderLayerStage):
                x = module(x, documents, position_ids)
            else:
                x = module(x)
        head = getattr(self, head_name)
        if labels_and_mask is not None and parallel_state.get_tensor_model_parallel_world_size() == 1:
            return self.fused_loss(x, output_weight(head), *labels_and_mask)
        logits = head_fn(head, x) if head_fn is not None else head(x)
        return logits if labels_and_mask is None else lm_loss(logits, labels_and_mask)


def build_staged_gpt(model: ModelConfig, parallel: ParallelConfig) -> StagedGPT:
    return StagedGPT(stage_specs(model, parallel))
