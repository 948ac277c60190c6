"""What one training step sends between GPUs, how long NCCL takes to send it, and how much of that time
the step waits for in this project's configuration (DeepSpeed 0.19.8, megatron-core, ds_configs/).

Collective times (NVIDIA nccl-tests, doc/PERFORMANCE.md: a collective on n ranks moves S bytes at a
"bus bandwidth" that is the hardware bottleneck's; a ring all-reduce takes 2(n−1)/n · S / busbw, an
all-gather or reduce-scatter (n−1)/n · S / busbw, with S the whole tensor, a point-to-point send S / bw),
plus NCCL's own latency model for the ring and its Simple protocol (NCCL src/graph/tuning.cc: 8.4 µs,
and per ring step 3.4 µs over NVLink, 9.6 µs over the network; an all-reduce takes 2(n−1) steps,
2(nodes−1) of them between nodes, an all-gather or reduce-scatter n−1 and nodes−1).

Bus bandwidths come from the GPUs' data sheets (`gpus.GPUKind`): inside a node one direction of NVLink
(the data sheet quotes both directions); between nodes each rank's ring crosses a node boundary once
per channel, so a node's network egress carries the whole bus bandwidth: the group's ranks on a node ×
one NIC each (DGX layout), never more than NVLink. Both are upper bounds NCCL approaches for large
messages: the times here are lower bounds of the transfers.

Ranks are laid out tensor-fastest, then data, then pipeline (pretrain.parallel_layout): a tensor group
sits on one node when TP ≤ 8, a data-parallel group spans TP·DP consecutive ranks, pipeline neighbours
are TP·DP ranks apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pretrain.research.speed.gpus import GPUS_PER_NODE, GPUKind

RING_BASE_LATENCY_S = 8.4e-6
RING_STEP_LATENCY_S = {"nvlink": 3.4e-6, "network": 9.6e-6}


@dataclass(frozen=True)
class Group:
    """`size` ranks, `stride` ranks apart (consecutive ranks fill a node of GPUS_PER_NODE first)."""

    size: int
    stride: int = 1

    @property
    def nodes(self) -> int:
        return min(self.size, math.ceil(self.size * self.stride / GPUS_PER_NODE))

    @property
    def ranks_per_node(self) -> int:
        return self.size // self.nodes


def bus_bandwidth(gpu: GPUKind, group: Group) -> float:
    """Bytes/s a ring over `group` reaches (the module's docstring)."""
    nvlink = gpu.nvlink_bytes_per_s / 2
    if group.nodes == 1:
        return nvlink
    return min(nvlink, group.ranks_per_node * gpu.infiniband_bytes_per_s)


def ring_latency_s(group: Group, steps_per_rank: int) -> float:
    """NCCL's ring/Simple latency: `steps_per_rank` = 2 for an all-reduce, 1 for a gather or scatter."""
    inter = steps_per_rank * (group.nodes - 1)
    intra = steps_per_rank * (group.size - 1) - inter
    return (RING_BASE_LATENCY_S + intra * RING_STEP_LATENCY_S["nvlink"]
            + inter * RING_STEP_LATENCY_S["network"])


def all_reduce_s(nbytes: float, gpu: GPUKind, group: Group) -> float:
    if group.size == 1:
        return 0.0
    n = group.size
    return ring_latency_s(group, 2) + 2 * (n - 1) / n * nbytes / bus_bandwidth(gpu, group)


def all_gather_s(nbytes: float, gpu: GPUKind, group: Group) -> float:
    """All-gather (or reduce-scatter: the same ring, the same time) of a tensor of `nbytes` in all."""
    if group.size == 1:
        return 0.0
    n = group.size
    return ring_latency_s(group, 1) + (n - 1) / n * nbytes / bus_bandwidth(gpu, group)


reduce_scatter_s = all_gather_s


def send_s(nbytes: float, gpu: GPUKind, same_node: bool) -> float:
    """One point-to-point send: NVLink one way inside a node, one NIC between nodes."""
    link = "nvlink" if same_node else "network"
    bandwidth = gpu.nvlink_bytes_per_s / 2 if same_node else gpu.infiniband_bytes_per_s
    return RING_BASE_LATENCY_S + RING_STEP_LATENCY_S[link] + nbytes / bandwidth


# ------------------------------------------------------------------ data parallelism under ZeRO
def reduce_buckets(numels: list[int], bucket_elements: int) -> list[int]:
    """Elements of each gradient bucket, in the order backward fills them (DeepSpeed's ipg buckets,
    stage_1_and_2.py reduce_independent_p_g_buckets_and_remove_grads): a gradient that would overflow
    the bucket sends the bucket first; one larger than a bucket goes alone."""
    buckets, current = [], 0
    for numel in numels:
        if current and current + numel > bucket_elements:
            buckets.append(current)
            current = 0
        current += numel
    return buckets + ([current] if current else [])


def exposed_bucket_reduction_s(backward_s: float, bucket_numels: list[int], bucket_s: list[float]) -> float:
    """Time backward plus the bucketed gradient reduction takes beyond backward alone, with
    overlap_comm (DeepSpeed's reduction stream): bucket k is reduced while backward fills bucket k+1;
    launching bucket k+1 makes the compute stream wait for bucket k (average_tensor's wait_stream);
    the last bucket is reduced after backward, and the epilogue synchronizes.

    Backward time is shared among the buckets in proportion to their elements (an approximation: the
    layers' backward FLOPs follow their weights, except attention's and the output layer's).
    """
    total = sum(bucket_numels)
    if total == 0:
        return 0.0
    clock, reduced_at = 0.0, 0.0
    for numel, reduce_s in zip(bucket_numels, bucket_s):
        clock += backward_s * numel / total
        clock = max(clock, reduced_at)  # the compute stream waits for the bucket before
        reduced_at = clock + reduce_s
    return reduced_at - backward_s


@dataclass(frozen=True)
class DataParallelTraffic:
    """Per optimizer step, on the rank with the most trainable parameters."""

    bytes_sent: float  # bytes the collectives move, as the ring formulas count them (2(n−1)/n · S ...)
    busy_s: float  # time the collectives take
    exposed_s: float  # the part the step waits for


@dataclass(frozen=True)
class DataParallelSetup:
    """What the data-parallel traffic depends on (DeepSpeed's zero_optimization, the layout)."""

    zero_stage: int
    dp: int
    stride: int  # TP: data-parallel peers are TP ranks apart
    dtype_bytes: int  # gradients and parameters travel in the training dtype (communication_data_type)
    micro_batches: int  # per optimizer step (gradient accumulation)
    overlap: bool  # overlap_comm on CUDA (ds_config), off under the pipeline engine
    reduce_bucket_elements: int
    persistence_threshold: int  # ZeRO-3: smaller parameters are not partitioned


def gradient_reduce_s(numels: list[int], setup: DataParallelSetup, gpu: GPUKind,
                      backward_s: float) -> tuple[float, float, float]:
    """(bytes, busy, exposed) of one micro-batch's gradient reduction: ZeRO-0 all-reduces after backward
    (engine.allreduce_gradients, 5e8-element buckets: one here); ZeRO-1/2 all-reduce each bucket
    (use_multi_rank_bucket_allreduce, DeepSpeed's default, turns its reduce-scatter into an all-reduce);
    ZeRO-3 reduce-scatters each bucket."""
    group, n, e = Group(setup.dp, setup.stride), setup.dp, setup.dtype_bytes
    buckets = (reduce_buckets(numels, setup.reduce_bucket_elements) if setup.zero_stage > 0
               else [sum(numels)])
    if setup.zero_stage == 3:
        times = [reduce_scatter_s(e * b, gpu, group) for b in buckets]
        moved = (n - 1) / n * e * sum(buckets)
    else:
        times = [all_reduce_s(e * b, gpu, group) for b in buckets]
        moved = 2 * (n - 1) / n * e * sum(buckets)
    busy = sum(times)
    exposed = (exposed_bucket_reduction_s(backward_s, buckets, times) if setup.overlap and setup.zero_stage > 0
               else busy)
    return moved, busy, exposed


def data_parallel_traffic(trainable: list[int], groups: list[int], held: list[int], setup: DataParallelSetup,
                          gpu: GPUKind, forward_s: float, backward_s: float) -> DataParallelTraffic:
    """One optimizer step's data-parallel traffic as DeepSpeed sends it.

    trainable: the rank's trainable parameter sizes in the order backward produces their gradients
    (frozen ones send nothing); groups: the trainable elements of each optimizer param group; held:
    every parameter it holds, frozen included (ZeRO-3 gathers them). ZeRO-0/1 reduce once per step (at
    the accumulation boundary), ZeRO-2/3 every micro-batch. ZeRO-1/2 then all-gather the updated
    parameters, one all-gather per param group padded to 2·dp elements (all_gather_dp_groups), after
    the step: exposed.
    ZeRO-3 all-gathers the partitioned parameters in every forward, prefetched while forward computes;
    with DeepSpeed's default stage3_max_reuse_distance they stay gathered into backward at these sizes.
    """
    if setup.dp == 1:
        return DataParallelTraffic(0.0, 0.0, 0.0)
    group, n, e = Group(setup.dp, setup.stride), setup.dp, setup.dtype_bytes
    reductions = setup.micro_batches if setup.zero_stage >= 2 else 1
    moved, busy, exposed = (reductions * x for x in gradient_reduce_s(trainable, setup, gpu, backward_s))
    if setup.zero_stage in (1, 2):
        padded = [math.ceil(g / (2 * n)) * 2 * n for g in groups]
        gather = [all_gather_s(e * g, gpu, group) for g in padded]
        moved += (n - 1) / n * e * sum(padded)
        busy += sum(gather)
        exposed += sum(gather)
    if setup.zero_stage == 3:
        partitioned = sum(x for x in held if x > setup.persistence_threshold)
        gather = all_gather_s(e * partitioned, gpu, group)
        first = all_gather_s(e * min(partitioned, setup.reduce_bucket_elements), gpu, group)
        moved += setup.micro_batches * (n - 1) / n * e * partitioned
        busy += setup.micro_batches * gather
        exposed += setup.micro_batches * max(first, gather - forward_s)
    return DataParallelTraffic(moved, busy, exposed)


# ------------------------------------------------------------------ tensor and pipeline parallelism
def tensor_parallel_all_reduces(layers: int, first: bool, last: bool, recompute: bool) -> int:
    """megatron-core's activation all-reduces in one micro-batch's forward and backward, without
    sequence parallelism: per transformer layer the attention's and the MLP's row-parallel output
    (forward) and the column-parallel QKV and first MLP input gradients (backward); the recomputed
    forward of activation checkpointing repeats the forward two; the vocab-parallel embedding's output
    (first stage) and the output layer's input gradient (last stage). The loss's three all-reduces of
    one fp32 per token are left out (a thousandth of these bytes)."""
    per_layer = 4 + (2 if recompute else 0)
    return layers * per_layer + int(first) + int(last)


def tensor_parallel_s(tokens: int, hidden: int, dtype_bytes: int, all_reduces: int, gpu: GPUKind,
                      tp: int) -> float:
    """The all-reduces' time: on the compute stream, so all of it is exposed."""
    return all_reduces * all_reduce_s(tokens * hidden * dtype_bytes, gpu, Group(tp))


def pipeline_bubble_fraction(stages: int, micro_batches: int) -> float:
    """The idle share of DeepSpeed's 1F1B TrainSchedule: (p−1)/(m+p−1)."""
    return (stages - 1) / (micro_batches + stages - 1)
