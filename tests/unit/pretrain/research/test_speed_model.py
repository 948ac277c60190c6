"""The GPU step-time model: its trace of the CUDA ops, the roofline cost, Inductor's fusion rule, the fit."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ora_megatron.device_branches import cuda_available, cuda_branches, on_cuda
from pretrain.research.speed.code_versions import CODE_VERSIONS, chunk_size, loss_ops
from pretrain.research.speed.cost import fused_groups, kernel_cost, stretch_cost, wave_efficiency
from pretrain.research.speed.gpus import GPU_KINDS, gpu_kind
from pretrain.research.speed.step_time import load_config, micro_batch_time, optimizer_step_time
from pretrain.research.speed.trace import Op, Tensor, trace

H100 = GPU_KINDS["h100"]


def tensor(ident: int, *shape: int, itemsize: int = 2) -> Tensor:
    return Tensor(shape, itemsize, ident, math.prod(shape))


def test_cuda_branches_switch_is_off_unless_entered():
    cpu = torch.device("cpu")
    assert not on_cuda(cpu) and cuda_available() == torch.cuda.is_available()
    with cuda_branches():
        assert on_cuda(cpu) and cuda_available()
    assert not on_cuda(cpu)


def test_gemm_cost_is_its_flops_at_the_fitted_rate_and_wave_share():
    op = Op("mm", "gemm", (tensor(1, 4096, 4096), tensor(2, 4096, 4096)), (tensor(3, 4096, 4096),), False)
    cost = kernel_cost(op, H100)
    # 32 × 16 tiles of 128 × 256 over 132 SMs: 4 waves, the last 88% full (K is not split).
    waves = 512 / (4 * 132)
    assert wave_efficiency(1, 4096, 4096, 4096, 132) == pytest.approx(waves)
    flops = 2 * 4096**3
    assert cost.flops == flops
    assert cost.device_s == pytest.approx(flops / (989.5e12 * H100.constants.gemm_efficiency * waves) + 2e-6)


def test_elementwise_cost_is_its_bytes_at_the_achievable_bandwidth():
    op = Op("add", "memory", (tensor(1, 1024, 1024), tensor(2, 1024, 1024)), (tensor(3, 1024, 1024),), False)
    cost = kernel_cost(op, H100)
    assert cost.bytes == 3 * 2 * 1024 * 1024 and cost.flops == 0
    assert cost.device_s == pytest.approx(6 * 2**20 / (3.35e12 * H100.constants.bandwidth_efficiency) + 2e-6)


def test_nll_kernels_read_only_what_they_gather():
    """NLL's forward reads one log-probability a row (the target's), its backward only writes the [N × C]
    gradient: neither reads the whole fp32 [N × C] input."""
    rows, classes = 4096, 32000
    log_probs, target = Tensor((rows, classes), 4, 1, rows * classes), Tensor((rows,), 8, 2, rows)
    scalar = Tensor((), 4, 3, 1)
    forward = Op("nll_loss_forward", "memory", (log_probs, target), (scalar, Tensor((), 4, 4, 1)), False)
    assert kernel_cost(forward, H100).bytes == rows * 4 + rows * 8 + 8
    backward = Op("nll_loss_backward", "memory", (scalar, log_probs, target, Tensor((), 4, 5, 1)),
                  (Tensor((rows, classes), 4, 6, rows * classes),), True)
    assert kernel_cost(backward, H100).bytes == 4 + rows * 8 + 4 + rows * classes * 4


def test_split_k_fills_the_sms_for_a_weight_gradient():
    # [768 × 32768] @ [32768 × 768]: 18 tiles alone, split in K to fill most of 132 SMs.
    assert wave_efficiency(1, 768, 768, 32768, 132) > 0.9
    assert wave_efficiency(1, 768, 768, 256, 132) == pytest.approx(18 / 132)


def test_compiled_chain_reads_its_inputs_and_writes_what_later_ops_read_once():
    x, y, z, w, weight = tensor(1, 64, 64), tensor(2, 64, 64), tensor(3, 64, 64), tensor(4, 64, 64), tensor(5, 64, 64)
    ops = [Op("mul", "memory", (x,), (y,), False), Op("view", "view", (y,), (y,), False),
           Op("gelu", "memory", (y,), (z,), False), Op("mm", "gemm", (z, weight), (w,), False)]
    fused, gemm = fused_groups(ops)
    assert (fused.inputs, fused.outputs) == ((x,), (z,))  # y stays in registers
    assert gemm is ops[-1]
    eager, compiled = stretch_cost(ops, H100, compiled=False), stretch_cost(ops, H100, compiled=True)
    assert (eager.categories["other"].kernels, compiled.categories["other"].kernels) == (2, 1)
    assert compiled.categories["other"].bytes == 2 * x.nbytes < eager.categories["other"].bytes


def test_loss_chunks_follow_each_revisions_chunk_budget():
    assert chunk_size(CODE_VERSIONS["HEAD"], 32000) == 4096
    assert chunk_size(CODE_VERSIONS["0ff5a15"], 32000) == 2097
    assert chunk_size(CODE_VERSIONS["9e6204f"], 32000) == 524
    gemms = [op for op in loss_ops(CODE_VERSIONS["HEAD"], 32768, 768, 32000) if op.kind == "gemm"]
    assert len(gemms) == 3 * 8  # logits, and the two gradients, per chunk
    assert sum(kernel_cost(op, H100).flops for op in gemms) == pytest.approx(3 * 2 * 32768 * 768 * 32000)


def test_optimizer_step_scales_with_the_parameters_a_gpu_holds():
    whole = optimizer_step_time(H100, 124_000_000)
    half = optimizer_step_time(H100, 62_000_000)
    assert half.device_s == pytest.approx(whole.device_s / 2, rel=0.1)
    checked = optimizer_step_time(H100, 124_000_000, tensors=148, revision="0ff5a15")
    unchecked = optimizer_step_time(H100, 124_000_000, tensors=148, revision="2f8f273")  # both foreach AdamW
    assert checked.kernels - unchecked.kernels == 148 * 13
    fused = optimizer_step_time(H100, 124_000_000, tensors=148)  # HEAD: fused AdamW, one kernel a launch
    assert unchecked.kernels - fused.kernels == 7 * 6 and fused.device_s < unchecked.device_s


@pytest.mark.parametrize("zero_stage, kernels", [
    (0, {"gradients.accumulate": 3 * 5, "gradients.flatten": 1, "gradients.copy_back": 5}),
    (1, {"gradients.accumulate": 3 * 5, "gradients.bucket_copy": 2 * 5}),
    (2, {"gradients.bucket_copy": 4 * 2 * 5}),
])
def test_gradient_work_follows_the_zero_stage(zero_stage, kernels):
    """ZeRO-0 and ZeRO-1 let autograd accumulate 4 micro-batches (3 adds a tensor); ZeRO-0 flattens and
    copies back, ZeRO-1 copies each tensor into the bucket and the partition once, ZeRO-2 every micro-batch."""
    from collections import Counter

    from pretrain.research.speed.code_versions import GradientWork, gradient_ops

    sizes = [1000, 2000, 3000, 4000, 5000]
    assert Counter(op.name for op in gradient_ops(sizes, 4, zero_stage)) == kernels
    if zero_stage:  # ZeRO's flat step over the partition after the gradients' work
        bare = optimizer_step_time(H100, sum(sizes))
        with_gradients = optimizer_step_time(H100, sum(sizes), gradients=GradientWork(tuple(sizes), 4, zero_stage))
        assert with_gradients.kernels - bare.kernels == sum(kernels.values())


def test_without_zero_the_bf16_step_runs_tensor_by_tensor():
    """DeepSpeed's unfused bf16 step: 20 kernels a tensor (the overflow check with its copy to the host, the
    norm, the fp32 gradient, the clip, the copy back) and fused AdamW's launches, against ZeRO-1's few flat
    passes: at Base's 148 tensors, far more host time."""
    from pretrain.research.speed.code_versions import GradientWork, code_version, unfused_optimizer_ops

    sizes = [768 * 768] * 148
    unfused = unfused_optimizer_ops(code_version("HEAD"), sizes)
    assert sum(op.name == "optimizer.adamw" for op in unfused) == 5  # 148 tensors, 36 a launch
    assert len(unfused) == 20 * 148 + 5
    zero0 = optimizer_step_time(H100, sum(sizes), gradients=GradientWork(tuple(sizes), 1, 0))
    zero1 = optimizer_step_time(H100, sum(sizes), gradients=GradientWork(tuple(sizes), 1, 1))
    assert zero0.host_s > 5 * zero1.host_s


