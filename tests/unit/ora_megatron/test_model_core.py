"""Frozen Q/K semantics, causality and FLOP accounting of the attention variants (one process)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from model_fixtures import BATCH, SEQ, VARIANTS, all_cases, build, megatron_gpt_model, tiny_model, tokens
from torch.utils.flop_counter import FlopCounterMode

from ora_megatron.attention import RandomQKVLinear
from ora_megatron.linear import ColumnLinear, RowLinear
from ora_megatron.model_config import ParallelConfig
from ora_megatron.parallel import destroy_distributed, init_distributed


@pytest.fixture(scope="module", autouse=True)
def one_process_group():
    init_distributed(1, 1, backend="gloo")
    yield
    destroy_distributed()


def qkv_linears(model) -> list[RandomQKVLinear]:
    return [m for m in model.modules() if isinstance(m, RandomQKVLinear)]


def test_frozen_qk_unchanged_by_optimizer_and_hold_no_grad():
    model = build("ora_qr")
    before = [(m.q_weight.clone(), m.k_weight.clone()) for m in qkv_linears(model)]
    assert len(before) == 2
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen_ids = {id(p) for m in qkv_linears(model) for p in (m.q_weight, m.k_weight)}
    assert not frozen_ids & {id(p) for p in trainable}
    opt = torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.1)
    v_before = qkv_linears(model)[0].v_weight.clone()
    for step in range(3):
        opt.zero_grad()
        model(tokens(step)).float().pow(2).mean().backward()
        opt.step()
    for m, (q, k) in zip(qkv_linears(model), before):
        assert torch.equal(m.q_weight, q) and torch.equal(m.k_weight, k)
        assert m.q_weight.grad is None and m.k_weight.grad is None
    assert not torch.equal(qkv_linears(model)[0].v_weight, v_before), "V must train"


@pytest.mark.parametrize("method", ["qr", "hadamard"])
def test_qk_path_carries_input_gradient(method):
    """dL/dx through an ORA attention layer differs from the one with Q/K detached."""
    model = build("ora_qr", attention=dataclasses.replace(VARIANTS["ora_qr"], orthogonal_method=method))
    attention = model.layer1.layer.self_attention
    x = torch.randn(SEQ, 2, 64, generator=torch.Generator().manual_seed(3))

    def input_grad():
        xi = x.clone().requires_grad_(True)
        attention(xi, attention_mask=None)[0].pow(2).sum().backward()
        return xi.grad

    def detach_qk(_module, _inputs, output):
        mixed, bias = output
        groups = mixed.view(*mixed.shape[:-1], 4, -1)  # 4 groups of [q | k | v], 16 each
        qk, v = groups[..., :32], groups[..., 32:]
        return torch.cat([qk.detach(), v], dim=-1).view_as(mixed), bias

    with_qk = input_grad()
    handle = attention.linear_qkv.register_forward_hook(detach_qk)
    without_qk = input_grad()
    handle.remove()
    assert (with_qk - without_qk).abs().max() > 1e-4


def _backward_flops(model) -> tuple[int, int]:
    counter = FlopCounterMode(display=False)
    with counter:
        loss = model(tokens()).float().pow(2).mean()
    forward = counter.get_total_flops()
    with counter:
        loss.backward()
    return forward, counter.get_total_flops()


def test_frozen_qk_skip_weight_gradient_gemms():
    vanilla_fwd, vanilla_bwd = _backward_flops(build("vanilla"))
    ora_fwd, ora_bwd = _backward_flops(build("ora_qr"))
    tokens_per_step, d, layers = 2 * SEQ, 64, 2
    qk_wgrad = layers * 2 * (2 * tokens_per_step * d * d)  # dW_Q and dW_K per layer
    assert ora_fwd == vanilla_fwd
    assert vanilla_bwd - ora_bwd == qk_wgrad
    train_q_fwd, train_q_bwd = _backward_flops(build("ora_train_q"))
    assert train_q_bwd - ora_bwd == qk_wgrad // 2


@pytest.mark.parametrize("case", all_cases(), ids=lambda c: f"{c[0]}-{c[1]}")
def test_causal(case):
    family, variant = case
    model = build(variant, family)
    model.eval()
    t = SEQ // 2
    base = tokens(0)
    changed = base.clone()
    changed[:, t + 1:] = (changed[:, t + 1:] + 17) % 100
    with torch.no_grad():
        out_base = model(base)
        out_changed = model(changed)
    assert torch.equal(out_base[:, : t + 1], out_changed[:, : t + 1])
    assert not torch.allclose(out_base[:, t + 1:], out_changed[:, t + 1:])


def test_qk_regenerated_from_seed_layer_role():
    a, b = build("ora_qr"), build("ora_qr")
    la, lb = qkv_linears(a), qkv_linears(b)
    assert torch.equal(la[0].q_weight, lb[0].q_weight)
    assert not torch.equal(la[0].q_weight, la[1].q_weight), "layers must differ"
    assert not torch.equal(la[0].q_weight, la[0].k_weight), "roles must differ"
    for m in la:
        assert torch.equal(m.q_weight, m.expected_weight("q", m.layer_number, 4))
    c = build("ora_qr", seed=8)
    assert not torch.equal(la[0].q_weight, qkv_linears(c)[0].q_weight)


def test_ora_heads_are_orthonormal_in_the_model():
    for m in qkv_linears(build("ora_qr")):
        for w in (m.q_weight, m.k_weight):
            for head in w.view(-1, 16, 64):  # [d_k, d_model] = W_iᵀ
                assert torch.linalg.norm(head @ head.T - torch.eye(16)) <= 1e-5


def test_ablation_a2_trainability_flags():
    for variant, q_trainable, k_trainable in (("ora_qr", False, False), ("ora_train_q", True, False),
                                              ("ora_train_k", False, True)):
        for m in qkv_linears(build(variant)):
            assert m.q_weight.requires_grad == q_trainable
            assert m.k_weight.requires_grad == k_trainable


@pytest.mark.parametrize("case", [("gpt2", "vanilla"), ("gpt2", "ora_qr"), ("gpt2", "synthesizer_factorized"),
                                  ("llama", "vanilla")], ids=lambda c: f"{c[0]}-{c[1]}")
def test_one_rank_linears_compute_what_megatrons_do(case):
    """On one TP rank our linears are torch's linear with the bias folded in; megatron's own forward
    (separate bias adds, its autograd functions) gives the same logits and gradients to fp32 rounding."""
    family, variant = case
    model = build(variant, family)
    linears = [m for m in model.modules() if isinstance(m, (ColumnLinear, RowLinear))]
    assert len(linears) >= 3 * tiny_model(variant, family).num_layers  # + fc1 and fc2 in every layer

    def logits_and_grads(one_rank: bool):
        for m in linears:
            m.one_rank = one_rank
        model.zero_grad()
        logits = model(tokens(1))
        logits.float().pow(2).mean().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    ours, ours_grads = logits_and_grads(True)
    megatron, megatron_grads = logits_and_grads(False)
    torch.testing.assert_close(ours, megatron, rtol=1e-5, atol=1e-6)
    assert ours_grads.keys() == megatron_grads.keys()
    for name in ours_grads:
        torch.testing.assert_close(ours_grads[name], megatron_grads[name], rtol=1e-4, atol=1e-7, msg=name)


def test_one_rank_linears_fold_the_bias_megatron_hands_back():
    """linear_proj and the MLP's linears are built with skip_bias_add: megatron returns their bias for
    the caller to add; on one rank ours add it inside the GEMM and return None."""
    skip_bias = [m for m in build("vanilla").modules() if isinstance(m, (ColumnLinear, RowLinear)) and m.skip_bias_add]
    assert len(skip_bias) == 3 * 2
    for m in skip_bias:
        x = torch.randn(SEQ, BATCH, m.weight.size(1))
        out, bias = m(x)
        assert bias is None
        torch.testing.assert_close(out, x @ m.weight.t() + m.bias)


@pytest.mark.parametrize("case", [("gpt2", "ora_qr"), ("gpt2", "synthesizer_factorized"), ("llama", "ora_hadamard")],
                         ids=lambda c: f"{c[0]}-{c[1]}")
def test_stage_list_holds_the_same_parameters_as_gpt_model(case):
    """The stage list holds exactly the parameters of megatron-core's own GPTModel."""
    from ora_megatron.stages import build_staged_gpt

    family, variant = case
    model_cfg = tiny_model(variant, family)
    gpt = megatron_gpt_model(model_cfg)
    staged = build_staged_gpt(model_cfg, ParallelConfig())

    def shapes(module):
        return sorted((tuple(p.shape), p.requires_grad) for p in module.parameters())

    assert shapes(gpt) == shapes(staged)


@pytest.mark.parametrize("family, activation_fused", [("gpt2", False), ("llama", True)])
def test_megatron_fusions_on_gpus_keep_the_model_the_same(monkeypatch, family, activation_fused):
    """On a GPU, megatron-core's fused bias-dropout-add and gated SiLU compute what the unfused ops
    do; its fused GELU is the tanh approximation, so the gpt2 family (exact GELU) keeps it off."""
    from ora_megatron.builder import transformer_config

    model = tiny_model("ora_qr", family)
    on_cpu = transformer_config(model, ParallelConfig())
    assert not on_cpu.bias_dropout_fusion and not on_cpu.bias_activation_fusion
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    on_gpu = transformer_config(model, ParallelConfig())  # megatron validates the combination
    assert on_gpu.bias_dropout_fusion
    assert on_gpu.bias_activation_fusion == activation_fused
