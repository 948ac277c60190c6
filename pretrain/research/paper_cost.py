"""What the research plan's experiments cost at paper scale: GPU-hours per spec from the speed plan's step
time, and whether every run fits its GPUs (the memory plan).

    python -m pretrain.research.paper_cost [--specs core a1 ...] [--gpu a100|h100|h200] [--compiled] [--json]

Each spec's runs at its paper scale (every arm × seed; e.g. the Small preset, 100k steps of 128
sequences of 512 tokens, on one node of 8 GPUs): a run's GPU-hours are its train.steps × the step time
`pretrain.research.speed_plan` predicts for its layout on the GPU kind (compute from the step-time
model, the communication DeepSpeed leaves exposed, the optimizer step) × its GPUs; its MFU is the
training loop's FLOP count (`pretrain.runtime.accounting.flops_per_token`: frozen Q/K without weight
gradients, Hadamard Q/K as their contractions) at that speed. Evaluation passes are left out (at the
presets' eval settings about 2% of the training FLOPs). The memory verdict is the speed plan's
(`pretrain.research.memory_model` on the GPU kind's memory).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from pretrain.research.speed.gpus import GPU_KINDS, GPUS_PER_NODE, gpu_kind
from pretrain.research.speed_plan import STEP_TIME_MODEL, ComputeModel, SpeedPlanner
from pretrain.research.sweep.spec import SweepError, expand, load_spec
from pretrain.run_files.run_dir import config_hash

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"
SCALE = "paper"


@dataclass
class SpecCost:
    spec: str
    runs: int
    gpus_per_run: int
    tokens_per_run: tuple[int, int]  # the fewest and the most
    step_s: tuple[float, float]  # the fastest and the slowest arm's step
    mfu: tuple[float, float]  # the lowest and the highest
    gpu_hours_per_run: tuple[float, float]  # the cheapest and the dearest arm
    gpu_hours: float
    node_days: float  # on nodes of GPUS_PER_NODE
    runs_that_fit: int


def spec_cost(name: str, planner: SpeedPlanner, compiled: bool) -> SpecCost:
    spec = load_spec(EXPERIMENTS / f"{name}.yaml")
    runs = expand(spec, SCALE, None, [], Path("runs") / "paper_cost")
    plans, tokens = [], []
    known: dict[str, dict] = {}
    for run in runs:
        cfg = replace(run.cfg, speed=replace(run.cfg.speed, compile=True)) if compiled else run.cfg
        tokens.append(cfg.train.steps * cfg.tokens_per_step)
        unseeded = config_hash(replace(cfg, model=replace(cfg.model, seed=0), data=replace(cfg.data, seed=0)))
        if unseeded not in known:  # the seeds change neither what a run holds nor its speed
            known[unseeded] = planner.plan(cfg, run.scale.processes_per_node)
        plans.append(known[unseeded])
    hours = [p["gpu_hours"] for p in plans]
    total = sum(hours)
    return SpecCost(spec=name, runs=len(runs), gpus_per_run=runs[0].scale.processes_per_node,
                    tokens_per_run=(min(tokens), max(tokens)),
                    step_s=(min(p["step_s"]["total"] for p in plans), max(p["step_s"]["total"] for p in plans)),
                    mfu=(min(p["mfu"] for p in plans), max(p["mfu"] for p in plans)),
                    gpu_hours_per_run=(min(hours), max(hours)), gpu_hours=total,
                    node_days=total / GPUS_PER_NODE / 24,
                    runs_that_fit=sum(p["memory"]["verdict"] == "fits" for p in plans))


def _range(pair: tuple[float, float], unit: float, spec: str) -> str:
    low, high = (format(v / unit, spec) for v in pair)
    return low if low == high else f"{low}–{high}"


def table(costs: list[SpecCost], gpu: str, compiled: bool) -> str:
    lines = [f"paper scale on {gpu}, {'compiled' if compiled else 'eager'}, at the speed plan's step time",
             "| spec | runs | GPUs a run | tokens a run | step ms | MFU | GPU-hours a run | GPU-hours "
             "| days on one node | fit |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in costs:
        lines.append(f"| {c.spec} | {c.runs} | {c.gpus_per_run} | {_range(c.tokens_per_run, 1e9, '.2f')} B | "
                     f"{_range(c.step_s, 1e-3, '.1f')} | {_range(c.mfu, 0.01, '.0f')}% | "
                     f"{_range(c.gpu_hours_per_run, 1, '.1f')} | "
                     f"{c.gpu_hours:,.0f} | {c.node_days:,.1f} | {c.runs_that_fit} of {c.runs} |")
    total = sum(c.gpu_hours for c in costs)
    runs = sum(c.runs for c in costs)
    lines.append(f"| all | {runs} | | | | | | {total:,.0f} | {total / GPUS_PER_NODE / 24:,.1f} | |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    specs = sorted(p.stem for p in EXPERIMENTS.glob("*.yaml") if p.stem != "common")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--specs", nargs="+", default=specs, choices=specs, metavar="SPEC",
                        help=f"specs of pretrain/experiments/ (default: all: {', '.join(specs)})")
    parser.add_argument("--gpu", default="h100", choices=sorted(GPU_KINDS), help="the GPU kind (default h100)")
    parser.add_argument("--compiled", action="store_true",
                        help="every run with speed.compile (the layers under torch.compile)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None, compute: ComputeModel = STEP_TIME_MODEL) -> int:
    args = parse_args(argv)
    gpu = gpu_kind(args.gpu)
    try:
        # DeepSpeed, imported by the FLOP count and the memory plan, logs a line to stdout: stdout is the result
        with contextlib.redirect_stdout(sys.stderr):
            from pretrain.checkpoint.consolidate import tp1_parallel_state

            with tp1_parallel_state():  # held across every spec: the cuts' builds and the traces join it
                planner = SpeedPlanner(gpu, compute)
                costs = [spec_cost(name, planner, args.compiled) for name in args.specs]
    except SweepError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"gpu": gpu.name, "compiled": args.compiled, "specs": [asdict(c) for c in costs]}, indent=1))
    else:
        print(table(costs, gpu.name, args.compiled))
    return 0


if __name__ == "__main__":
    sys.exit(main())
