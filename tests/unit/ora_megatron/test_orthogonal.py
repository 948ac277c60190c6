import pytest
import torch

from ora_megatron.hadamard import (
    HADAMARD_BASE_ORDERS,
    HadamardRows,
    RandomizedHadamard,
    hadamard_factorization,
    hadamard_matrix,
    kronecker_factors,
    kronecker_split,
)
from ora_megatron.orthogonal import (
    METHODS,
    frozen_projection,
    hadamard_transform_for,
    matches_regenerated,
    orthogonal_matrix,
    seeded_generator,
)

D_MODEL, D_K, HEADS = 768, 64, 12
TOLERANCE = {"qr": 1e-5, "svd": 1e-5, "householder": 1e-5, "hadamard": 1e-5, "cayley": 1e-4}


def orthogonality_error(w: torch.Tensor) -> float:
    """‖W^T W - I‖_F of the fp32 matrix, measured in float64 so the check adds no rounding."""
    w = w.double()
    return torch.linalg.matrix_norm(w.T @ w - torch.eye(w.size(1), dtype=torch.float64)).item()


def head_blocks(weight: torch.Tensor, d_k: int) -> list[torch.Tensor]:
    """Per-head W_i (d_model x d_k) from the Megatron-layout [heads * d_k, d_model] weight."""
    return [block.T for block in weight.split(d_k, dim=0)]


# ----------------------------------------------------------------------------- seeding

def test_seeded_generator_is_stable_and_separates_inputs():
    def draw(seed, layer, role):
        return torch.randn(4, generator=seeded_generator(seed, layer, role))

    assert torch.equal(draw(1, 2, "q"), draw(1, 2, "q"))
    assert not torch.equal(draw(1, 2, "q"), draw(1, 2, "k"))
    assert not torch.equal(draw(1, 2, "q"), draw(1, 3, "q"))
    assert not torch.equal(draw(1, 2, "q"), draw(2, 2, "q"))
    # "1/23" vs "12/3": the separator keeps neighbouring fields from merging.
    assert not torch.equal(draw(1, 23, "q"), draw(12, 3, "q"))


# ----------------------------------------------------------------------------- orthogonal_matrix

@pytest.mark.parametrize("method", METHODS)
def test_orthogonal_matrix_has_orthonormal_columns(method):
    w = orthogonal_matrix(method, D_MODEL, D_K, seeded_generator(0, 0, "q"))
    assert w.shape == (D_MODEL, D_K) and w.dtype == torch.float32
    assert orthogonality_error(w) <= TOLERANCE[method]


@pytest.mark.parametrize("method", METHODS)
def test_orthogonal_matrix_is_deterministic(method):
    def draw(seed, layer, role):
        return orthogonal_matrix(method, 256, 32, seeded_generator(seed, layer, role))

    assert torch.equal(draw(0, 1, "q"), draw(0, 1, "q"))
    for other in (draw(0, 2, "q"), draw(0, 1, "k"), draw(5, 1, "q")):
        assert not torch.allclose(draw(0, 1, "q"), other)


@pytest.mark.parametrize("method", ["qr", "svd", "householder", "cayley"])
def test_dense_draws_are_unbiased(method):
    # Haar (and our Cayley scaling, up to O(1/rows)) has E[W] = 0. Without the sign fold, LAPACK QR
    # gives W[0, 0] < 0 always (mean -0.2 here); random-direction reflections give E[diag] = 0.6.
    rows, cols, draws = 16, 4, 200
    generator = torch.Generator().manual_seed(0)
    mean = torch.stack([orthogonal_matrix(method, rows, cols, generator) for _ in range(draws)]).mean(0)
    assert abs(mean[0, 0].item()) < 0.1
    assert torch.diagonal(mean).abs().max().item() < 0.1


