"""Speed plan of a run on a cluster: one optimizer step's time (compute, exposed communication, pipeline
bubble), tokens/s, MFU, and the GPU-hours and days of the config's train.steps; with --rank, every layout
that fits the GPUs' memory, ranked by tokens/s.

    python -m pretrain.research.speed_plan --config PRESET|FILE [--set k=v ...] --gpu a100|h100|h200
        --nodes N [--tp T] [--pp P] [--zero-stage Z] [--micro-batch M] [--precision P]
        [--activation-checkpointing] [--compiled] [--json]
    python -m pretrain.research.speed_plan --config PRESET --gpu h100 --rank [--nodes N ...] [--top K]

Compute (one micro-batch's forward and backward on one GPU, the optimizer step) is the step-time model's
(pretrain.research.speed); communication is pretrain.research.speed.comms's; the memory verdict is
pretrain.research.memory_model's. Nodes hold 8 GPUs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import yaml

from ora_megatron.builder import padded_vocab_size
from ora_megatron.config_io import ConfigError
from pretrain.config.run_config import RunConfig, for_world
from pretrain.research import memory_model
from pretrain.research.memory_plan import add_config_flags, load_config
from pretrain.research.speed import comms
from pretrain.research.speed.code_versions import GradientWork
from pretrain.research.speed.gpus import GPU_KINDS, GPUS_PER_NODE, GPUKind, gpu_kind

# Backward computes two matmuls (input and weight gradients) for each of forward's: 2/3 of a micro-batch's
# compute (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters", §5.1).
BACKWARD_SHARE = 2 / 3
TP_SIZES = (1, 2, 4, 8)  # a tensor group stays on one node's NVLink
RANK_NODES = (1, 2, 4, 8, 16)
# ZeRO-3's per-module parameter hooks cost host time the step-time model does not count, and eager steps
# of these models are host-bound: ranked beside the others it would win on a missing cost. --zero-stage 3
# ranks it alone.
RANKED_ZERO_STAGES = (0, 1, 2)


@dataclass(frozen=True)
class ComputeTimes:
    forward_backward_s: float  # one micro-batch through the whole model at the layout's TP, on one GPU
    optimizer_s: float  # one optimizer step over the elements one GPU steps


@dataclass(frozen=True)
class ComputeModel:
    """Compute times on one GPU: forward and backward of one micro-batch of the config's size on the
    config's tensor-parallel shard; the optimizer step over a number of elements."""

    micro_batch_s: Callable[[RunConfig, GPUKind], float]  # (config, GPU kind); compiled: speed.compile
    # (GPU kind, elements one GPU's optimizer steps, what it does with its gradients): the step's stretch
    # after its micro-batches
    optimizer_s: Callable[[GPUKind, int, GradientWork], float]


def _modelled_micro_batch_s(cfg: RunConfig, gpu: GPUKind) -> float:
    from pretrain.research.speed.step_time import micro_batch_time

    return micro_batch_time(cfg, gpu, cfg.train.micro_batch_size, cfg.parallel.tensor, cfg.speed.compile).seconds


def _modelled_optimizer_s(gpu: GPUKind, stepped: int, gradients: GradientWork) -> float:
    from pretrain.research.speed.step_time import optimizer_step_time

    return optimizer_step_time(gpu, stepped, gradients=gradients).seconds


# The step-time model's (pretrain.research.speed.step_time, docs/speed_model.md).
STEP_TIME_MODEL = ComputeModel(_modelled_micro_batch_s, _modelled_optimizer_s)


