"""GPT-2 style: learned absolute positions, LayerNorm, GELU MLP, biases, tied embeddings
(the model of the research plan in docs/research.md)."""

import torch.nn.functional as F

from ora_megatron.families.family import Family


def gelu_tanh(x):
    """GELU's tanh approximation (transformers' gelu_new / gelu_pytorch_tanh), model.activation: gelu_tanh."""
    return F.gelu(x, approximate="tanh")


FAMILY = Family(name="gpt2", normalization="LayerNorm", activation=F.gelu, gated_mlp=False, bias=True,
                position_embedding="learned_absolute", tied_output=True)
