"""The reference GPT's training step profiled on the GPU: the other half of the op audit's kernel table.

    python -m pretrain.research.speed.reference_profile --reference PEER/model.py --config base --out DIR
        [--micro-batch 64] [--steps 3] [--compiled] [--set k=v ...]

The audit (`pretrain.research.speed.audit`) costs the reference's step from its CPU trace; the GPU report
profiles only ours. This runs the reference's step where it is measured, at the preset's shape, as
`reference` describes its trainer (nanoGPT's train.py, the GPU report's side-by-side runner): fp32
weights, each micro-batch's forward under bf16 autocast, `(loss / accumulation).backward()`, the gradient
norm clipped to 1.0, AdamW (fused on CUDA) decaying the matrices; random tokens. Two untimed steps, then
`--steps` under torch.profiler. It writes DIR/reference-PRESET[-compiled].json.gz (the Chrome trace) and
prints, and writes beside it as .breakdown.json, `trace_breakdown`'s figures: kernels a step, kernel time
by category, busy share. Both sides' kernel time by category on one GPU is what a bandwidth per kind of
kernel needs (docs/speed_audit.md). Without CUDA it runs on the CPU (no kernels: a dry run).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from ora_megatron.config_io import ConfigError
from pretrain.research.speed.audit import reference_shape
from pretrain.research.speed.reference import build_reference
from pretrain.research.speed.step_time import load_config, micro_batch_of, micro_batches_of
from pretrain.research.trace_breakdown import breakdown, load_events, profiled, table

WARMUP_STEPS = 2
CLIP_NORM = 1.0


def reference_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor,
                   targets: torch.Tensor, accumulation: int) -> None:
    """One optimizer step of the reference's trainer over `accumulation` micro-batches of these tokens."""
    device_type = tokens.device.type
    for _ in range(accumulation):
        with torch.autocast(device_type=device_type, dtype=torch.bfloat16):
            _, loss = model(tokens, targets)
        (loss / accumulation).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def reference_optimizer(model: torch.nn.Module, device: torch.device) -> torch.optim.Optimizer:
    """AdamW as nanoGPT configures it: weight decay on the matrices only, fused on CUDA."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95), fused=device.type == "cuda")


def profile_reference(reference: str | Path, cfg, micro_batch: int, steps: int, compiled: bool,
                      trace: Path) -> dict:
    """Profile `steps` of the reference's steps at `cfg`'s shape; `trace_breakdown`'s figures of them."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = reference_shape(cfg)
    torch.manual_seed(0)
    model = build_reference(reference, shape).to(device).train()
    optimizer = reference_optimizer(model, device)
    if compiled:
        model = torch.compile(model)
    tokens = torch.randint(shape.vocab, (micro_batch, shape.seq), device=device)
    targets = torch.randint(shape.vocab, (micro_batch, shape.seq), device=device)
    accumulation = micro_batches_of(cfg, micro_batch)
    for _ in range(WARMUP_STEPS):
        reference_step(model, optimizer, tokens, targets, accumulation)
    profiled(lambda _: reference_step(model, optimizer, tokens, targets, accumulation), steps, trace)
    return {"device": str(device), "micro_batch": micro_batch, "accumulation": accumulation, "compiled": compiled,
            "breakdown": breakdown(load_events(trace), steps)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", required=True, help="a Python file with nanoGPT's GPT and GPTConfig")
    parser.add_argument("--config", default="base", help="a preset name or a config file (the shape)")
    parser.add_argument("--out", type=Path, required=True, help="folder for the trace and its breakdown")
    parser.add_argument("--micro-batch", type=int, default=None, help="default: the config's")
    parser.add_argument("--steps", type=int, default=3, help="profiled steps (default 3)")
    parser.add_argument("--compiled", action="store_true", help="the reference's model under torch.compile")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    if not Path(args.reference).is_file():
        parser.error(f"--reference: no such file: {args.reference}")
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as error:
        parser.error(str(error))
    name = f"reference-{Path(args.config).stem}{'-compiled' if args.compiled else ''}"
    trace = args.out / f"{name}.json.gz"
    result = profile_reference(args.reference, cfg, args.micro_batch or micro_batch_of(cfg), args.steps,
                               args.compiled, trace)
    (args.out / f"{name}.breakdown.json").write_text(json.dumps(result, indent=1) + "\n")
    print(table(str(trace), result["breakdown"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