class SpeedPlanner:
    """Evaluates layouts of one config on one GPU kind; the model's parameters, cut by TP and PP, are
    built once per cut (on the meta device, in megatron's TP=1 state: joined if held, else set up for the build)."""

    def __init__(self, gpu: GPUKind, compute: ComputeModel):
        self.gpu, self.compute = gpu, compute
        self._cuts: dict[str, tuple[list, list]] = {}
        self._micro_batch_s: dict[str, float] = {}

    def cut(self, cfg: RunConfig) -> tuple[list, list[list[memory_model.Shard]]]:
        key = repr((cfg.model, cfg.parallel, cfg.freeze.stages, cfg.optimizer.weight_decay))
        if key not in self._cuts:
            from pretrain.checkpoint.consolidate import tp1_parallel_state  # imports DeepSpeed, which logs to stdout

            stages = memory_model.pipeline_stages(cfg.model, cfg.parallel)
            with tp1_parallel_state():
                self._cuts[key] = stages, memory_model.stage_shards(cfg, stages)
        return self._cuts[key]

    def compute_times(self, cfg: RunConfig, layout: memory_model.Layout, shards: list) -> ComputeTimes:
        """The compute model's times; a micro-batch's once per model, data, micro-batch and TP size; the
        optimizer's stretch on the stage that takes longest."""
        key = repr((cfg.model, cfg.data, cfg.train.micro_batch_size, cfg.speed.compile, cfg.parallel.tensor))
        if key not in self._micro_batch_s:
            self._micro_batch_s[key] = self.compute.micro_batch_s(cfg, self.gpu)
        optimizer_s = max(
            self.compute.optimizer_s(self.gpu, memory_model.optimizer_elements(held, layout), GradientWork(
                tuple(s.numel for s in held if s.trainable), layout.grad_accum, layout.zero_stage))
            for held in shards)
        return ComputeTimes(self._micro_batch_s[key], optimizer_s)

    def memory(self, cfg: RunConfig, layout: memory_model.Layout) -> dict:
        """memory_model.plan's verdict and total for the rank holding the most, from the cached cut."""
        stages, shards = self.cut(cfg)
        zero = memory_model.zero_config(cfg, layout)
        gpu_memory = int(self.gpu.memory_gb * memory_model.GIB)
        plans = [memory_model.stage_plan(cfg.model, layout, zero, k, specs, held, gpu_memory)
                 for k, (specs, held) in enumerate(zip(stages, shards))]
        worst = max(plans, key=lambda p: p["bytes"]["total"])
        return {"total_bytes": worst["bytes"]["total"], "verdict": worst["verdict"]}

    def plan(self, cfg: RunConfig, world_size: int) -> dict:
        """The speed plan of `cfg` on `world_size` GPUs (config errors, naming the key, for a layout it
        cannot run)."""
        layout = memory_model.layout_of(cfg, world_size)
        cfg = for_world(cfg, world_size)
        stages, shards = self.cut(cfg)
        times = self.compute_times(cfg, layout, shards)
        step, traffic = step_time(cfg, layout, stages, shards, self.gpu, times)
        total = step["total"]
        tokens_per_s = cfg.tokens_per_step / total
        return {
            "layout": {**layout.to_json(), "nodes": world_size // GPUS_PER_NODE},
            "gpu": self.gpu.name, "compiled": cfg.speed.compile,
            "memory": self.memory(cfg, layout),
            "step_s": step,
            "data_parallel": {"bytes": traffic.bytes_sent, "busy_s": traffic.busy_s, "exposed_s": traffic.exposed_s},
            "tokens_per_s": tokens_per_s,
            "mfu": flops_per_token(cfg) * tokens_per_s / (world_size * self.gpu.bf16_dense_flops),
            "steps": cfg.train.steps,
            "gpu_hours": cfg.train.steps * total * world_size / 3600,
            "days": cfg.train.steps * total / 86400,
            "caveats": caveats(layout),
        }


def caveats(layout: memory_model.Layout) -> list[str]:
    """What the plan leaves out for this layout."""
    notes = []
    if layout.zero_stage == 3:
        notes.append("ZeRO-3: the host time of DeepSpeed's per-module parameter hooks (fetch and release in "
                     "forward and backward) is not counted: its step is a lower bound")
    if layout.parallel.pipeline > 1:
        notes.append("pipeline: every stage is given 1/p of the micro-batch's compute; the end stages' "
                     "embedding and output layer make them slower")
    return notes


def flops_per_token(cfg: RunConfig) -> float:
    from pretrain.runtime.accounting import flops_per_token as count

    return count(cfg.model)


def data_parallel_setup(cfg: RunConfig, layout: memory_model.Layout, pipelined: bool) -> comms.DataParallelSetup:
    zero = memory_model.zero_config(cfg, layout)
    return comms.DataParallelSetup(
        zero_stage=layout.zero_stage, dp=layout.parallel.data, stride=layout.parallel.tensor,
        dtype_bytes=layout.dtype_bytes, micro_batches=layout.grad_accum,
        # ds_config turns overlap_comm on for ZeRO ≥ 1 on CUDA; DeepSpeed's pipeline engine turns it off.
        overlap=layout.zero_stage > 0 and not pipelined,
        reduce_bucket_elements=int(zero.reduce_bucket_size),
        persistence_threshold=int(zero.param_persistence_threshold))


def stage_traffic(cfg: RunConfig, layout: memory_model.Layout, stages: list, shards: list,
                  gpu: GPUKind, times: ComputeTimes) -> tuple[float, comms.DataParallelTraffic]:
    """(TP seconds of one micro-batch, data-parallel traffic of one step) on the stage that waits longest."""
    p, model = layout.parallel.pipeline, cfg.model
    tokens = layout.micro_batch_size * model.seq_length
    forward = times.forward_backward_s * (1 - BACKWARD_SHARE) / p
    backward = times.forward_backward_s * BACKWARD_SHARE / p
    setup = data_parallel_setup(cfg, layout, pipelined=p > 1)
    tp_s, worst = 0.0, None
    for k, (specs, held) in enumerate(zip(stages, shards)):
        layers = sum(spec.cls is memory_model.DecoderLayerStage for spec in specs)
        all_reduces = comms.tensor_parallel_all_reduces(layers, k == 0, k == p - 1, layout.activation_checkpointing)
        tp_s = max(tp_s, comms.tensor_parallel_s(tokens, model.hidden_size, layout.dtype_bytes, all_reduces, gpu,
                                                 layout.parallel.tensor))
        trainable = [s.numel for s in reversed(held) if s.trainable]  # backward runs the stage in reverse
        groups: dict[str, int] = {}
        for shard in held:
            if shard.trainable:
                groups[shard.group] = groups.get(shard.group, 0) + shard.numel
        traffic = comms.data_parallel_traffic(trainable, list(groups.values()), [s.numel for s in held], setup,
                                              gpu, forward, backward)
        worst = traffic if worst is None or traffic.exposed_s > worst.exposed_s else worst
    return tp_s, worst


def step_time(cfg: RunConfig, layout: memory_model.Layout, stages: list, shards: list, gpu: GPUKind,
              times: ComputeTimes) -> tuple[dict[str, float], comms.DataParallelTraffic]:
    """One optimizer step's parts, in seconds, and its data-parallel traffic: m micro-batches through p
    stages in DeepSpeed's 1F1B schedule, each stage's slot its share of the compute, its TP all-reduces
    and (p > 1) the activation sent forward and its gradient sent back; then the exposed data-parallel
    traffic, the tied embedding's gradient all-reduce between the end stages (p > 1), and the optimizer
    step."""
    p, m, model = layout.parallel.pipeline, layout.grad_accum, cfg.model
    tp_s, traffic = stage_traffic(cfg, layout, stages, shards, gpu, times)
    activation = layout.micro_batch_size * model.seq_length * model.hidden_size * layout.dtype_bytes
    neighbours_share_node = layout.parallel.world_size <= GPUS_PER_NODE
    p2p = 2 * comms.send_s(activation, gpu, neighbours_share_node) if p > 1 else 0.0
    slot = times.forward_backward_s / p + tp_s + p2p
    tied = 0.0
    if p > 1 and any(spec.tied_key for spec in stages[-1]):  # DeepSpeed's ReduceTiedGrads: the shared embedding
        ends = comms.Group(2, stride=layout.parallel.world_size // p * (p - 1))
        tied = comms.all_reduce_s(padded_vocab_size(model) * model.hidden_size // layout.parallel.tensor
                                  * layout.dtype_bytes, gpu, ends)
    parts = {
        "compute": m * times.forward_backward_s / p,
        "tensor_parallel": m * tp_s,
        "pipeline_p2p": m * p2p,
        "bubble": (p - 1) * slot,
        "data_parallel": traffic.exposed_s + tied,
        "optimizer": times.optimizer_s,
    }
    return {**parts, "total": sum(parts.values())}, traffic


# ------------------------------------------------------------------ ranking
def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_overrides(cfg: RunConfig, world_size: int, args: argparse.Namespace) -> Iterator[list[str]]:
    """Every TP × PP × ZeRO stage (RANKED_ZERO_STAGES) × micro-batch on `world_size` GPUs, for the sizes no
    flag fixed; the global batch fixes the accumulation."""
    tps = [args.tp] if args.tp else [t for t in TP_SIZES if t <= world_size]
    pps = [args.pp] if args.pp else [2**k for k in range(cfg.model.num_layers.bit_length()) if 2**k <= world_size]
    zeros = [args.zero_stage] if args.zero_stage is not None else list(RANKED_ZERO_STAGES)
    for tp in tps:
        for pp in pps:
            if world_size % (tp * pp) or cfg.train.global_batch_size % (world_size // (tp * pp)):
                continue
            per_rank = cfg.train.global_batch_size // (world_size // (tp * pp))
            for zero in zeros:
                for mb in [args.micro_batch] if args.micro_batch else divisors(per_rank):
                    yield [f"parallel.tensor={tp}", f"parallel.pipeline={pp}", f"deepspeed.zero_stage={zero}",
                           f"train.micro_batch_size={mb}"]


def compile_override(args: argparse.Namespace) -> list[str]:
    """--compiled as the key it stands for (its checks then apply: no ZeRO-3)."""
    return ["speed.compile=true"] if args.compiled else []


def ranked(planner: SpeedPlanner, args: argparse.Namespace, nodes: list[int]) -> dict:
    """Every layout over `nodes` that the config can run and that fits, fastest first."""
    base = load_config(args, compile_override(args))[1]
    fitting, refused, too_big = [], 0, 0
    for count in nodes:
        world = count * GPUS_PER_NODE
        for layout_overrides in candidate_overrides(base, world, args):
            try:
                cfg = load_config(args, compile_override(args) + layout_overrides)[1]
                layout = memory_model.layout_of(cfg, world)
            except ConfigError:
                refused += 1
                continue
            if planner.memory(for_world(cfg, world), layout)["verdict"] != "fits":
                too_big += 1
                continue
            fitting.append(planner.plan(cfg, world))
    fitting.sort(key=lambda r: (-r["tokens_per_s"], r["gpu_hours"]))
    return {"layouts": fitting, "refused_by_config": refused, "do_not_fit": too_big}


# ------------------------------------------------------------------ output
def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f}"


def _gib(n: float) -> str:
    return f"{n / memory_model.GIB:,.2f}"


def describe(result: dict) -> str:
    lay = result["layout"]
    return (f"{lay['nodes']} node{'s' if lay['nodes'] > 1 else ''}: TP {lay['tensor']} × PP {lay['pipeline']} × "
            f"DP {lay['data']}, ZeRO-{lay['zero_stage']}, {lay['precision']}, micro-batch {lay['micro_batch_size']} "
            f"(accumulation {lay['grad_accum']})")


STEP_LABELS = {"compute": "compute", "tensor_parallel": "tensor-parallel all-reduces",
               "pipeline_p2p": "pipeline sends", "bubble": "pipeline bubble",
               "data_parallel": "data-parallel (exposed)", "optimizer": "gradients and optimizer", "total": "step"}


def table(config: str, result: dict) -> str:
    dp, mem = result["data_parallel"], result["memory"]
    mode = "compiled" if result["compiled"] else "eager"
    lines = [f"{config} on {result['gpu']}, {mode}, {describe(result)}",
             f"memory: {_gib(mem['total_bytes'])} GiB on the rank holding the most, {mem['verdict']}",
             f"{'per step':<32}{'ms':>10}"]
    lines += [f"{label:<32}{_ms(result['step_s'][key]):>10}" for key, label in STEP_LABELS.items()]
    lines += [f"data-parallel traffic: {dp['bytes'] / 1e9:,.3f} GB a step, busy {_ms(dp['busy_s'])} ms, "
              f"exposed {_ms(dp['exposed_s'])} ms",
              f"tokens/s {result['tokens_per_s']:,.0f}, MFU {result['mfu']:.1%} (of the bf16 dense peak)",
              f"train.steps {result['steps']:,}: {result['gpu_hours']:,.0f} GPU-hours, {result['days']:,.2f} days",
              *(f"caveat: {note}" for note in result["caveats"])]
    return "\n".join(lines)


def rank_table(config: str, gpu: GPUKind, compiled: bool, ranking: dict, top: int) -> str:
    mode = "compiled" if compiled else "eager"
    shown = ranking["layouts"][:top]
    lines = [f"{config} on {gpu.name}, {mode}: {len(ranking['layouts'])} layouts fit "
             f"({ranking['do_not_fit']} do not, {ranking['refused_by_config']} refused by the config); "
             f"the {len(shown)} fastest",
             "| nodes | TP | PP | DP | ZeRO | micro-batch | accum | step ms | compute | comm exposed | bubble "
             "| grads + optimizer | tokens/s | MFU | GPU-hours | days | GiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in shown:
        lay, s = r["layout"], r["step_s"]
        comm = s["tensor_parallel"] + s["pipeline_p2p"] + s["data_parallel"]
        zero = f"{lay['zero_stage']}{'*' if r['caveats'] else ''}"
        lines.append(f"| {lay['nodes']} | {lay['tensor']} | {lay['pipeline']} | {lay['data']} | {zero} "
                     f"| {lay['micro_batch_size']} | {lay['grad_accum']} | {_ms(s['total'])} | {_ms(s['compute'])} "
                     f"| {_ms(comm)} | {_ms(s['bubble'])} | {_ms(s['optimizer'])} | {r['tokens_per_s']:,.0f} "
                     f"| {r['mfu']:.1%} "
                     f"| {r['gpu_hours']:,.0f} | {r['days']:,.2f} | {_gib(r['memory']['total_bytes'])} |")
    notes = sorted({note for r in shown for note in r["caveats"]})
    lines += [f"* {note}" for note in notes]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_config_flags(parser)
    parser.add_argument("--gpu", required=True, choices=sorted(GPU_KINDS), help="the GPU kind")
    parser.add_argument("--nodes", type=int, nargs="+", help=f"nodes of {GPUS_PER_NODE} GPUs (with --rank: "
                        f"those to rank over, default {' '.join(map(str, RANK_NODES))})")
    parser.add_argument("--compiled", action="store_true", help="speed.compile=true: the layers under torch.compile")
    parser.add_argument("--rank", action="store_true", help="rank every layout that fits by tokens/s")
    parser.add_argument("--top", type=int, default=20, help="with --rank: how many to print (default 20)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser.parse_args(argv)


def checked_nodes(args: argparse.Namespace) -> list[int]:
    if not args.rank and (args.nodes is None or len(args.nodes) != 1):
        raise ConfigError("--nodes", "give one node count (several only with --rank)")
    nodes = args.nodes or list(RANK_NODES)
    if min(nodes) < 1:
        raise ConfigError("--nodes", f"must be at least 1, got {min(nodes)}")
    return nodes


def main(argv: list[str] | None = None, compute: ComputeModel | None = None) -> int:
    compute = compute or STEP_TIME_MODEL
    args = parse_args(argv)
    try:
        nodes = checked_nodes(args)
        path, cfg = load_config(args, compile_override(args))
        if not args.rank:
            memory_model.layout_of(cfg, nodes[0] * GPUS_PER_NODE)  # refuse a bad layout before building anything
    except (ConfigError, OSError, yaml.YAMLError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    gpu = gpu_kind(args.gpu)
    with contextlib.redirect_stdout(sys.stderr):
        from pretrain.checkpoint.consolidate import tp1_parallel_state  # imports DeepSpeed, which logs to stdout

        with tp1_parallel_state():  # held across the plan: the cuts' builds and the traces join it
            planner = SpeedPlanner(gpu, compute)
            result = ranked(planner, args, nodes) if args.rank else planner.plan(cfg, nodes[0] * GPUS_PER_NODE)
    if args.json:
        print(json.dumps({"config": str(path), **result}, indent=1))
    elif args.rank:
        print(rank_table(path.name, gpu, cfg.speed.compile, result, args.top))
    else:
        print(table(path.name, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