def test_unknown_gpu_kind_is_named():
    with pytest.raises(ValueError, match="a100, h100, h200"):
        gpu_kind("v100")


@pytest.mark.slow
def test_trace_of_a_tiny_model_has_its_layers_gemms_and_the_cuda_branches(tmp_path: Path):
    cfg = load_config("tiny", ["model.attention.type=vanilla", "model.hidden_dropout=0.1"])
    ops = trace(cfg).at(8)
    tokens, hidden, ffn = 8 * 64, 64, 256
    forward_gemms = sorted(((op.inputs[1].shape, op.inputs[2].shape) for op in ops
                            if op.name == "addmm" and not op.backward))
    per_layer = sorted([((tokens, hidden), (hidden, 3 * hidden)), ((tokens, hidden), (hidden, hidden)),
                        ((tokens, hidden), (hidden, ffn)), ((tokens, ffn), (ffn, hidden))])
    assert forward_gemms == sorted(per_layer * 2)
    names = [op.name for op in ops]
    assert names.count("sdpa") == names.count("sdpa_backward") == 2  # one flash kernel each way a layer
    assert names.count("bias_dropout_add") == 4  # megatron's compiled fusion, the CUDA build's choice
    assert names.count("linear_cross_entropy") == 1
    assert not any(op.kind == "gemm" and op.inputs[-1].shape[-1] == 2048 for op in ops)  # no unfused logits
    step = micro_batch_time(cfg, H100, 8, cache=tmp_path)
    assert step.categories["gemm"].kernels == 3 * 4 * 2 + 3 * 1  # fwd + 2 bwd a linear; the loss's chunk
    assert list(tmp_path.iterdir())  # the trace is kept for the next call
    shard = micro_batch_time(cfg, H100, 8, tensor_parallel=2, cache=tmp_path)
    assert shard.categories["gemm"].flops == pytest.approx(step.categories["gemm"].flops / 2)
    assert shard.categories["attention"].flops == pytest.approx(step.categories["attention"].flops / 2)


@pytest.mark.slow
def test_fitted_constants_reproduce_their_fit_data():
    from pretrain.research.speed.fit import FIT_DATA, _base_step_ops, fitted

    constants = fitted()
    for key in ("h100", "h200"):
        stored = GPU_KINDS[key].constants
        for name, value in constants[key].__dict__.items():
            assert getattr(stored, name) == pytest.approx(value, rel=0.01), (key, name)
        data = FIT_DATA[key]
        step = _base_step_ops(data.revision).time(replace(GPU_KINDS[key], constants=stored), compiled=False)
        assert step.seconds * 1e3 == pytest.approx(data.step_ms, rel=0.01)
