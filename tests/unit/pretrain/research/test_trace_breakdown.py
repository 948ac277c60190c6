"""The device-time breakdown of a profiler trace, on a trace made by hand: busy time as the union of
overlapping kernels, categories from kernel names, kernels attributed to the CPU operator that launched them."""

from __future__ import annotations

import gzip
import json

import pytest

from pretrain.research import trace_breakdown


def kernel(name: str, ts: float, dur: float, correlation: int) -> dict:
    return {"cat": "kernel", "name": name, "ph": "X", "ts": ts, "dur": dur, "args": {"correlation": correlation}}


def launch(ts: float, correlation: int, api: str = "cuda_runtime") -> dict:
    return {"cat": api, "name": "cudaLaunchKernel", "ph": "X", "ts": ts, "dur": 1, "args": {"correlation": correlation}}


def trace() -> list[dict]:
    """Two steps: a GEMM launched through the driver and a softmax inside the loss operator (100-200 µs on
    the host), then an elementwise kernel and a layer norm outside it; the GEMM and softmax overlap."""
    return [
        {"cat": "cpu_op", "name": "_LinearCrossEntropy", "ph": "X", "ts": 100, "dur": 100},
        # the profiler's twin of a range on the GPU's timeline: not a host range
        {"cat": "gpu_user_annotation", "name": "_LinearCrossEntropy", "ph": "X", "ts": 1000, "dur": 600},
        launch(110, 1, "cuda_driver"), launch(120, 2), launch(300, 3), launch(310, 4),
        kernel("nvjet_sm90_tst_256x128_NNT", 1000, 400, 1),
        kernel("void cunn_SoftMaxForward<4, float>", 1200, 400, 2),  # overlaps the GEMM by 200 µs
        kernel("void at::native::vectorized_elementwise_kernel<4, exp>", 2000, 100, 3),
        kernel("void at::native::vectorized_layer_norm_kernel<float>", 3000, 100, 4),
        kernel("mystery_kernel", 3100, 0, 5),  # no launch event: counted, attributed to no operator
    ]


def test_breakdown_per_step():
    result = trace_breakdown.breakdown(trace(), steps=2, ops=("_LinearCrossEntropy", "absent_op"))
    assert result["kernels_per_step"] == 2.5
    assert result["span_ms"] == pytest.approx((3100 - 1000) / 1e3 / 2)
    assert result["busy_ms"] == pytest.approx((600 + 100 + 100) / 1e3 / 2)  # the overlap counted once
    assert result["busy_share"] == pytest.approx(800 / 2100)
    assert result["kernel_ms"] == pytest.approx(1.0 / 2)
    assert result["categories"] == pytest.approx({"gemm": 0.2, "softmax": 0.2, "elementwise": 0.05,
                                                  "layer norm": 0.05, "other": 0.0})
    assert list(result["categories"])[:2] == ["gemm", "softmax"]  # largest first
    # Launched inside the operator (100-200 µs on the host): the GEMM and the softmax, busy 1000-1600 µs on
    # the device; its wall time runs from the operator's start to the softmax's end.
    assert result["ops"]["_LinearCrossEntropy"] == pytest.approx(
        {"gemm_ms": 0.2, "other_ms": 0.2, "kernels": 1.0, "host_ms": 0.05, "busy_ms": 0.3, "wall_ms": 0.75})
    assert result["ops"]["absent_op"] == {"gemm_ms": 0.0, "other_ms": 0.0, "kernels": 0.0, "host_ms": 0.0,
                                          "busy_ms": 0.0, "wall_ms": 0.0}


@pytest.mark.parametrize("name, expected", [
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma", "attention"),
    ("void cudnn::fusion::compute_dot_do_o_specialized<true, 64>", "attention"),
    ("void at::native::GammaBetaBackwardCUDAKernelTemplate<c10::BFloat16>", "layer norm"),
    ("void at::native::multi_tensor_apply_kernel<TensorListMetadata<4>>", "optimizer"),
    ("triton_poi_fused_add_native_dropout_0", "triton fusions"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>", "reduction"),
    ("void at::native::unrolled_elementwise_kernel<direct_copy_kernel_cuda>", "elementwise"),
    ("void at_cuda_detail::cub::DeviceRadixSortKernel", "other"),
])
def test_kernel_categories(name, expected):
    assert trace_breakdown.category(name) == expected


def test_a_trace_without_kernels_has_no_busy_share():
    result = trace_breakdown.breakdown([{"cat": "cpu_op", "name": "aten::mm", "ph": "X", "ts": 0, "dur": 5}], 3,
                                       ("aten::mm",))
    assert result["kernels_per_step"] == 0 and result["busy_share"] is None and result["categories"] == {}


def test_command_reads_gzip_traces_and_writes_json(tmp_path, capsys):
    path = tmp_path / "small-vanilla.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": trace()}).encode()))
    out = tmp_path / "breakdown.json"
    assert trace_breakdown.main([str(path), "--steps", "2", "--op", "_LinearCrossEntropy", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "0.5 ms of kernel time, busy 0.4 of a 1.1 ms span (38%)" in printed and "| softmax | 0.2 | 40% |" in printed
    assert "| launched inside _LinearCrossEntropy: GEMMs / the rest | 0.2 / 0.2 | 80% |" in printed
    assert json.loads(out.read_text())[str(path)]["busy_share"] == pytest.approx(800 / 2100)


def test_command_errors_name_the_argument(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        trace_breakdown.main([str(tmp_path / "missing.json"), "--steps", "3"])
    assert exit_.value.code == 2 and "no such trace" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        trace_breakdown.main([str(tmp_path / "missing.json"), "--steps", "0"])
    assert "--steps must be >= 1" in capsys.readouterr().err
