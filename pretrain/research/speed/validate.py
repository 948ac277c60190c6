"""The step-time model against every whole-step time measured on a GPU and committed.

    python -m pretrain.research.speed.validate [--profiles | --next-window [--reference MODEL_PY]]

Sources: the three H100 reports under docs/results/gpu/ (every row of their step-time tables: compare_arms,
bf16, 65,536 tokens a step) and the H200 rows of DESIGN.md §4b (the project's; nanoGPT's are not the
project's op graph). Each is predicted at the code its measurement ran (`code_versions`: the loss's
kernels and the per-tensor non-finite check of that revision); the layers' ops are HEAD's trace.
`--profiles`: the kernel time a step by category against the profiles' (trace_breakdown.json).
`--next-window`: the model's predictions for the runs docs/results/gpu/README.md lists for the next GPU
window (HEAD's code), before they are measured: each run's step, then the stretches of the profiled ones,
and with `--reference PATH` (nanoGPT's model.py) the reference's steps at Small's and Base's shapes.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from pretrain.research.speed.gpus import gpu_kind


@dataclass(frozen=True)
class Measurement:
    source: str
    revision: str
    gpu: str
    preset: str
    arm: str
    micro_batch: int
    step_ms: float
    compiled: bool = False
    fitted: bool = False  # one of the fit's own figures


def _rows(source, revision, gpu, micro_batches: dict[str, int], table: dict[tuple[str, str], float],
          fitted: tuple[str, str] | None = None) -> list[Measurement]:
    return [Measurement(source, revision, gpu, preset, arm, micro_batches[preset], ms, fitted=(preset, arm) == fitted)
            for (preset, arm), ms in table.items()]


PRESET_BATCHES = {"small": 16, "base": 8}
ARMS = ("vanilla", "ora", "ora_hadamard")
MEASUREMENTS = [
    *_rows("h100-2026-11-27-before", "9e6204f", "h100", PRESET_BATCHES, dict(zip(
        [(p, a) for p in ("small", "base") for a in ARMS], (257.6, 335.2, 376.4, 759.2, 743.0, 831.5)))),
    *_rows("h100-2026-11-27-after", "0ff5a15", "h100", PRESET_BATCHES, dict(zip(
        [(p, a) for p in ("small", "base") for a in ARMS], (201.7, 211.7, 245.0, 568.2, 657.7, 770.7)))),
    *_rows("h100-2026-11-27-after-mb64", "0ff5a15", "h100", {"small": 64, "base": 64}, dict(zip(
        [(p, a) for p in ("base", "small") for a in ARMS], (204.1, 202.5, 237.1, 103.8, 107.4, 118.9))),
        fitted=("base", "vanilla")),
    *_rows("DESIGN.md §4b", "2f8f273", "h200", {"small": 64, "base": 64, "large": 32}, {
        ("small", "vanilla"): 91.3, ("small", "ora"): 89.1, ("base", "vanilla"): 173.6, ("base", "ora"): 170.3,
        ("large", "vanilla"): 450.7, ("large", "ora"): 421.6}, fitted=("base", "vanilla")),
    # §4b: train.compile 1.00× Base's step (its layers' graphs broke at make_viewless_tensor: eager kernels);
    # micro-batch 128 1.04× faster.
    Measurement("DESIGN.md §4b", "2f8f273", "h200", "base", "vanilla", 64, 173.6, compiled=True),
    Measurement("DESIGN.md §4b", "2f8f273", "h200", "base", "vanilla", 128, 173.6 / 1.04),
]


# Kernel ms a step by category from the profiles' trace_breakdown.json (H100): GEMMs, attention, the rest.
PROFILES = [
    (Measurement("h100-2026-11-27-before", "9e6204f", "h100", "small", "vanilla", 16, 0.0), (26.1, 6.6, 83.5)),
    *[(Measurement("h100-2026-11-27-after-mb64", "0ff5a15", "h100", "base", arm, 64, 0.0, fitted=arm == "vanilla"),
       split) for arm, split in (("vanilla", (58.7, 16.1, 79.8)), ("ora", (56.1, 16.1, 80.3)),
                                 ("ora_hadamard", (67.1, 16.1, 102.8)))],
]


def arm_overrides(arm: str) -> list[str]:
    from pretrain.research.benchmarks.compare_arms import arm_overrides as overrides

    return overrides(arm)


def predict(m: Measurement, overrides: tuple[str, ...] = ()) -> float:
    """The model's step ms for a measurement. Compiled rows before HEAD ran eager kernels: their layers'
    graphs broke at megatron-core's make_viewless_tensor; HEAD compiles each layer whole."""
    from pretrain.research.speed.step_time import load_config, step_time

    cfg = load_config(m.preset, [f"train.micro_batch_size={m.micro_batch}", *arm_overrides(m.arm), *overrides])
    compiled = m.compiled and m.revision == "HEAD"
    return step_time(cfg, gpu_kind(m.gpu), m.micro_batch, compiled, m.revision).seconds * 1e3


# The next window's runs (docs/results/gpu/README.md, "What the next GPU window measures"), on an H100 or
# an H200, micro-batch 64: (preset, arm, compiled, document masking: None for the bench's runs at the
# presets' attention dropout, False/True for the training entry's with attention dropout 0).
NEXT_WINDOW = [
    *[(preset, arm, compiled, None) for compiled in (False, True) for preset in ("base", "small")
      for arm in ("vanilla", "ora")],
    ("base", "ora", False, False),
    ("base", "ora", False, True),
]


