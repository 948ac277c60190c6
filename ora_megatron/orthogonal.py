"""Frozen random projections for ORA: seeded orthogonal (and Gaussian/uniform) Q/K weights.

Every matrix is a pure function of (seed, layer, role): `seeded_generator` hashes those into a CPU
generator, so build, checkpoint load and export regenerate the same bits, and each tensor-parallel
rank slices its heads out of the same full matrix whatever the parallel sizes are.

Dense methods draw in float64 and round once to fp32; the rounding also hides last-bit differences
between LAPACK builds. The Hadamard method is a structured transform applied in O(d·(a + b)),
d = a·b (two small Kronecker factors) instead of a d×d GEMM: its matrices and that fast path are
ora_megatron.hadamard.
"""

from __future__ import annotations

import contextlib
import hashlib
import math

import torch

from ora_megatron.hadamard import RandomizedHadamard

METHODS = ("qr", "svd", "householder", "cayley", "hadamard")
INITS = ("orthogonal", "gaussian", "uniform")


def seeded_generator(seed: int, layer: int, role: str) -> torch.Generator:
    """CPU generator seeded by sha256 of "seed/layer/role" (stable across processes, unlike hash())."""
    digest = hashlib.sha256(f"{seed}/{layer}/{role}".encode()).digest()
    generator = torch.Generator(device="cpu")
    generator.manual_seed(int.from_bytes(digest[:8], "big") >> 1)
    return generator


# ----------------------------------------------------------------------------- dense orthogonal draws

def _qr(rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    gaussian = torch.randn(rows, cols, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(gaussian)
    # LAPACK's sign convention gives Q[0, 0] < 0 on every draw; folding sign(diag R) into Q makes Q Haar.
    signs = torch.sign(torch.diagonal(r))
    return q * torch.where(signs == 0, 1.0, signs)


def _svd(rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    gaussian = torch.randn(rows, cols, generator=generator, dtype=torch.float64)
    u, _, vh = torch.linalg.svd(gaussian, full_matrices=False)
    return u @ vh


def _householder(rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    """Stewart (1980): the reflections that triangularize a Gaussian matrix, then the sign fold.

    Reflection j sends a fresh Gaussian x_j in R^(rows-j) to a multiple of e_1; by rotational
    invariance this is exactly QR of a Gaussian, so the result is Haar. (Reflections about fully
    random directions would instead give E[W] = (1 - 2/rows)^cols * I, i.e. every head near the
    same coordinates.)
    """
    vectors, diagonal = [], []
    for j in range(cols):
        x = torch.randn(rows - j, generator=generator, dtype=torch.float64)
        sign = 1.0 if x[0] >= 0 else -1.0
        v = x.clone()
        v[0] += sign * torch.linalg.vector_norm(x)  # same sign as x[0]: no cancellation
        vectors.append(v)
        diagonal.append(-sign)  # sign of R[j, j] = -sign * |x_j|, folded in as in _qr
    w = torch.diag(torch.tensor(diagonal, dtype=torch.float64))
    w = torch.cat([w, w.new_zeros(rows - cols, cols)])
    # Apply H_0 ... H_{cols-1} right to left; H_j only touches rows j: and, at this point, columns j:.
    for j in reversed(range(cols)):
        v = vectors[j]
        block = w[j:, j:]
        block -= torch.outer(v, v @ block) * (2.0 / v.dot(v))
    return w


def _cayley(rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    """First `cols` columns of (I - A)^{-1} (I + A) for a random skew-symmetric A.

    Entries of A have variance 2/rows, so its eigenvalues ±iλ follow a semicircle of variance 2,
    for which E[(1 - λ²) / (1 + λ²)] = 0: the draw is unbiased (E[W] -> 0) instead of near I.
    """
    gaussian = torch.randn(rows, rows, generator=generator, dtype=torch.float64)
    skew = (gaussian - gaussian.T) / math.sqrt(rows)
    identity = torch.eye(rows, dtype=torch.float64)
    return torch.linalg.solve(identity - skew, (identity + skew)[:, :cols])


_DENSE_METHODS = {"qr": _qr, "svd": _svd, "householder": _householder, "cayley": _cayley}


def orthogonal_matrix(method: str, rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    """fp32 [rows, cols] with orthonormal columns (W^T W = I), drawn from `generator`."""
    if method not in METHODS:
        raise ValueError(f"unknown orthogonal method {method!r}; expected one of {METHODS}")
    if not 0 < cols <= rows:
        raise ValueError(f"orthonormal columns need 0 < cols <= rows, got rows={rows}, cols={cols}")
    if method == "hadamard":
        return RandomizedHadamard(rows, generator).dense()[:, :cols].contiguous()
    with _one_thread():
        return _DENSE_METHODS[method](rows, cols, generator).float()


@contextlib.contextmanager
def _one_thread():
    """LAPACK's QR/SVD results depend on the thread count in their last bits (seen: 1 of the 24
    Base Q/K matrices differs between 1 and 2 threads), so draws run on one thread: bitwise the
    same in every process of a machine. Other LAPACK builds may still differ by an ulp:
    `matches_regenerated` allows for that."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def matches_regenerated(stored: torch.Tensor, regenerated: torch.Tensor) -> bool:
    """Whether a stored frozen weight is the regenerated one, up to a few roundings in its dtype.

    Another machine's LAPACK can move a draw by an ulp; a different seed or config moves entries
    by about their own size, orders of magnitude beyond this bound.
    """
    bound = 4 * torch.finfo(stored.dtype).eps * regenerated.abs().max().item()
    return (stored.float().cpu() - regenerated.float().cpu()).abs().max().item() <= bound


# ----------------------------------------------------------------------------- frozen Q/K weights

def hadamard_transform_for(seed: int, layer: int, role: str, d_model: int) -> RandomizedHadamard:
    """The transform behind frozen_projection("orthogonal", "hadamard", ...) for (seed, layer, role).

    Q = transform(x)[..., :num_heads * d_k] equals x @ frozen_projection(...).T.
    """
    return RandomizedHadamard(d_model, seeded_generator(seed, layer, role))


def frozen_projection(init: str, method: str, d_model: int, num_heads: int, d_k: int, *, seed: int,
                      layer: int, role: str, joint_heads: bool = False,
                      std: float = 0.02) -> torch.Tensor:
    """All heads' frozen weight, fp32 [num_heads * d_k, d_model] (Megatron out x in).

    Rows [i * d_k, (i + 1) * d_k) are W_i^T, W_i being head i's d_model x d_k projection.
    """
    width = num_heads * d_k
    generator = seeded_generator(seed, layer, role)
    if init == "gaussian":
        return torch.randn(width, d_model, generator=generator) * std
    if init == "uniform":
        return (torch.rand(width, d_model, generator=generator) * 2 - 1) * std
    if init != "orthogonal":
        raise ValueError(f"unknown init {init!r}; expected one of {INITS}")
    # Hadamard columns come from one d_model x d_model transform, so its heads are always joint;
    # the generator's first use must be that transform, matching hadamard_transform_for.
    if joint_heads or method == "hadamard":
        if width > d_model:
            raise ValueError(
                f"jointly orthonormal heads ({'hadamard' if method == 'hadamard' else 'joint_heads'}) "
                f"need num_heads * d_k = {width} <= d_model = {d_model}"
            )
        return orthogonal_matrix(method, d_model, width, generator).T.contiguous()
    heads = [orthogonal_matrix(method, d_model, d_k, generator).T for _ in range(num_heads)]
    return torch.cat(heads, dim=0)
