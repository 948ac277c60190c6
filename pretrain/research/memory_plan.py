"""Per-GPU memory plan of a run: what the rank holding the most needs, term by term, and whether it fits.

    python -m pretrain.research.memory_plan --config PRESET|FILE [--set k=v ...] --world-size N [--tp T] [--pp P]
        [--zero-stage Z] [--micro-batch M] [--precision fp32|bf16|fp16] [--activation-checkpointing]
        [--gpu-memory-gb 80] [--json]

Flags override the config's values; PRESET names a file in pretrain/configs/. The terms, how each is
counted and what it was checked against: pretrain.research.memory_model.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from pathlib import Path

import yaml

from ora_megatron.config_io import ConfigError
from pretrain.config.run_config import RunConfig, load_run_config
from pretrain.paths import preset_names, preset_path
from pretrain.research.memory_model import DTYPE_BYTES, GIB, RESERVE_FRACTION, layout_of, plan

FLAG_KEYS = {"tp": "parallel.tensor", "pp": "parallel.pipeline", "zero_stage": "deepspeed.zero_stage",
             "micro_batch": "train.micro_batch_size", "precision": "deepspeed.precision"}


def config_path(name: str) -> Path:
    """A config file, or a preset's name (pretrain/configs/NAME.yaml)."""
    path = Path(name) if Path(name).is_file() else preset_path(name)
    if path is None:
        raise ConfigError("--config", f"{name!r} is neither a file nor a preset ({', '.join(preset_names())})")
    return path


def overrides(args: argparse.Namespace) -> list[str]:
    """--set items, then the flags as the keys they stand for (flags win)."""
    items = list(args.set)
    items += [f"{key}={getattr(args, flag)}" for flag, key in FLAG_KEYS.items() if getattr(args, flag) is not None]
    if args.activation_checkpointing:
        items.append("speed.activation_checkpointing=true")
    return items


BUFFER_LABELS = {"adam_sqrt_v_temporary": "Adam step temporary (fp32 √v)", "allreduce_bucket": "all-reduce bucket",
                 "reduce_bucket": "reduce bucket", "zero3_gathered_parameters": "ZeRO-3 parameters gathered fwd→bwd"}


def _gib(n: int) -> str:
    return f"{n / GIB:,.2f}"


def table(config: str, result: dict) -> str:
    lay, terms = result["layout"], result["bytes"]
    data_parallel = f"TP {lay['tensor']} × PP {lay['pipeline']} × DP {lay['data']}"
    recompute = "with" if lay["activation_checkpointing"] else "without"
    lines = [
        f"{config} on {lay['world_size']} GPUs: {data_parallel}, ZeRO-{lay['zero_stage']}, {lay['precision']}, "
        f"micro-batch {lay['micro_batch_size']} (gradient accumulation {lay['grad_accum']}), "
        f"{recompute} activation checkpointing",
        f"rank holding the most: pipeline stage {result['pipeline_stage']} ({result['layers']} layers, "
        f"{result['trainable_params']:,} trainable + {result['frozen_params']:,} frozen parameters, "
        f"{result['in_flight_micro_batches']} micro-batch{'es' if result['in_flight_micro_batches'] > 1 else ''} "
        "in flight)",
        f"{'per GPU':<44}{'GiB':>10}",
    ]
    labels = {"weights": f"weights ({lay['precision']}, frozen Q/K included)", "gradients": "gradients",
              "master_weights": "fp32 master weights", "adam_moments": "Adam moments (fp32)",
              "deepspeed_buffers": "DeepSpeed buffers",
              "activations": f"activations (micro-batch {lay['micro_batch_size']})"}
    for key, label in labels.items():
        lines.append(f"{label:<44}{_gib(terms[key]):>10}")
        if key == "deepspeed_buffers":
            lines += [f"  {BUFFER_LABELS[name]:<42}{_gib(n):>10}" for name, n in result["deepspeed_buffers"].items()]
    lines += [
        f"  {'without checkpointing':<42}{_gib(result['activations_without_checkpointing']):>10}",
        f"  {'with checkpointing':<42}{_gib(result['activations_with_checkpointing']):>10}",
        f"{'total':<44}{_gib(terms['total']):>10}",
        f"GPU memory {_gib(result['gpu_memory_bytes'])} GiB, headroom {_gib(result['headroom_bytes'])} GiB "
        f"({result['headroom_bytes'] / result['gpu_memory_bytes']:.0%}; fits when ≥ {RESERVE_FRACTION:.0%}): "
        f"{result['verdict']}",
        f"activations: {result['activation_formula']}",
        *(f"caveat: {note}" for note in result["caveats"]),
    ]
    return "\n".join(lines)


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """The config and the flags that override it (shared with pretrain.research.speed_plan)."""
    parser.add_argument("--config", required=True, help="a preset name (pretrain/configs/) or a YAML file")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="dotted override (repeatable)")
    parser.add_argument("--tp", type=int, help="tensor-parallel size (parallel.tensor)")
    parser.add_argument("--pp", type=int, help="pipeline-parallel size (parallel.pipeline)")
    parser.add_argument("--zero-stage", type=int, help="deepspeed.zero_stage")
    parser.add_argument("--micro-batch", type=int, help="train.micro_batch_size")
    parser.add_argument("--precision", choices=sorted(DTYPE_BYTES), help="deepspeed.precision")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="speed.activation_checkpointing=true")


def load_config(args: argparse.Namespace, extra: list[str] = ()) -> tuple[Path, RunConfig]:
    """The config file add_config_flags named, loaded with its overrides and `extra` after them
    (ConfigError naming the key)."""
    path = config_path(args.config)
    return path, load_run_config(str(path), overrides(args) + list(extra))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_config_flags(parser)
    parser.add_argument("--world-size", type=int, required=True, help="GPUs in the run")
    parser.add_argument("--gpu-memory-gb", type=float, default=80.0, help="memory of one GPU, GiB (default 80)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.world_size < 1:
            raise ConfigError("--world-size", f"must be at least 1, got {args.world_size}")
        if not 0 < args.gpu_memory_gb < math.inf:  # also refuses nan
            raise ConfigError("--gpu-memory-gb", f"must be a positive number of GiB, got {args.gpu_memory_gb}")
        path, cfg = load_config(args)
        layout_of(cfg, args.world_size)  # refuse a bad layout before building anything
    except (ConfigError, OSError, yaml.YAMLError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with contextlib.redirect_stdout(sys.stderr):
        from pretrain.checkpoint.consolidate import tp1_parallel_state

        with tp1_parallel_state():
            result = plan(cfg, args.world_size, args.gpu_memory_gb)
    print(json.dumps({"config": str(path), **result}, indent=2) if args.json else table(path.name, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
