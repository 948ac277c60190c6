"""Model families: what distinguishes a GPT-2-style model from a Llama-style one, decided once.

A family is a small typed description that the transformer config, the layer spec, the stage
list and the FLOP accounting all read, so no other module branches on the family name. Each
family lives in its own module (the Hugging Face mapping of a family belongs beside it).
"""

from __future__ import annotations

from ora_megatron.families import gpt2, llama
from ora_megatron.families.family import Family
from ora_megatron.model_config import ModelConfig

FAMILIES = {family.name: family for family in (gpt2.FAMILY, llama.FAMILY)}


def family_of(model: ModelConfig) -> Family:
    return FAMILIES[model.family]


__all__ = ["FAMILIES", "Family", "family_of"]
