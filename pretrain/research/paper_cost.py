"""What the research plan's experiments cost at paper scale: GPU-hours per spec from the project's FLOP
count and an MFU, and whether every run fits its GPUs (the memory plan).

    python -m pretrain.research.paper_cost [--specs core a1 ...] [--gpu "H100 SXM"] [--mfu 0.40] [--json]

Each spec's runs at its paper scale (every arm × seed; e.g. the Small preset, 100k steps of 128
sequences of 512 tokens, on one node of 8 GPUs): training FLOPs = steps × global batch × sequence
length × `pretrain.runtime.accounting.flops_per_token` (the count the training loop's MFU is measured
against: frozen Q/K without weight gradients, Hadamard Q/K as their contractions, attention scores
included), and GPU-hours = FLOPs / (the GPU's dense bf16 peak × MFU). Evaluation passes are left out
(at the presets' eval settings about 2% of the training FLOPs). No MFU has been measured on a GPU
yet: the default 0.40 is the target for Base on one H100, and the figure scales as 1 / MFU. The
memory verdict is `pretrain.research.memory_plan`'s for the run's layout and the GPU's memory.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from pretrain.config.run_config import RunConfig
from pretrain.research.sweep.spec import SweepError, expand, load_spec
from pretrain.run_files.run_dir import config_hash

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"
SCALE = "paper"
GPU_MEMORY_GB = {"A100": 80.0, "H100 SXM": 80.0, "H100 PCIe": 80.0, "H100 NVL": 94.0, "H200 SXM": 141.0}
GPUS_PER_NODE = 8


@dataclass
class SpecCost:
    spec: str
    runs: int
    gpus_per_run: int
    tokens_per_run: tuple[int, int]  # the fewest and the most
    gpu_hours_per_run: tuple[float, float]  # the cheapest and the dearest arm
    gpu_hours: float
    node_days: float  # on nodes of GPUS_PER_NODE
    runs_that_fit: int


def run_flops(cfg: RunConfig) -> tuple[int, float]:
    """(training tokens, training FLOPs) of one run."""
    from pretrain.runtime.accounting import flops_per_token

    tokens = cfg.train.steps * cfg.tokens_per_step
    return tokens, tokens * flops_per_token(cfg.model)


def fits(cfg: RunConfig, world_size: int, gpu_memory_gb: float) -> bool:
    """The memory plan's verdict for the run's layout (megatron's parallel state held for the build)."""
    from ora_megatron.parallel import destroy_distributed, init_distributed
    from pretrain.research.memory_model import plan

    init_distributed(1, 1, backend="gloo")
    try:
        return plan(cfg, world_size, gpu_memory_gb)["verdict"] == "fits"
    finally:
        destroy_distributed()


def spec_cost(name: str, peak_tflops: float, mfu: float, gpu_memory_gb: float) -> SpecCost:
    spec = load_spec(EXPERIMENTS / f"{name}.yaml")
    runs = expand(spec, SCALE, None, [], Path("runs") / "paper_cost")
    hours, tokens, fitting, verdicts = [], [], 0, {}
    for run in runs:
        run_tokens, flops = run_flops(run.cfg)
        tokens.append(run_tokens)
        hours.append(flops / (peak_tflops * 1e12 * mfu) / 3600)
        cfg = run.cfg
        unseeded = config_hash(replace(cfg, model=replace(cfg.model, seed=0), data=replace(cfg.data, seed=0)))
        if unseeded not in verdicts:  # the seeds do not change what a run holds
            verdicts[unseeded] = fits(run.cfg, run.scale.processes_per_node, gpu_memory_gb)
        fitting += verdicts[unseeded]
    total = sum(hours)
    return SpecCost(spec=name, runs=len(runs), gpus_per_run=runs[0].scale.processes_per_node,
                    tokens_per_run=(min(tokens), max(tokens)),
                    gpu_hours_per_run=(min(hours), max(hours)), gpu_hours=total,
                    node_days=total / GPUS_PER_NODE / 24, runs_that_fit=fitting)


def _range(pair: tuple[float, float], unit: float, spec: str) -> str:
    low, high = (format(v / unit, spec) for v in pair)
    return low if low == high else f"{low}–{high}"


def table(costs: list[SpecCost], gpu: str, mfu: float) -> str:
    lines = [f"paper scale on {gpu} at MFU {mfu:.0%} (GPU-hours scale as 1 / MFU)",
             "| spec | runs | GPUs a run | tokens a run | GPU-hours a run | GPU-hours | days on one node | fit |",
             "|---|---|---|---|---|---|---|---|"]
    for c in costs:
        lines.append(f"| {c.spec} | {c.runs} | {c.gpus_per_run} | {_range(c.tokens_per_run, 1e9, '.2f')} B | "
                     f"{_range(c.gpu_hours_per_run, 1, '.1f')} | "
                     f"{c.gpu_hours:,.0f} | {c.node_days:,.1f} | {c.runs_that_fit} of {c.runs} |")
    total = sum(c.gpu_hours for c in costs)
    lines.append(f"| all | {sum(c.runs for c in costs)} | | | | {total:,.0f} | {total / GPUS_PER_NODE / 24:,.1f} | |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    specs = sorted(p.stem for p in EXPERIMENTS.glob("*.yaml") if p.stem != "common")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--specs", nargs="+", default=specs, choices=specs, metavar="SPEC",
                        help=f"specs of pretrain/experiments/ (default: all: {', '.join(specs)})")
    parser.add_argument("--gpu", default="H100 SXM", choices=sorted(GPU_MEMORY_GB), help="default: H100 SXM")
    parser.add_argument("--mfu", type=float, default=0.40, help="model FLOP utilisation, in (0, 1] (default 0.40)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not 0 < args.mfu <= 1:
        print(f"error: --mfu must be in (0, 1], got {args.mfu}", file=sys.stderr)
        return 2
    try:
        # DeepSpeed, imported by the FLOP count and the memory plan, logs a line to stdout: stdout is the result
        with contextlib.redirect_stdout(sys.stderr):
            from pretrain.runtime.accounting import PEAK_TFLOPS

            peak = PEAK_TFLOPS[args.gpu]["bf16"]
            costs = [spec_cost(name, peak, args.mfu, GPU_MEMORY_GB[args.gpu]) for name in args.specs]
    except SweepError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"gpu": args.gpu, "peak_tflops": peak, "mfu": args.mfu,
                          "specs": [asdict(c) for c in costs]}, indent=1))
    else:
        print(table(costs, args.gpu, args.mfu))
    return 0


if __name__ == "__main__":
    sys.exit(main())
