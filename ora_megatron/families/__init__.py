"""Model families: what distinguishes a GPT-2-style model from a Llama-style one, decided once.

A family is a small typed description that the transformer config, the layer spec, the stage
list and the FLOP accounting all read, so no other module branches on the family name. Each
family lives in its own module (the Hugging Face mapping of a family belongs beside it).
"""

from __future__ import annotations

from types import ModuleType
from typing import Callable

import torch.nn.functional as F

from ora_megatron.families import gpt2, gpt2_hf, llama, llama_hf
from ora_megatron.families.family import Family
from ora_megatron.model_config import ModelConfig

FAMILIES = {family.name: family for family in (gpt2.FAMILY, llama.FAMILY)}
# Each family's Hugging Face mapping: ARCHITECTURE, check_exportable, hf_config, hf_state_dict,
# keep_frozen_snippet.
HF_MAPPINGS = {"gpt2": gpt2_hf, "llama": llama_hf}


def family_of(model: ModelConfig) -> Family:
    return FAMILIES[model.family]


def hf_mapping_of(model: ModelConfig) -> ModuleType:
    return HF_MAPPINGS[model.family]


ACTIVATION_FUNCTIONS = {"gelu": F.gelu, "gelu_tanh": gpt2.gelu_tanh, "silu": F.silu}


def activation_of(model: ModelConfig) -> Callable:
    """The MLP activation the model computes (of the gate, when gated): model.activation or the family's."""
    return ACTIVATION_FUNCTIONS[model.activation_name]


__all__ = ["FAMILIES", "HF_MAPPINGS", "Family", "activation_of", "family_of", "hf_mapping_of"]
