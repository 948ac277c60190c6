"""The learning-rate schedule of each research-plan preset, as its run computes it, plotted over its steps.

    python -m pretrain.research.lr_schedule_plot [--presets small base large small-wsd] [--out docs/lr_schedules.png]

Each preset's config is loaded as a run loads it and its scheduler is built by the run's own
`pretrain.runtime.optimizer.lr_scheduler`, then stepped from 0 to train.steps. `small-wsd` is the
small preset with the warmup-stable-decay schedule (optimizer.decay_style=wsd, the last 20,000 steps
decaying).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from pretrain.config.run_config import RunConfig, load_run_config
from pretrain.config.runtime_sections import OptimizerConfig
from pretrain.job.extras import needs_extra
from pretrain.paths import preset_path
from pretrain.runtime.optimizer import lr_scheduler

with needs_extra("research"):
    from matplotlib.figure import Figure

# A preset with other schedule settings, plotted beside the presets: name → (preset, --set overrides).
VARIANTS = {"small-wsd": ("small", ["optimizer.decay_style=wsd", "optimizer.wsd_decay_steps=20000"])}
PLOTTED = ("small", "base", "large", "small-wsd")


def preset_config(name: str) -> RunConfig:
    """A preset's config, or a VARIANTS entry's (its preset with the overrides)."""
    preset, overrides = VARIANTS.get(name, (name, []))
    return load_run_config(str(preset_path(preset)), overrides)


def known(name: str) -> bool:
    return name in VARIANTS or preset_path(name) is not None


def schedule(cfg: RunConfig, stride: int = 100) -> tuple[list[int], list[float]]:
    """The LR at step 0, every `stride`-th step and the last step (train.steps)."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.optimizer.lr)
    scheduler = lr_scheduler(cfg, optimizer)
    steps, lrs = [0], [optimizer.param_groups[0]["lr"]]
    while scheduler.num_steps < cfg.train.steps:
        scheduler.step(min(stride, cfg.train.steps - scheduler.num_steps))
        steps.append(scheduler.num_steps)
        lrs.append(optimizer.param_groups[0]["lr"])
    return steps, lrs


def describe(name: str, opt: OptimizerConfig) -> str:
    shape = opt.decay_style
    if shape == "cosine_restarts":
        shape += f", cycles of {opt.restart_cycle_steps:,} steps, peak × {opt.restart_peak_decay:g} per cycle"
    elif shape == "polynomial":
        shape += f", power {opt.decay_power:g}"
    elif shape == "wsd":
        shape += f" (stable, then {opt.wsd_decay_style} over the last {opt.wsd_decay_steps:,} steps)"
    return f"{name}: warmup {opt.warmup_steps:,}, {shape}, min_lr_ratio {opt.min_lr_ratio:g}"


def plot(names: list[str], out: Path, stride: int = 100) -> Path:
    figure = Figure(figsize=(9, 5.5), layout="constrained")
    axes = figure.subplots()
    for name in names:
        cfg = preset_config(name)
        axes.plot(*schedule(cfg, stride), label=describe(name, cfg.optimizer))
    axes.set(xlabel="step", ylabel="learning rate", title="Learning-rate schedules of the presets (and WSD)")
    axes.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    figure.legend(loc="outside lower center")  # below the axes: the curves start at the top left
    figure.savefig(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=list(PLOTTED),
                        help=f"preset names (pretrain/configs/), or {', '.join(VARIANTS)}")
    parser.add_argument("--out", type=Path, default=Path("docs/lr_schedules.png"), help="the PNG to write")
    parser.add_argument("--stride", type=int, default=100, help="plot every this many steps")
    args = parser.parse_args(argv)
    unknown = [n for n in args.presets if not known(n)]
    if unknown or args.stride < 1:
        parser.error(f"not presets: {unknown}" if unknown else "--stride must be >= 1")
    print(plot(args.presets, args.out, args.stride))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
