"""Randomized Hadamard transforms: the frozen Q/K of `orthogonal_method: hadamard`.

The Hadamard matrices (Sylvester for powers of two, Paley for the bases 12-44) and their split
into two Kronecker factors, then the fast path: `HadamardRows` applies R randomized transforms
x -> x·diag(s)·H/√d as two small contractions, O(d·(a + b)) per token with d = a·b, instead of a
d×d GEMM; `RandomizedHadamard` is one such transform as a module, with its dense matrix.

The matrices live here rather than with the dense draws of ora_megatron.orthogonal because the
fast path is built from them (`kronecker_factors`), and `orthogonal_matrix("hadamard")` is this
module's `RandomizedHadamard.dense()`: the dependency runs one way, orthogonal -> hadamard.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ora_megatron.device_branches import on_cuda

# Base order -> odd prime q of the Paley construction that builds it (type I if q % 4 == 3, else II).
_PALEY_PRIME = {12: 11, 20: 19, 28: 13, 36: 17, 44: 43}
HADAMARD_BASE_ORDERS = (1, 2, *_PALEY_PRIME)

# Bytes of Hadamard intermediates per token chunk on CPU: 512 tokens at d 512, which with 256-1024 measured
# fastest on the 2-core machines this was tuned on (L2 2 × 512 KiB, L3 8 MiB;
# pretrain/research/benchmarks/hadamard_chunks.py).
CPU_CHUNK_BYTES = 2 << 20


# ----------------------------------------------------------------------------- Hadamard matrices

def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def hadamard_factorization(order: int) -> tuple[int, int]:
    """(base, power_of_two) with base * power_of_two == order and base in HADAMARD_BASE_ORDERS."""
    for base in HADAMARD_BASE_ORDERS:
        if order > 0 and order % base == 0 and _is_power_of_two(order // base):
            return base, order // base
    raise ValueError(
        f"no Hadamard matrix of order {order}: supported orders are base * 2^k "
        f"with base in {HADAMARD_BASE_ORDERS}"
    )


def _sylvester(order: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]])
    while h.size(0) < order:
        h = torch.kron(h2, h)
    return h


def _paley(q: int) -> torch.Tensor:
    """Paley I (q = 3 mod 4, order q + 1) or Paley II (q = 1 mod 4, order 2(q + 1)) for a prime q."""
    squares = {(i * i) % q for i in range(1, q)}
    character = torch.tensor([0.0] + [1.0 if a in squares else -1.0 for a in range(1, q)])
    index = torch.arange(q)
    jacobsthal = character[(index[None, :] - index[:, None]) % q]
    # Conference matrix: zero diagonal, C C^T = q I; skew for type I, symmetric for type II.
    conference = torch.zeros(q + 1, q + 1)
    conference[0, 1:] = 1.0
    conference[1:, 0] = -1.0 if q % 4 == 3 else 1.0
    conference[1:, 1:] = jacobsthal
    if q % 4 == 3:
        return torch.eye(q + 1) + conference
    # C ⊗ A + I ⊗ B with A A^T = B B^T = 2I and A B^T antisymmetric, so the cross terms cancel.
    a = torch.tensor([[1.0, 1.0], [1.0, -1.0]])
    b = torch.tensor([[1.0, -1.0], [-1.0, -1.0]])
    return torch.kron(conference, a) + torch.kron(torch.eye(q + 1), b)


def _base_hadamard(base: int) -> torch.Tensor:
    return _sylvester(base) if base <= 2 else _paley(_PALEY_PRIME[base])


def hadamard_matrix(order: int) -> torch.Tensor:
    """Exact ±1 fp32 Hadamard matrix kron(H_base, H_{2^k}): H H^T = order * I."""
    base, power = hadamard_factorization(order)
    return torch.kron(_base_hadamard(base), _sylvester(power))


def kronecker_split(order: int) -> tuple[int, int]:
    """(a, b) with hadamard_matrix(order) == kron(kronecker_factors(order)): a = base·2^p, b = 2^q.

    Of the splits, the one with the smallest a + b (the contractions cost 2(a + b) FLOPs per
    element instead of a dense GEMM's 2·order), the smaller a on a tie.
    """
    base, power = hadamard_factorization(order)
    splits = [(base << p, power >> p) for p in range(power.bit_length())]
    return min(splits, key=lambda split: (split[0] + split[1], split[0]))


def kronecker_factors(order: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B), exact ±1 fp32, with kron(A, B) == hadamard_matrix(order): A = kron(H_base, H_2^p), B = H_2^q.

    Sylvester matrices compose, kron(H_2^p, H_2^q) = H_2^(p+q), so this is the same matrix.
    """
    base, _ = hadamard_factorization(order)
    a, b = kronecker_split(order)
    return torch.kron(_base_hadamard(base), _sylvester(a // base)), _sylvester(b)

# ----------------------------------------------------------------------------- the fast transform

class HadamardRows(torch.nn.Module):
    """R randomized Hadamard transforms of one order d, applied to the same input together.

    Transform r is x -> x·diag(s_r)·H/√d with H = kron(A, B) (`kronecker_factors`). On x viewed as
    [T, a, b] that is a contraction of the last axis with diag(s_r[k·b:(k+1)·b])·B, a different
    matrix for every k, so the signs cost nothing, then a contraction of the middle axis with
    A/√d, shared by all R transforms: 2·(R·b + R·a) FLOPs per input element instead of R dense
    GEMMs' 2·R·d.

    Both contractions are single BLAS calls on contiguous operands (a batched GEMM over k, then one
    GEMM), so the result comes block-major: `rows(x)` is [a, T, R·b], where [i, t, r·b + j] holds
    column i·b + j of transform r for token t, before its column permutation. (A token-major
    layout needs a batched GEMM writing a strided output, which torch runs as one BLAS call per
    batch: fine on one thread, many times slower with several under load.) Callers pick the
    columns they need with `take`; `rows_transposed` is the adjoint, the input gradient, from a
    token-major gradient. `columns` and `columns_transposed` run them a chunk of tokens at a time
    (`chunk_tokens`). None records autograd: callers wrap them in an autograd.Function
    (`differentiable_columns` is the traceable form a compiled graph uses instead).
    The ±1 factors are exact in every dtype (bf16/fp16 casts of the module change nothing); the
    arithmetic runs in fp32 or wider, as a GEMM would accumulate.
    """

    def __init__(self, signs: list[torch.Tensor]):
        super().__init__()
        d = signs[0].numel()
        self.d, self.roles = d, len(signs)
        self.a, self.b = kronecker_split(d)
        self.width = self.roles * self.b  # of one token's row in one block
        outer, inner = kronecker_factors(d)
        # first[k, l, r·b + j] = s_r[k·b + l] · B[l, j]
        first = torch.cat([s.float().view(self.a, self.b, 1) * inner for s in signs], dim=2)
        self.register_buffer("first", first, persistent=False)
        self.register_buffer("outer", outer, persistent=False)
        # Every entry of the product is ±scale: with scale = fp32(1/√d) these are exactly the
        # entries of the dense fp32 matrix (`RandomizedHadamard.dense`), in any compute dtype.
        self.scale = torch.tensor(1 / math.sqrt(d), dtype=torch.float32).item()
        # On CPU, tokens in chunks whose fp32 intermediate [tokens, R·d] is CPU_CHUNK_BYTES: each
        # contraction and gather then reads what the previous one wrote from cache, not memory.
        self.chunk_tokens = max(1, CPU_CHUNK_BYTES // (4 * self.roles * d))

    def position(self, role: int, columns: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block i, offset r·b + j) of column c = i·b + j of transform `role` (before any permutation).

        In a token-major [T, a·R·b] layout the column sits at i·R·b + r·b + j (`block * width + offset`).
        """
        return columns // self.b, role * self.b + columns % self.b

    def _factors(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.first.to(dtype), self.outer.to(dtype) * self.scale

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """[T, d] -> [a, T, R·b] (block-major), computed in promote(x.dtype, fp32)."""
        first, outer = self._factors(torch.promote_types(x.dtype, torch.float32))
        t = x.size(0)
        z = torch.bmm(x.to(first.dtype).view(t, self.a, self.b).transpose(0, 1), first)  # [k, t, :]
        return torch.mm(outer.t(), z.view(self.a, -1)).view(self.a, t, self.width)  # y[i] = sum_k A[k, i] z[k]

    def take(self, rows: torch.Tensor, block: torch.Tensor, offset: torch.Tensor, out=None) -> torch.Tensor:
        """out[t, *n] = the column (block[n], offset[n]) of token t in `rows`: one gather.

        The source is an overlapping strided view of `rows` (row t starts at t·R·b, the block adds
        i·T·R·b through the index), so nothing is copied before the gather.
        """
        t = rows.size(1)
        lead = block.shape[:-1]
        source = rows.view(-1).as_strided((t, *lead, rows.numel() - (t - 1) * self.width),
                                          (self.width, *(0 for _ in lead), 1))
        index = (block * (t * self.width) + offset).expand(t, *block.shape)
        return torch.gather(source, -1, index, out=out)

    def rows_transposed(self, grad: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The adjoint of `rows` from a token-major gradient: [T, a·R·b] -> [T, d] (`out`, contiguous,
        any dtype; grad's by default), summed over the transforms."""
        first, outer = self._factors(torch.promote_types(grad.dtype, torch.float32))
        t = grad.size(0)
        blocks = grad.to(first.dtype).view(t, self.a, self.width).transpose(0, 1).reshape(self.a, -1)
        gz = torch.mm(outer, blocks).view(self.a, t, self.width)
        gx = torch.bmm(gz, first.transpose(1, 2))  # [k, t, l]
        out = grad.new_empty(t, self.d) if out is None else out
        out.view(t, self.a, self.b).copy_(gx.transpose(0, 1))
        return out

    def gather_map(self, block: torch.Tensor, offset: torch.Tensor,
                   slots: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(index [1, a, R·b], mask [a, R·b] or None): how `columns_transposed` gathers a token's gradient
        row into token-major row order, for columns (block, offset) whose gradients sit at `slots` of
        that row; positions no column came from are masked to zero (None: every position is used)."""
        positions = (block * self.width + offset).reshape(-1)
        index = torch.zeros(self.a * self.width, dtype=torch.long, device=block.device)
        mask = torch.zeros(index.numel(), device=block.device)
        index[positions] = slots.reshape(-1).to(index.device)
        mask[positions] = 1.0
        return index.view(1, self.a, -1), None if bool(mask.all()) else mask.view(self.a, -1)

    def _chunks(self, x: torch.Tensor) -> list[slice]:
        """Token ranges to process at once: chunks on CPU (its caches), all tokens on an accelerator
        (a kernel launch per chunk would cost more there than the memory traffic it saves)."""
        t = x.size(0)
        step = self.chunk_tokens if x.device.type == "cpu" and not on_cuda(x.device) else max(t, 1)
        return [slice(start, start + step) for start in range(0, t, step)]

    def columns(self, x: torch.Tensor, block: torch.Tensor, offset: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out[t, *n] = take(rows(x), block, offset)[t, *n] for x [T, d], in out's dtype."""
        for chunk in self._chunks(x):
            self.take(self.rows(x[chunk]).to(out.dtype), block, offset, out=out[chunk])
        return out

    def differentiable_columns(self, x: torch.Tensor, block: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        """`columns` as plain differentiable ops, [T, *n] in x's dtype, for a compiled graph (train.compile):
        `columns` writes into strided `out=` views and its callers regather the gradient by hand, which
        dynamo cannot trace; here autograd derives the same adjoint and the compiler fuses the gather."""
        return self.rows(x)[block, :, offset].movedim(-1, 0).to(x.dtype)

    def columns_transposed(self, grad: torch.Tensor, index: torch.Tensor, mask: Optional[torch.Tensor],
                           out: torch.Tensor) -> torch.Tensor:
        """The input gradient [T, d] (into `out`) from gradient rows [T, W] holding the columns' gradients
        where `gather_map` says."""
        for chunk in self._chunks(grad):
            g = grad[chunk]
            t = g.size(0)
            # Token-major: each token's gradient row is read once (a block-major gather re-reads it a times).
            rows = torch.gather(g.view(t, 1, -1).expand(t, self.a, -1), 2, index.expand(t, -1, -1))
            if mask is not None:
                rows.mul_(mask)
            self.rows_transposed(rows.view(t, -1), out=out[chunk])
        return out


class _HadamardColumns(torch.autograd.Function):
    """out[:, n] = column (block[n], offset[n]) of rows(x), and its input gradient (the general,
    unfused use of HadamardRows)."""

    @staticmethod
    def forward(ctx, x, rows: HadamardRows, block, offset):
        ctx.rows, ctx.dtype = rows, x.dtype
        ctx.save_for_backward(*rows.gather_map(block, offset, torch.arange(block.numel())))
        return rows.columns(x, block, offset, out=x.new_empty(x.size(0), *block.shape))

    @staticmethod
    def backward(ctx, grad):
        index, mask = ctx.saved_tensors
        out = grad.new_empty(grad.size(0), ctx.rows.d, dtype=ctx.dtype)
        return ctx.rows.columns_transposed(grad.contiguous(), index, mask, out), None, None, None


class RandomizedHadamard(torch.nn.Module):
    """x -> x @ M[:, perm] with M = diag(signs) H_d / sqrt(d): an exactly orthogonal d x d map.

    Applied as two small contractions (HadamardRows, H_d = kron(A, B)) and a column gather, in
    O(d·(a + b)) per row instead of a d x d GEMM; `dense()` is the same matrix. signs and perm come
    from the generator and are non-persistent: they are regenerated from the seed, never checkpointed.
    """

    def __init__(self, d: int, generator: torch.Generator):
        super().__init__()
        self.d = d
        hadamard_factorization(d)  # refuse unsupported orders before drawing
        signs = torch.randint(0, 2, (d,), generator=generator).float() * 2 - 1
        self.register_buffer("signs", signs, persistent=False)
        self.register_buffer("perm", torch.randperm(d, generator=generator), persistent=False)
        self.kernel = HadamardRows([signs])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        block, offset = self.kernel.position(0, self.perm)
        return _HadamardColumns.apply(x.reshape(-1, self.d), self.kernel, block, offset).view(x.shape)

    def dense(self) -> torch.Tensor:
        """M[:, perm] as fp32 [d, d] (scaled in float64, rounded once)."""
        scaled_signs = self.signs.double().cpu()[:, None] / math.sqrt(self.d)
        return (hadamard_matrix(self.d).double()[:, self.perm.cpu()] * scaled_signs).float()
