"""Llama style: RoPE, RMSNorm, SwiGLU MLP, no biases, untied output layer (GQA through
model.num_query_groups)."""

import torch.nn.functional as F

from ora_megatron.families.family import Family

FAMILY = Family(name="llama", normalization="RMSNorm", activation=F.silu, gated_mlp=True, bias=False,
                position_embedding="rope", tied_output=False)