def test_orthogonal_matrix_rejects_bad_arguments():
    generator = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="cols <= rows"):
        orthogonal_matrix("qr", 4, 8, generator)
    with pytest.raises(ValueError, match="unknown orthogonal method"):
        orthogonal_matrix("givens", 8, 4, generator)
    with pytest.raises(ValueError, match="Hadamard"):
        orthogonal_matrix("hadamard", 36 * 3, 4, generator)


# ----------------------------------------------------------------------------- Hadamard

@pytest.mark.parametrize("order", [12, 20, 28, 36, 44, 64, 128, 256, 512, 640, 768, 896, 1024])
def test_hadamard_matrix_is_exact(order):
    h = hadamard_matrix(order)
    assert set(h.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(h @ h.T, order * torch.eye(order))


@pytest.mark.parametrize("order", [0, 3, 6, 52, 100])
def test_hadamard_matrix_rejects_unsupported_orders(order):
    with pytest.raises(ValueError, match="supported orders"):
        hadamard_matrix(order)


def test_hadamard_factorization():
    assert hadamard_factorization(1024) == (1, 1024)
    assert hadamard_factorization(768) == (12, 64)
    assert hadamard_factorization(640) == (20, 32)
    assert hadamard_factorization(896) == (28, 32)
    for order in (1, 2, 24, 2304, 44 * 8):
        base, power = hadamard_factorization(order)
        assert base in HADAMARD_BASE_ORDERS and base * power == order


# Orders with every base: powers of two, Paley I (12, 20, 28, 44) and II (36), and base * 2^k.
FAST_ORDERS = [1, 2, 12, 20, 24, 28, 36, 44, 88, 512, 640, 768]


@pytest.mark.parametrize("order", [*FAST_ORDERS, 1024, 2304])
def test_kronecker_factors_rebuild_the_hadamard_matrix(order):
    a, b = kronecker_split(order)
    outer, inner = kronecker_factors(order)
    assert outer.shape == (a, a) and inner.shape == (b, b)
    assert torch.equal(torch.kron(outer, inner), hadamard_matrix(order))
    # The most balanced split: no other base * 2^p, 2^q split has a smaller a + b.
    base, power = hadamard_factorization(order)
    assert a + b == min((base << p) + (power >> p) for p in range(power.bit_length()))


def test_kronecker_split_examples():
    assert kronecker_split(512) == (16, 32)
    assert kronecker_split(768) == (24, 32)
    assert kronecker_split(640) == (20, 32)
    assert kronecker_split(44) == (44, 1)


@pytest.mark.parametrize("d", FAST_ORDERS)
def test_randomized_hadamard_forward_and_input_gradient_match_dense(d):
    """The fast transform is the dense matrix: exactly its entries (float64 shows no rounding beyond
    summation order), and in fp32 within GEMM-like rounding; the same for the input gradient."""
    transform = RandomizedHadamard(d, torch.Generator().manual_seed(d))
    dense = transform.dense()
    assert dense.shape == (d, d) and dense.dtype == torch.float32
    assert orthogonality_error(dense) <= 1e-5
    for dtype, tolerance in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        x = torch.randn(2, 3, d, dtype=dtype, requires_grad=True)
        grad_out = torch.randn(2, 3, d, dtype=dtype)
        y = transform(x)
        (grad_x,) = torch.autograd.grad(y, x, grad_out)
        assert y.dtype == dtype
        assert (y - x @ dense.to(dtype)).abs().max() <= tolerance
        assert (grad_x - grad_out @ dense.to(dtype).T).abs().max() <= tolerance
    assert transform(torch.randn(4, d).bfloat16()).dtype == torch.bfloat16


def test_hadamard_rows_stack_transforms_and_their_adjoint():
    """Two transforms in one pass: each column sits at `position`; rows_transposed is the adjoint."""
    d, t = 24, 5
    generator = torch.Generator().manual_seed(0)
    signs = [torch.randint(0, 2, (d,), generator=generator).double() * 2 - 1 for _ in range(2)]
    kernel = HadamardRows(signs)
    x = torch.randn(t, d, dtype=torch.float64)
    rows = kernel.rows(x)
    assert rows.shape == (kernel.a, t, 2 * kernel.b)
    token_major = rows.transpose(0, 1).reshape(t, -1)
    scale = torch.tensor(d ** -0.5, dtype=torch.float32).item()
    for role, s in enumerate(signs):
        expected = (x * s) @ hadamard_matrix(d).double() * scale
        block, offset = kernel.position(role, torch.arange(d))
        assert torch.allclose(kernel.take(rows, block, offset), expected, atol=1e-12)
        assert torch.equal(token_major[:, block * kernel.width + offset], kernel.take(rows, block, offset))
    grad = torch.randn(t, 2 * d, dtype=torch.float64)
    assert torch.allclose((token_major * grad).sum(), (x * kernel.rows_transposed(grad)).sum(), atol=1e-10)


def test_randomized_hadamard_is_randomized_and_not_checkpointed():
    a = RandomizedHadamard(24, torch.Generator().manual_seed(0))
    b = RandomizedHadamard(24, torch.Generator().manual_seed(1))
    assert not torch.equal(a.dense(), b.dense())
    assert not torch.equal(a.perm, torch.arange(24))
    assert a.state_dict() == {}


@pytest.mark.parametrize("d", [16, 20, 24])
def test_randomized_hadamard_gradcheck(d):
    transform = RandomizedHadamard(d, torch.Generator().manual_seed(0))
    x = torch.randn(2, d, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(transform, (x,))


# ----------------------------------------------------------------------------- frozen_projection

@pytest.mark.parametrize("method", METHODS)
def test_frozen_projection_heads_are_orthonormal(method):
    weight = frozen_projection("orthogonal", method, D_MODEL, HEADS, D_K, seed=0, layer=3, role="q")
    assert weight.shape == (HEADS * D_K, D_MODEL) and weight.dtype == torch.float32
    for w in head_blocks(weight, D_K):
        assert orthogonality_error(w) <= TOLERANCE[method]


@pytest.mark.parametrize("method", METHODS)
def test_frozen_projection_joint_heads_are_jointly_orthonormal(method):
    weight = frozen_projection("orthogonal", method, D_MODEL, HEADS, D_K, seed=0, layer=3, role="k",
                               joint_heads=True)
    assert orthogonality_error(weight.T) <= TOLERANCE[method]


def test_frozen_projection_consumes_generator_in_head_order():
    weight = frozen_projection("orthogonal", "qr", 128, 3, 16, seed=7, layer=1, role="q")
    generator = seeded_generator(7, 1, "q")
    expected = [orthogonal_matrix("qr", 128, 16, generator) for _ in range(3)]
    assert all(torch.equal(w, e) for w, e in zip(head_blocks(weight, 16), expected))


@pytest.mark.parametrize("init", ["orthogonal", "gaussian", "uniform"])
def test_frozen_projection_is_deterministic(init):
    def make(**where):
        args = dict(seed=0, layer=1, role="q") | where
        return frozen_projection(init, "qr", 256, 4, 32, **args)

    assert torch.equal(make(), make())
    for other in (make(layer=2), make(role="k"), make(seed=1)):
        assert not torch.allclose(make(), other)


def test_frozen_projection_random_inits():
    gaussian = frozen_projection("gaussian", "qr", 512, 8, 64, seed=0, layer=0, role="q", std=0.02)
    assert abs(gaussian.std().item() - 0.02) < 1e-3 and abs(gaussian.mean().item()) < 1e-3
    uniform = frozen_projection("uniform", "qr", 512, 8, 64, seed=0, layer=0, role="q", std=0.05)
    assert uniform.abs().max().item() <= 0.05 and uniform.abs().max().item() > 0.049


def test_frozen_projection_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unknown init"):
        frozen_projection("xavier", "qr", 64, 2, 8, seed=0, layer=0, role="q")
    with pytest.raises(ValueError, match="joint_heads"):
        frozen_projection("orthogonal", "qr", 64, 16, 8, seed=0, layer=0, role="q", joint_heads=True)
    with pytest.raises(ValueError, match="hadamard"):
        frozen_projection("orthogonal", "hadamard", 64, 16, 8, seed=0, layer=0, role="q")


@pytest.mark.parametrize("d_model, heads, d_k", [(768, 12, 64), (768, 4, 64), (640, 10, 32)])
def test_hadamard_runtime_transform_matches_weight(d_model, heads, d_k):
    weight = frozen_projection("orthogonal", "hadamard", d_model, heads, d_k, seed=3, layer=5, role="q")
    transform = hadamard_transform_for(3, 5, "q", d_model)
    x = torch.randn(4, 7, d_model)
    assert torch.allclose(transform(x)[..., :heads * d_k], x @ weight.T, atol=1e-5)


@pytest.mark.slow
def test_draws_do_not_depend_on_the_thread_count():
    """LAPACK's QR differed in the last bits between 1 and 2 threads for one of the Base preset's
    24 Q/K matrices (layer 10's Q), which failed an exact stored-vs-regenerated check on export."""
    threads = torch.get_num_threads()
    draws = {}
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            draws[n] = [frozen_projection("orthogonal", "qr", 768, 12, 64, seed=42, layer=layer, role=role)
                        for layer in (9, 10, 11) for role in "qk"]
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(draws[1], draws[2]))


def test_matches_regenerated_allows_an_ulp_not_another_seed():
    regenerated = frozen_projection("orthogonal", "qr", 64, 4, 16, seed=7, layer=1, role="q")
    one_ulp = torch.nextafter(regenerated, torch.full_like(regenerated, 2.0))
    other_seed = frozen_projection("orthogonal", "qr", 64, 4, 16, seed=8, layer=1, role="q")
    assert matches_regenerated(one_ulp, regenerated)
    assert matches_regenerated(regenerated.to(torch.bfloat16), regenerated)
    assert not matches_regenerated(other_seed, regenerated)
    assert not matches_regenerated(regenerated + 1e-3, regenerated)


# ----------------------------------------------------------------------------- Hadamard Q/K in the model

class _FakeTensorParallelGroup:
    """rank()/size() of a tensor-parallel group, to build one rank's RandomQKVLinear in this process."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


@pytest.fixture(scope="module")
def process_group():
    from ora_megatron.parallel import destroy_distributed, init_distributed

    init_distributed(1, 1, backend="gloo")
    yield
    destroy_distributed()


def _hadamard_model(family: str, **changes):
    from model_fixtures import build

    from ora_megatron.attention import RandomQKVLinear

    model = build("ora_hadamard", family, **changes)
    return model, [m for m in model.modules() if isinstance(m, RandomQKVLinear)]


def _force_path(linears, fast: bool) -> None:
    """Use the fast transforms (the default for frozen Hadamard Q/K) or the dense stored weights."""
    for linear in linears:
        linear._hadamard_weights_checked, linear._hadamard_weights_match = True, fast


@pytest.mark.parametrize("family", ["gpt2", "llama"])  # llama: GQA, so K has fewer columns than d
def test_hadamard_qkv_fast_path_matches_dense_weights(process_group, family):
    """Logits, every parameter gradient and the input gradient of the attention layer are those of
    the dense frozen weights; the fast path counts fewer FLOPs, so it really ran."""
    from model_fixtures import tokens
    from torch.utils.flop_counter import FlopCounterMode

    model, linears = _hadamard_model(family)
    attention = model.layer1.layer.self_attention
    assert all(m._hadamard_applies() for m in linears)
    hidden = torch.randn(16, 2, 64, generator=torch.Generator().manual_seed(1))

    def run(fast: bool):
        _force_path(linears, fast)
        model.zero_grad(set_to_none=True)
        counter = FlopCounterMode(display=False)
        with counter:
            logits = model(tokens())
            logits.float().pow(2).mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        x = hidden.clone().requires_grad_(True)
        attention(x, attention_mask=None)[0].pow(2).sum().backward()
        return logits.detach(), grads, x.grad, counter.get_total_flops()

    fast_logits, fast_grads, fast_input_grad, fast_flops = run(True)
    dense_logits, dense_grads, dense_input_grad, dense_flops = run(False)
    assert (fast_logits - dense_logits).abs().max() <= 1e-5
    assert fast_grads.keys() == dense_grads.keys()
    assert not any(n.endswith((".q_weight", ".k_weight")) for n in fast_grads)
    for name in fast_grads:
        assert (fast_grads[name] - dense_grads[name]).abs().max() <= 1e-5, name
    assert (fast_input_grad - dense_input_grad).abs().max() <= 1e-5
    assert fast_input_grad.abs().max() > 0
    assert fast_flops < dense_flops


def test_hadamard_training_losses_match_dense_weights(process_group):
    """Eight AdamW steps with the fast transforms follow the dense-weight run's losses (fp32)."""
    from model_fixtures import tokens

    def train(fast: bool) -> list[float]:
        model, linears = _hadamard_model("gpt2")
        _force_path(linears, fast)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        losses = []
        for step in range(8):
            optimizer.zero_grad()
            loss = model(tokens(step)).float().logsumexp(-1).mean()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return losses

    fast, dense = train(True), train(False)
    assert max(abs(a - b) for a, b in zip(fast, dense)) <= 1e-5
    assert abs(fast[-1] - fast[0]) > 1e-3, "the model must actually train"


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("groups", [8, 4])
def test_hadamard_qkv_tensor_parallel_slices_match_dense(tp, groups):
    """Each TP rank's fast path gives its heads' columns of the dense weight (rows of H·D), forward
    and input gradient, also with GQA (positions no column of the rank uses get a zero gradient)."""
    from ora_megatron.attention import RandomQKVLinear, _FusedQKV, _HadamardQKV
    from ora_megatron.builder import transformer_config
    from ora_megatron.model_config import AttentionConfig, ModelConfig, ParallelConfig

    model = ModelConfig(hidden_size=64, num_attention_heads=8, num_query_groups=groups,
                        attention=AttentionConfig(type="ora", orthogonal_method="hadamard"))
    config = transformer_config(model, ParallelConfig(tensor=tp))
    x = torch.randn(6, 2, 64, generator=torch.Generator().manual_seed(0))
    for rank in range(tp):
        linear = RandomQKVLinear(64, 0, config=config, init_method=config.init_method, bias=True,
                                 attention=model.attention, seed=5, tp_group=_FakeTensorParallelGroup(rank, tp))
        linear.generate_qk(3)
        args = (linear.v_weight, linear.v_bias)
        fast_x, dense_x = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        fast = _HadamardQKV.apply(fast_x, *args, linear.hadamard, linear.qk_block, linear.qk_offset,
                                  linear.row_index, linear.row_mask)
        dense = _FusedQKV.apply(dense_x, linear.q_weight, linear.k_weight, *args, linear.groups)
        assert fast.shape == dense.shape == (6, 2, (8 + 2 * groups) // tp * 8)
        assert (fast - dense).abs().max() <= 1e-5
        grad_out = torch.randn_like(fast)
        fast.backward(grad_out)
        dense.backward(grad_out)
        assert (fast_x.grad - dense_x.grad).abs().max() <= 1e-5
        assert (linear.row_mask is None) == (tp == 1 and groups == 8)


def _hadamard_qkv_linear(tp: int, groups: int):
    """Layer 3's frozen Hadamard Q/K with V, d 64, 8 heads in `groups` query groups, on TP rank tp - 1 of tp."""
    from ora_megatron.attention import RandomQKVLinear
    from ora_megatron.builder import transformer_config
    from ora_megatron.model_config import AttentionConfig, ModelConfig, ParallelConfig

    model = ModelConfig(hidden_size=64, num_attention_heads=8, num_query_groups=groups,
                        attention=AttentionConfig(type="ora", orthogonal_method="hadamard"))
    config = transformer_config(model, ParallelConfig(tensor=tp))
    linear = RandomQKVLinear(64, 0, config=config, init_method=config.init_method, bias=True,
                             attention=model.attention, seed=5, tp_group=_FakeTensorParallelGroup(tp - 1, tp))
    linear.generate_qk(3)
    return linear


@pytest.mark.parametrize("tp,groups", [(1, 8), (2, 4)])
def test_traced_hadamard_qkv_is_the_fused_kernel(tp, groups):
    """The plain-ops form a compiled layer traces (speed.compile) gives the hand-written kernel's output,
    input gradient and V weight and bias gradients, with GQA and on a TP rank."""
    from ora_megatron.attention import _HadamardQKV

    linear = _hadamard_qkv_linear(tp, groups)
    x = torch.randn(6, 2, 64, generator=torch.Generator().manual_seed(0))
    grad_out = None
    results = []
    for traced in (True, False):
        linear.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        out = linear._traced_hadamard_qkv(xi) if traced else _HadamardQKV.apply(
            xi, linear.v_weight, linear.v_bias, linear.hadamard, linear.qk_block, linear.qk_offset,
            linear.row_index, linear.row_mask)
        grad_out = torch.randn_like(out) if grad_out is None else grad_out
        out.backward(grad_out)
        results.append((out, xi.grad, linear.v_weight.grad, linear.v_bias.grad))
    for traced, kernel in zip(*results):
        torch.testing.assert_close(traced, kernel, rtol=0, atol=1e-5)
    assert results[0][1].abs().max() > 0


@pytest.mark.parametrize("tp,groups", [(1, 8), (2, 4)])  # (2, 4): some positions masked
def test_hadamard_token_chunks_change_nothing(tp, groups):
    """On CPU the transforms run a chunk of tokens at a time (the last chunk shorter): forward and
    input gradient equal the one-chunk results, in the fused Q/K/V path and the general transform."""
    from ora_megatron.attention import _HadamardQKV

    linear = _hadamard_qkv_linear(tp, groups)
    transform = RandomizedHadamard(64, torch.Generator().manual_seed(0))
    x = torch.randn(6, 2, 64, generator=torch.Generator().manual_seed(0))

    def run(chunk_tokens: int):
        linear.hadamard.chunk_tokens = transform.kernel.chunk_tokens = chunk_tokens
        xs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        fused = _HadamardQKV.apply(xs[0], linear.v_weight, linear.v_bias, linear.hadamard, linear.qk_block,
                                   linear.qk_offset, linear.row_index, linear.row_mask)
        general = transform(xs[1])
        for y, seed in ((fused, 1), (general, 2)):
            y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(seed)))
        return fused, general, xs[0].grad, xs[1].grad

    in_chunks, at_once = run(5), run(12)
    assert len(linear.hadamard._chunks(x.view(12, 64))) == 1
    linear.hadamard.chunk_tokens = 5
    assert len(linear.hadamard._chunks(x.view(12, 64))) == 3
    for chunked, whole in zip(in_chunks, at_once):
        torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-6)
        assert chunked.abs().max() > 0

def test_hadamard_fast_path_follows_trainability(process_group):
    """Trainable Q/K (A2 flags, a freeze schedule) use their weights; frozen again at other values,
    the check of the new frozen spell keeps the dense path; frozen at the regenerated values
    (what a checkpoint load restores) the transforms apply again."""
    _, linears = _hadamard_model("gpt2")
    linear = linears[0]
    assert linear._hadamard_applies()
    linear.q_weight.requires_grad_(True)
    assert not linear._hadamard_applies()
    with torch.no_grad():
        linear.q_weight.mul_(1.5)  # trained
    linear.q_weight.requires_grad_(False)
    assert not linear._hadamard_applies()
    linear.q_weight.requires_grad_(True)
    assert not linear._hadamard_applies()
    with torch.no_grad():
        linear.q_weight.copy_(linear.local_weight("q"))
    linear.q_weight.requires_grad_(False)
    assert linear._hadamard_applies()
