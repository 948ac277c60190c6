"""megatron-core's tensor-parallel linears, run as torch's own linear on a lone tensor-parallel rank.

At TP 1 megatron's ColumnParallelLinear / RowParallelLinear still go through Python autograd
functions (identity copy and reduce regions, a linear with a Python backward), and the layers built
with skip_bias_add hand their bias to the caller, which adds it in a pass of its own (the MLP before
its activation, bias-dropout-add after the attention and MLP outputs). On one rank these classes
are `F.linear(x, W, b)` instead: one addmm with the bias inside and torch's native backward, the
bias no longer returned (every caller takes None as "already added"). Same parameters, init, TP
attributes and checkpoints as megatron's; at TP > 1 megatron's forward runs unchanged.

The same product and sum, rounded once differently where a GEMM adds b before the last block of
the inner dimension (fp32: ~1 ulp). Valid because builder.transformer_config turns off the fusions
that would want the bias back (bias-GELU, bias-dropout-add) and gradient-accumulation fusion, and
sequence parallelism needs TP > 1.
"""

from __future__ import annotations

import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from ora_megatron.parallel import tp_rank_size


class ColumnLinear(ColumnParallelLinear):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.one_rank = tp_rank_size(self.tp_group)[1] == 1

    def forward(self, input_, weight=None, runtime_gather_output=None):
        if not self.one_rank:
            return super().forward(input_, weight, runtime_gather_output)
        return F.linear(input_, self.weight if weight is None else weight, self.bias), None


class RowLinear(RowParallelLinear):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.one_rank = tp_rank_size(self.tp_group)[1] == 1

    def forward(self, input_):
        if not self.one_rank:
            return super().forward(input_)
        return F.linear(input_, self.weight, self.bias), None
