"""Where the device time of profiled training steps goes, from a torch.profiler Chrome trace.

    python -m pretrain.research.trace_breakdown TRACE.json.gz [...] --steps 3 [--op _LinearCrossEntropy] [--json F]

The traces are the GPU report's (DIR/profile/PRESET-ARM.json.gz, `--steps` its --profile-steps). Per trace,
per step: the kernels launched, the span from the first kernel's start to the last one's end, the time at
least one kernel ran (busy) and its share of the span, the kernel time by category (GEMM, attention, layer
norm, softmax, ...: `category`, from the kernel's name), and what each `--op` (a CPU operator, autograd
function or profiler range by name: `_LinearCrossEntropy` is the fused output projection and loss; the GPU
report's steps name their stretches `compare_arms.PROFILED_STRETCHES`) launched: its kernel time, GEMMs
apart, its kernels, the host's time inside it, the device's busy time on its kernels and its wall time
(from its start to its last kernel's end): the step-time model's stretches, measured. The profiler slows
the host, so the busy share of a profiled span is a lower bound of an unprofiled step's.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import sys
from pathlib import Path
from typing import Callable, Optional

# (category, substrings of a kernel's name), the first match wins: SDPA's cuDNN kernels before GEMMs (their
# names hold "gemm"-like tiles), softmax before the elementwise kernels.
CATEGORIES = (
    ("attention", ("sdpa", "flash", "fmha", "cudnn")),
    ("gemm", ("nvjet", "gemm", "cutlass", "xmma")),
    ("layer norm", ("layer_norm", "GammaBeta")),
    ("softmax", ("SoftMax",)),
    ("optimizer", ("multi_tensor",)),
    ("triton fusions", ("triton_",)),
    ("elementwise", ("elementwise",)),
    ("reduction", ("reduce_kernel",)),
    ("copy", ("copy", "Copy")),
)
OTHER = "other"
LAUNCHES = ("cuda_runtime", "cuda_driver")  # cuBLAS launches its GEMMs through the driver API
# Events on the GPU's timeline; a profiler range has a twin there under its own name.
DEVICE_SIDE = ("kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation")


def category(kernel_name: str) -> str:
    return next((name for name, parts in CATEGORIES if any(part in kernel_name for part in parts)), OTHER)


def profiled(step: Callable[[int], object], steps: int, trace: Path) -> list[tuple[str, float, int]]:
    """Run step(0), ..., step(steps - 1) under torch.profiler (the CPU, and CUDA where there is one), write
    the Chrome trace to `trace` (gzip-compressed for a .gz name) and return (name, self device µs, calls)
    of each CUDA kernel."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        for index in range(steps):
            step(index)
        if cuda:
            torch.cuda.synchronize()
    trace.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace))
    return [(event.key, event.self_device_time_total, event.count) for event in prof.key_averages()
            if event.device_type == DeviceType.CUDA]


