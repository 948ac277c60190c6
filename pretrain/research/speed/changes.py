"""The modeled effect of the step changes the op audit led to (docs/speed_audit.md), by the speed model.

    python -m pretrain.research.speed.changes [--configs small base] [--gpus h100 h200] [--micro-batch 64]

For each preset, GPU kind and mode (eager, compiled), our step's modeled ms before and after each change:

- `fused_adamw`: torch's fused AdamW on CUDA (pretrain.runtime.optimizer.adamw_implementation) against the
  foreach AdamW before it: the optimizer stretch's kernels (`code_versions.CodeVersion.fused_adamw`);
- `cuda_graphs` (speed.cuda_graphs, compiled only): the compiled loss replayed as one CUDA graph, its chunk
  loop's kernels issued at `kernel_s` rather than `host_s_per_op` each; the compiled layers already are
  (the speed model charges compiled kernels no Python). Its effect is the host time it removes from a
  micro-batch's stretch, which shortens the step only where the host bounds that stretch.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from pretrain.research.speed.code_versions import code_version
from pretrain.research.speed.cost import stretch_cost
from pretrain.research.speed.gpus import GPU_KINDS, GPUKind
from pretrain.research.speed.step_time import (
    TRACE_CACHE,
    load_config,
    one_gpu_optimizer_ops,
    parameter_sizes,
    step_ops,
)


def step_ms(cfg, gpu: GPUKind, micro_batch: int, compiled: bool, fused_adamw: bool, cuda_graphs: bool,
            cache: Path | None = TRACE_CACHE) -> dict:
    """Our step at HEAD's code with the two changes on or off: step, micro-batch host and device ms."""
    step = step_ops(cfg, micro_batch, "HEAD", cache)
    code = replace(code_version("HEAD"), fused_adamw=fused_adamw)
    ops, micro_batches = step.micro_batch, step.micro_batches
    micro = stretch_cost(ops, gpu, compiled)
    host = micro.host_s
    if cuda_graphs and compiled:
        graphed = sum(op.name.startswith("loss.") for op in ops)
        host -= graphed * (gpu.constants.host_s_per_op - gpu.constants.kernel_s)
    optimizer = stretch_cost(one_gpu_optimizer_ops(parameter_sizes(cfg, cache), micro_batches, code), gpu,
                             compiled=False)
    return {"step_ms": (micro_batches * max(micro.device_s, host) + optimizer.seconds) * 1e3,
            "micro_batch_host_ms": host * 1e3, "micro_batch_device_ms": micro.device_s * 1e3}


def rows(configs: list[str], gpus: list[str], micro_batch: int) -> list[dict]:
    out = []
    for preset in configs:
        cfg = load_config(preset, [])
        for key in gpus:
            gpu = GPU_KINDS[key]
            for compiled in (False, True):
                before = step_ms(cfg, gpu, micro_batch, compiled, fused_adamw=False, cuda_graphs=False)
                fused = step_ms(cfg, gpu, micro_batch, compiled, fused_adamw=True, cuda_graphs=False)
                graphs = step_ms(cfg, gpu, micro_batch, compiled, fused_adamw=True, cuda_graphs=True)
                out.append({"config": preset, "gpu": key, "mode": "compiled" if compiled else "eager",
                            "before_ms": before["step_ms"],
                            "fused_adamw_saves_ms": before["step_ms"] - fused["step_ms"],
                            "cuda_graphs_saves_ms": fused["step_ms"] - graphs["step_ms"],
                            "cuda_graphs_host_saved_ms": fused["micro_batch_host_ms"] - graphs["micro_batch_host_ms"],
                            "after_ms": graphs["step_ms"] if compiled else fused["step_ms"]})
    return out


def markdown(table: list[dict]) -> str:
    lines = ["| preset | GPU | mode | before ms | fused AdamW saves | CUDA graphs save (host a micro-batch) "
             "| after ms |",
             "|---|---|---|---|---|---|---|"]
    for r in table:
        graphs = (f"{r['cuda_graphs_saves_ms']:.2f} ({r['cuda_graphs_host_saved_ms']:.2f})"
                  if r["mode"] == "compiled" else "–")
        lines.append(f"| {r['config']} | {r['gpu']} | {r['mode']} | {r['before_ms']:.1f} | "
                     f"{r['fused_adamw_saves_ms']:.2f} | {graphs} | {r['after_ms']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["small", "base"])
    parser.add_argument("--gpus", nargs="+", default=["h100", "h200"], choices=sorted(GPU_KINDS))
    parser.add_argument("--micro-batch", type=int, default=64)
    args = parser.parse_args(argv)
    print(markdown(rows(args.configs, args.gpus, args.micro_batch)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
