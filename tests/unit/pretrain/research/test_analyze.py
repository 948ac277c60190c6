"""pretrain.research.analyze: its measures on matrices with known answers, its attention
probabilities against the model's own fused attention, and the command on the session's run."""

from __future__ import annotations

import json
import math

import pytest
import torch
from model_fixtures import build, tokens

from pretrain.research.analyze import (
    ENTROPY_PLOT,
    HIGHER_IS_BETTER,
    RANK_PLOT,
    capture_attention,
    causal_softmax,
    distance_ratios,
    effective_rank,
    entropy_ratio,
    head_diversity,
    main,
    orthogonality_error,
    qk_head_weights,
    row_entropy,
)
from pretrain.run_files.run_dir import RunDir

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def orthonormal(heads: int, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """fp32 [heads, rows, cols], each with orthonormal columns (QR of a Gaussian in float64)."""
    gaussian = torch.randn(heads, rows, cols, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return torch.linalg.qr(gaussian)[0].float()


# ---------------------------------------------------------------------------- measures
def test_entropy_of_a_uniform_causal_row_is_log_n_and_of_a_one_hot_zero():
    s = 7
    uniform = causal_softmax(torch.zeros(s, s))
    assert row_entropy(uniform).tolist() == pytest.approx([math.log(n) for n in range(1, s + 1)], abs=1e-6)
    assert entropy_ratio(uniform).item() == pytest.approx(1.0, abs=1e-6)
    one_hot = torch.eye(s)[torch.randint(s, (s,), generator=torch.Generator().manual_seed(1))]
    assert row_entropy(one_hot).tolist() == [0.0] * s
    assert entropy_ratio(torch.eye(s)).item() == 0.0


def test_effective_rank_of_identity_is_n_and_of_rank_one_is_one():
    assert effective_rank(torch.eye(9)).item() == pytest.approx(9.0, rel=1e-6)
    generator = torch.Generator().manual_seed(0)
    rank_one = torch.outer(torch.randn(12, generator=generator), torch.randn(5, generator=generator))
    assert effective_rank(rank_one).item() == pytest.approx(1.0, abs=1e-4)
    # Two equal singular values, the rest zero: 2.
    assert effective_rank(torch.diag(torch.tensor([3.0, 3.0, 0.0, 0.0]))).item() == pytest.approx(2.0, rel=1e-6)


def test_head_diversity_is_zero_for_identical_heads_and_log_2_for_disjoint_ones():
    s = 5
    same = causal_softmax(torch.randn(1, 1, s, s, generator=torch.Generator().manual_seed(0))).expand(2, 3, s, s)
    assert head_diversity(same) == pytest.approx(0.0, abs=1e-7)
    first, last = torch.zeros(s, s), torch.eye(s)
    first[:, 0] = 1.0  # every row on key 0; the other head on the query itself: disjoint from row 1 on
    assert head_diversity(torch.stack([first, last]).unsqueeze(0)) == pytest.approx(math.log(2), rel=1e-6)
    assert head_diversity(same[:, :1]) is None


def test_distortion_of_an_orthonormal_map_is_zero_and_of_a_scaled_one_the_scale():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(200, 64, generator=generator)
    w = orthonormal(3, 64, 16)
    ratios = distance_ratios(x, w, 500, generator)
    assert (ratios - 1).abs().max().item() < 1e-6
    scaled = distance_ratios(x, 0.25 * w, 500, generator)
    assert scaled.mean(-1).tolist() == pytest.approx([0.25] * 3, rel=1e-6)
    # Anisotropic: ratios spread between the smallest and largest singular value.
    stretched = distance_ratios(x, w * torch.linspace(0.5, 2.0, 16), 500, generator)
    assert stretched.min() > 0.5 and stretched.max() < 2.0 and stretched.std() > 0.05


def test_orthogonality_error_is_measured_in_the_training_dtype():
    w = orthonormal(4, 64, 16)
    in_bf16, fro_bf16 = orthogonality_error(w, torch.bfloat16)
    in_fp32, _ = orthogonality_error(w, torch.float32)
    assert (in_bf16 > 0).all() and (in_bf16 < 0.02).all()
    assert (in_fp32 < 1e-5).all()
    assert (fro_bf16 >= in_bf16).all()
    assert orthogonality_error(2 * w, torch.float32)[0].tolist() == pytest.approx([3.0] * 4, abs=1e-5)


# ---------------------------------------------------------------------------- the model's attention
# ora (frozen QR Q/K), Hadamard Q/K (their fast path), llama with grouped-query attention and RoPE
# (ora, and vanilla: megatron's fused QKV rows), a synthesizer (no Q/K).
CASES = [("gpt2", "ora_qr"), ("gpt2", "ora_hadamard"), ("llama", "ora_qr"), ("llama", "vanilla"),
         ("gpt2", "synthesizer_factorized")]


@pytest.mark.parametrize("family,variant", CASES, ids=[f"{f}-{v}" for f, v in CASES])
def test_probabilities_and_qk_weights_are_the_ones_the_model_computed_with(one_process_group, family, variant):
    """P·V recomputed from what the core attention received is its fused kernel's output; and at one
    position the difference of two sequences' queries (keys) is their inputs' difference through the
    extracted W (biases cancel, RoPE turns both by the same angle: norms kept)."""
    model = build(variant, family).eval()
    attention = model.layer1.layer.self_attention
    seen = {}
    hooks = [] if variant.startswith("synthesizer") else [
        attention.linear_qkv.register_forward_pre_hook(lambda _m, a: seen.update(x=a[0])),
        attention.core_attention.register_forward_hook(lambda _m, a, _o: seen.update(q=a[0], k=a[1]))]
    layers = capture_attention(model, tokens(3))
    for hook in hooks:
        hook.remove()
    assert len(layers) == 2
    for layer in layers:
        probs = layer.probs
        assert probs.shape == (2, 4, 16, 16)
        assert torch.allclose(probs.sum(-1), torch.ones(2, 4, 16))
        assert probs.triu(1).abs().max().item() == 0.0, "causal"
        assert torch.allclose(probs @ layer.values, layer.output, atol=1e-5, rtol=0)
    if variant.startswith("synthesizer"):
        assert qk_head_weights(attention) is None and layers[0].qkv_input is None
        return
    q_weight, k_weight = qk_head_weights(attention)
    groups = 2 if family == "llama" else 4
    assert q_weight.shape == (4, 64, 16) and k_weight.shape == (groups, 64, 16)
    delta = seen["x"][:, 0] - seen["x"][:, 1]  # [s, d_model]
    for weight, projected in ((q_weight, seen["q"]), (k_weight, seen["k"])):
        expected = torch.einsum("sd,hdk->shk", delta, weight).norm(dim=-1)
        got = (projected[:, 0] - projected[:, 1]).norm(dim=-1)  # [s, heads]
        assert torch.allclose(got, expected, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------- the command
def test_command_on_a_trained_run_writes_the_evaluation_and_plots(reference, tmp_path, capsys):
    """The session's 6-step ORA run (fp32): orthonormal Q/K measured as such."""
    out = tmp_path / "plots"
    run = tmp_path / "run"
    # The run is shared: analyse a copy of its config and checkpoint, not the run itself.
    run.mkdir()
    (run / "config.yaml").write_text((reference / "config.yaml").read_text())
    (run / "checkpoints").symlink_to(reference / "checkpoints")
    assert main(["--run-dir", str(run), "--out", str(out), "--tokens", "256", "--pairs", "256"]) == 0
    assert "wrote" in capsys.readouterr().out
    record = json.loads(RunDir(run).evaluation_file("attention").read_text())
    assert record["name"] == "attention" and record["checkpoint"] == "step00000006"
    keys = set(HIGHER_IS_BETTER)
    assert set(record["summary"]) == set(record["higher_is_better"]) == set(record["per_layer"]) == keys
    assert all(len(values) == 2 for values in record["per_layer"].values())
    assert all(math.isfinite(v) for v in record["summary"].values())
    assert all(len(layer) == 4 for layer in record["per_head"]["entropy_ratio"])
    assert len(record["per_head"]["k_distortion"][0]) == 4
    summary = record["summary"]
    assert 0 < summary["entropy_ratio"] <= 1 and 1 <= summary["attention_rank"] <= 32
    assert 1 <= summary["output_rank"] <= 16 and 0 < summary["head_diversity"] < math.log(2)
    assert summary["q_distortion"] < 1e-5 and summary["k_distortion"] < 1e-5
    assert summary["qk_orthogonality_error"] < 1e-5
    assert max(record["recompute_max_abs_error"]) < 1e-5
    assert record["tokens"] == {"split": "valid", "sequences": 8, "seq_length": 32, "distance_pairs": 256, "seed": 0}
    for name in (ENTROPY_PLOT, RANK_PLOT):
        assert (out / name).read_bytes().startswith(PNG_SIGNATURE)


def test_a_run_without_checkpoint_is_an_error_that_writes_nothing(tmp_path, capsys):
    assert main(["--run-dir", str(tmp_path)]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