def next_window() -> str:
    lines = ["| preset | arm | compiled | attention dropout | document masking | H100 ms | H200 ms |",
             "|---|---|---|---|---|---|---|"]
    for preset, arm, compiled, documents in NEXT_WINDOW:
        extra = () if documents is None else (
            "model.attention_dropout=0", f"data.reset_attention_mask={str(documents).lower()}")
        cells = [predict(Measurement("next", "HEAD", gpu, preset, arm, 64, 0.0, compiled), extra)
                 for gpu in ("h100", "h200")]
        lines.append(f"| {preset} | {arm} | {'yes' if compiled else 'no'} | {'preset' if documents is None else 0} | "
                     f"{'yes' if documents else 'no'} | {cells[0]:.1f} | {cells[1]:.1f} |")
    return "\n".join(lines)


def reference_predictions(reference: str) -> str:
    """The model's step for the reference GPT (nanoGPT's model.py) at Small's and Base's shapes, micro-batch
    64, eager and compiled, as the audit costs it (`pretrain.research.speed.audit.reference`)."""
    from pretrain.research.speed.audit import reference as reference_step_ops
    from pretrain.research.speed.step_time import load_config

    lines = ["| reference | preset shape | compiled | H100 ms | H200 ms |", "|---|---|---|---|---|"]
    for preset in ("base", "small"):
        side = reference_step_ops(load_config(preset, ["train.micro_batch_size=64"]), reference, 64)
        for compiled in (False, True):
            cells = [side.costs(gpu_kind(key), compiled).step_s * 1e3 for key in ("h100", "h200")]
            lines.append(f"| nanoGPT | {preset} | {'yes' if compiled else 'no'} | {cells[0]:.1f} | {cells[1]:.1f} |")
    return "\n".join(lines)


def stretch_predictions() -> str:
    """The model's stretches of the next window's profiled runs (ORA, eager, micro-batch 64, HEAD): each
    micro-batch's forward and backward, and the optimizer's stretch, in which the model counts the
    gradients' accumulation and ZeRO's bucket copies (`code_versions`): kernels, device, host and stretch
    ms (the larger of the two)."""
    from pretrain.research.speed.step_time import load_config, step_ops

    lines = ["| preset | GPU | stretch | kernels | device ms | host ms | stretch ms |", "|---|---|---|---|---|---|---|"]
    for preset in ("base", "small"):
        cfg = load_config(preset, ["train.micro_batch_size=64", *arm_overrides("ora")])
        ops = step_ops(cfg, 64)
        for key in ("h100", "h200"):
            step = ops.time(gpu_kind(key), compiled=False)
            for name, stretch in (("each micro-batch", step.micro_batch), ("optimizer", step.optimizer)):
                lines.append(f"| {preset} | {key} | {name} | {stretch.kernels} | {stretch.device_s * 1e3:.1f} | "
                             f"{stretch.host_s * 1e3:.1f} | {stretch.seconds * 1e3:.1f} |")
    return "\n".join(lines)


def category_split(m: Measurement) -> tuple[float, float, float, int]:
    """The model's (GEMM, attention, rest) device ms of a step, and its kernels."""
    from pretrain.research.speed.step_time import load_config, step_summary, step_time

    cfg = load_config(m.preset, [f"train.micro_batch_size={m.micro_batch}", *arm_overrides(m.arm)])
    gpu = gpu_kind(m.gpu)
    rows = step_summary(step_time(cfg, gpu, m.micro_batch, False, m.revision), gpu)["categories"]
    rest = rows["other"]["ms"] + rows["optimizer"]["ms"]
    return rows["gemm"]["ms"], rows["attention"]["ms"], rest, sum(r["kernels"] for r in rows.values())


def profile_table() -> str:
    lines = ["| profile | revision | preset | arm | micro-batch | GEMM ms (model) | attention ms (model) | "
             "rest ms (model) | model's kernels |", "|---|---|---|---|---|---|---|---|---|"]
    for m, measured in PROFILES:
        *predicted, kernels = category_split(m)
        cells = " | ".join(f"{a:.1f} ({b:.1f}, {b / a - 1:+.0%})" for a, b in zip(measured, predicted))
        lines.append(f"| {m.source}{' (fit)' if m.fitted else ''} | {m.revision} | {m.preset} | {m.arm} | "
                     f"{m.micro_batch} | {cells} | {kernels} |")
    return "\n".join(lines)


def comparison() -> list[dict]:
    rows = []
    for m in MEASUREMENTS:
        predicted = predict(m)
        rows.append({**m.__dict__, "predicted_ms": predicted, "error": predicted / m.step_ms - 1})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| source | revision | GPU | preset | arm | micro-batch | compiled | measured ms | predicted ms | error |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mark = " (fit)" if r["fitted"] else ""
        lines.append(f"| {r['source']} | {r['revision']} | {r['gpu']} | {r['preset']} | {r['arm']} | "
                     f"{r['micro_batch']} | {'yes' if r['compiled'] else 'no'} | {r['step_ms']:.1f}{mark} | "
                     f"{r['predicted_ms']:.1f} | {r['error']:+.0%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--next-window", action="store_true", help="predict the next GPU window's runs")
    parser.add_argument("--profiles", action="store_true", help="the profiles' kernel time by category")
    parser.add_argument("--reference", help="with --next-window: nanoGPT's model.py, to predict its steps too")
    args = parser.parse_args(argv)
    if args.reference and not args.next_window:
        parser.error("--reference goes with --next-window")
    if args.next_window:
        parts = [next_window(), stretch_predictions()]
        if args.reference:
            parts.append(reference_predictions(args.reference))
        print("\n\n".join(parts))
        return 0
    if args.profiles:
        print(profile_table())
        return 0
    rows = comparison()
    print(markdown(rows))
    misses = [r for r in rows if abs(r["error"]) > 0.15]
    print(f"\n{len(rows) - len(misses)} of {len(rows)} within 15%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
