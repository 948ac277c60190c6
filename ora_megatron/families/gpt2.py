"""GPT-2 style: learned absolute positions, LayerNorm, GELU MLP, biases, tied embeddings
(the model of the research plan in docs/research.md)."""

import torch.nn.functional as F

from ora_megatron.families.family import Family

FAMILY = Family(name="gpt2", normalization="LayerNorm", activation=F.gelu, gated_mlp=False, bias=True,
                position_embedding="learned_absolute", tied_output=True)