def load_events(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def _busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    busy, covered_to = 0.0, float("-inf")
    for start, end in sorted(intervals):
        busy += max(0.0, end - max(start, covered_to))
        covered_to = max(covered_to, end)
    return busy


def _launched_under(kernels: list[dict], launches: dict, events: list[dict], op: str) -> list[tuple[dict, list[dict]]]:
    """Each CPU event named `op` with the kernels launched while it ran (`launches`: correlation id → host
    time)."""
    spans = sorted((e for e in events
                    if e.get("name") == op and e.get("ph") == "X" and e.get("cat") not in DEVICE_SIDE),
                   key=lambda e: e["ts"])
    starts = [e["ts"] for e in spans]
    inside: list[list[dict]] = [[] for _ in spans]
    for kernel in kernels:
        launched = launches.get(kernel.get("args", {}).get("correlation"))
        if launched is None:
            continue
        index = bisect.bisect_right(starts, launched) - 1
        if index >= 0 and launched <= spans[index]["ts"] + spans[index]["dur"]:
            inside[index].append(kernel)
    return list(zip(spans, inside))


def _under_op(instances: list[tuple[dict, list[dict]]], steps: int) -> dict:
    """Per step, what an operator's instances launched: GEMM and other kernel ms, kernels, the host's time
    inside the operator, the device's busy time on its kernels, and its wall time (from the operator's
    start to the end of its last kernel, or of the operator if later): a stretch takes its wall time."""
    kernels = [k for _, inside in instances for k in inside]
    gemm = sum(k["dur"] for k in kernels if category(k["name"]) == "gemm")
    host = sum(e["dur"] for e, _ in instances)
    busy = sum(_busy_us([(k["ts"], k["ts"] + k["dur"]) for k in inside]) for _, inside in instances)
    wall = sum(max([e["ts"] + e["dur"], *(k["ts"] + k["dur"] for k in inside)]) - e["ts"] for e, inside in instances)
    return {"gemm_ms": gemm / 1e3 / steps, "other_ms": (sum(k["dur"] for k in kernels) - gemm) / 1e3 / steps,
            "kernels": len(kernels) / steps, "host_ms": host / 1e3 / steps, "busy_ms": busy / 1e3 / steps,
            "wall_ms": wall / 1e3 / steps}


def breakdown(events: list[dict], steps: int, ops: tuple[str, ...] = ()) -> dict:
    """Per-step figures of one trace's kernels (ms unless named otherwise); see the module's docstring."""
    kernels = [e for e in events if e.get("cat") == "kernel"]
    launches = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") in LAUNCHES and "correlation" in e.get("args", {})}
    span = (max((k["ts"] + k["dur"] for k in kernels), default=0.0)
            - min((k["ts"] for k in kernels), default=0.0))
    busy = _busy_us([(k["ts"], k["ts"] + k["dur"]) for k in kernels])
    per_category: dict[str, float] = {}
    for kernel in kernels:
        name = category(kernel["name"])
        per_category[name] = per_category.get(name, 0.0) + kernel["dur"]
    under = {op: _under_op(_launched_under(kernels, launches, events, op), steps) for op in ops}
    return {"steps": steps, "kernels_per_step": len(kernels) / steps, "span_ms": span / 1e3 / steps,
            "busy_ms": busy / 1e3 / steps, "busy_share": busy / span if span else None,
            "kernel_ms": sum(k["dur"] for k in kernels) / 1e3 / steps,
            "categories": {name: us / 1e3 / steps
                           for name, us in sorted(per_category.items(), key=lambda item: -item[1])},
            "ops": under}


def table(name: str, result: dict) -> str:
    share = "–" if result["busy_share"] is None else f"{result['busy_share']:.0%}"
    lines = [f"{name}: per step {result['kernels_per_step']:.0f} kernels, {result['kernel_ms']:.1f} ms of kernel "
             f"time, busy {result['busy_ms']:.1f} of a {result['span_ms']:.1f} ms span ({share})",
             "| where | ms a step | share of kernel time |", "|---|---|---|"]
    total = result["kernel_ms"] or 1.0
    lines += [f"| {cat} | {ms:.1f} | {ms / total:.0%} |" for cat, ms in result["categories"].items()]
    lines += [f"| launched inside {op}: GEMMs / the rest | {v['gemm_ms']:.1f} / {v['other_ms']:.1f} | "
              f"{(v['gemm_ms'] + v['other_ms']) / total:.0%} |" for op, v in result["ops"].items()]
    if result["ops"]:
        lines += ["", "| inside | kernels a step | host ms | device busy ms | wall ms |", "|---|---|---|---|---|"]
        lines += [f"| {op} | {v['kernels']:.0f} | {v['host_ms']:.1f} | {v['busy_ms']:.1f} | {v['wall_ms']:.1f} |"
                  for op, v in result["ops"].items()]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+", type=Path, help="Chrome traces (.json or .json.gz)")
    parser.add_argument("--steps", type=int, required=True, help="training steps the trace holds")
    parser.add_argument("--op", action="append", default=[], help="CPU operator to attribute kernels to (repeatable)")
    parser.add_argument("--json", type=Path, help="write the figures of every trace here")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    missing = [str(path) for path in args.traces if not path.is_file()]
    if missing:
        parser.error(f"no such trace: {', '.join(missing)}")
    results = {str(path): breakdown(load_events(path), args.steps, tuple(args.op)) for path in args.traces}
    print("\n\n".join(table(name, result) for name, result in results.items()))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
