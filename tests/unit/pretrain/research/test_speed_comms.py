"""pretrain/research/speed/comms.py: ring times, DeepSpeed's buckets and their overlap, the TP all-reduce
count, the pipeline bubble, against values worked out by hand."""

from __future__ import annotations

import pytest

from pretrain.research.speed import comms
from pretrain.research.speed.gpus import A100, H100

GB = 1e9


def test_an_all_reduce_inside_a_node_runs_at_half_the_nvlink_figure():
    # 8 H100s on NVLink (900 GB/s both ways: 450 one way), 1 GB: 2·7/8 GB / 450 GB/s, plus NCCL's
    # ring latency 8.4 µs + 14 steps × 3.4 µs.
    group = comms.Group(8)
    assert (group.nodes, group.ranks_per_node) == (1, 8)
    assert comms.all_reduce_s(GB, H100, group) == pytest.approx(1.75 / 450 + 56e-6)
    assert comms.all_gather_s(GB, H100, group) == pytest.approx(0.875 / 450 + 8.4e-6 + 7 * 3.4e-6)


def test_across_nodes_the_nics_of_the_group_s_ranks_on_a_node_set_the_bus_bandwidth():
    # 16 A100s on 2 nodes: 8 HDR NICs a node, 25 GB/s each → 200 GB/s (under NVLink's 300).
    # Latency: 30 ring steps, 2 of them between nodes (9.6 µs), 28 on NVLink (3.4 µs).
    assert comms.bus_bandwidth(A100, comms.Group(16)) == 200 * GB
    assert comms.all_reduce_s(GB, A100, comms.Group(16)) == pytest.approx(
        2 * 15 / 16 / 200 + 8.4e-6 + 28 * 3.4e-6 + 2 * 9.6e-6)
    # DP 16 at TP 2 on 4 nodes: 4 of the group's ranks a node → 4 NICs, 100 GB/s
    wide = comms.Group(16, stride=2)
    assert (wide.nodes, wide.ranks_per_node) == (4, 4)
    assert comms.bus_bandwidth(A100, wide) == 100 * GB
    # TP 8 × DP 4: one rank a node, one NIC
    assert comms.bus_bandwidth(H100, comms.Group(4, stride=8)) == 50 * GB
    assert comms.all_reduce_s(GB, H100, comms.Group(1)) == 0.0


def test_buckets_fill_in_backward_order_and_a_large_gradient_goes_alone():
    assert comms.reduce_buckets([30, 30, 60, 10], 50) == [30, 30, 60, 10]
    assert comms.reduce_buckets([20, 20, 5, 40, 10], 50) == [45, 50]
    assert comms.reduce_buckets([], 50) == []


def test_a_bucket_s_reduction_hides_behind_the_next_bucket_s_backward():
    # backward 1 s over two equal buckets: bucket 0 is ready at 0.5 s and reduced by 0.7 s, bucket 1
    # after backward (1.0 s), reduced by 1.3 s: 0.3 s exposed
    assert comms.exposed_bucket_reduction_s(1.0, [50, 50], [0.2, 0.3]) == pytest.approx(0.3)
    # a reduction longer than the next bucket's backward holds backward: bucket 0 done at 1.3 s
    assert comms.exposed_bucket_reduction_s(1.0, [50, 50], [0.8, 0.3]) == pytest.approx(0.6)
    # one bucket (everything fits in one): nothing overlaps
    assert comms.exposed_bucket_reduction_s(1.0, [80], [0.25]) == pytest.approx(0.25)


def _setup(zero: int, dp: int, micro_batches: int = 1, overlap: bool = True) -> comms.DataParallelSetup:
    return comms.DataParallelSetup(zero_stage=zero, dp=dp, stride=1, dtype_bytes=2, micro_batches=micro_batches,
                                   overlap=overlap, reduce_bucket_elements=50, persistence_threshold=25)


def test_zero_stages_send_what_deepspeed_sends():
    trainable, groups, held = [40, 40, 20], [80, 20], [40, 40, 20, 30]
    n = 4
    zero0 = comms.data_parallel_traffic(trainable, groups, held, _setup(0, n, 2), H100, 0.5, 1.0)
    # one all-reduce after the last micro-batch, exposed
    assert zero0.bytes_sent == pytest.approx(2 * 3 / 4 * 2 * 100)
    assert zero0.exposed_s == pytest.approx(zero0.busy_s) == pytest.approx(comms.all_reduce_s(200, H100,
                                                                                              comms.Group(n)))
    zero1 = comms.data_parallel_traffic(trainable, groups, held, _setup(1, n, 2), H100, 0.5, 1.0)
    # + the updated parameters all-gathered, each group padded to 2·dp = 8 elements: 80 and 24
    assert zero1.bytes_sent == pytest.approx(2 * 3 / 4 * 2 * 100 + 3 / 4 * 2 * (80 + 24))
    zero2 = comms.data_parallel_traffic(trainable, groups, held, _setup(2, n, 2), H100, 0.5, 1.0)
    assert zero2.bytes_sent == pytest.approx(2 * 2 * 3 / 4 * 2 * 100 + 3 / 4 * 2 * (80 + 24))
    zero3 = comms.data_parallel_traffic(trainable, groups, held, _setup(3, n, 2), H100, 0.5, 1.0)
    # each micro-batch: reduce-scatter the gradients, all-gather the parameters above the threshold (frozen too)
    assert zero3.bytes_sent == pytest.approx(2 * (3 / 4 * 2 * 100 + 3 / 4 * 2 * (40 + 40 + 30)))
    assert comms.data_parallel_traffic(trainable, groups, held, _setup(1, 1), H100, 0.5, 1.0).bytes_sent == 0


def test_without_overlap_every_bucket_is_exposed():
    trainable, groups = [40, 40, 20], [100]
    overlapped = comms.data_parallel_traffic(trainable, groups, trainable, _setup(1, 16), A100, 0.5, 1.0)
    serial = comms.data_parallel_traffic(trainable, groups, trainable, _setup(1, 16, overlap=False), A100, 0.5, 1.0)
    assert serial.exposed_s == pytest.approx(serial.busy_s) == pytest.approx(overlapped.busy_s)
    assert overlapped.exposed_s < serial.exposed_s


def test_tensor_parallel_all_reduces_per_layer_and_their_size():
    # 4 a layer (2 forward, 2 backward) + the embedding's and the output layer's input gradient
    assert comms.tensor_parallel_all_reduces(24, first=True, last=True, recompute=False) == 98
    assert comms.tensor_parallel_all_reduces(24, first=True, last=True, recompute=True) == 146
    assert comms.tensor_parallel_all_reduces(12, first=False, last=True, recompute=False) == 49
    # each moves tokens × hidden × 2 bytes over TP 2's NVLink: 2·1/2·S / 450 GB/s + 8.4 µs + 2 × 3.4 µs
    tokens, hidden = 8 * 512, 1024
    one = tokens * hidden * 2 / 450e9 + 15.2e-6
    assert comms.tensor_parallel_s(tokens, hidden, 2, 98, H100, tp=2) == pytest.approx(98 * one)
    assert comms.tensor_parallel_s(tokens, hidden, 2, 98, H100, tp=1) == 0.0


def test_pipeline_bubble():
    assert comms.pipeline_bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert comms.pipeline_bubble_fraction(1, 8) == 0.0
