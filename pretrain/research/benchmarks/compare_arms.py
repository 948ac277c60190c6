"""Attention variants side by side through the real training stack: speed, memory and FLOPs.

    python -m pretrain.research.benchmarks.compare_arms --config FILE|PRESET [--set k=v ...]
        --arms vanilla,ora,ora_hadamard [--steps N] [--warmup W] [--json OUT]

One process (gloo, TP = PP = 1). Every arm is the run config with its attention swapped in, built
by the trainer's own builder (`pretrain.runtime.engine.build_engine`: StagedGPT, AdamW groups of the
trainable parameters, the DeepSpeed engine with the config's ZeRO stage and precision), and fed
the same synthetic token batches. After `--warmup` steps per arm, the arms take turns step by step
(round r starts with arm r mod n, so drifting machine load hits all alike); medians are reported,
and the ratios to the first arm are the figures to read.

Arms: an attention type of ora_megatron/model_config.py (`vanilla`, `ora`, `frozen_gaussian`,
`frozen_uniform`, `synthesizer_random`, `synthesizer_factorized`, `fixed_random_attention`), which
sets `model.attention.type`, or `ora_<method>` (`ora_qr`, `ora_svd`, `ora_householder`,
`ora_cayley`, `ora_hadamard`): ora with `model.attention.orthogonal_method=<method>`. Other
attention options come from the config and `--set`.

Per arm:
- training: median wall time of one optimizer step (forward + backward + optimizer step over the
  step's micro-batches) and tokens/s; also the step's process CPU time, steadier than wall time
  on a shared machine (with `--threads 1` it is the work itself), while wall time is the figure
  on a quiet one;
- inference: tokens/s of a forward of one micro-batch in eval mode under torch.no_grad;
- FLOPs per token: the analytic count (ora_megatron.summary.train_flops_per_token, Megatron's
  convention) and torch's FlopCounterMode over one whole training step: GEMMs (mm, addmm, bmm)
  and, on GPU, the SDPA kernels; torch has no formula for the CPU flash-attention kernel, so on
  CPU the attention scores are left out, as are elementwise work and gathers;
- bytes held from the live tensors: parameters (trainable / frozen), gradients and optimizer
  state (pretrain.runtime.accounting, as the trainer's summary reads them), and activations saved for
  backward (saved-tensor hooks over one micro-batch's forward; unique storages, parameters and
  buffers excluded). On CPU that is the whole per-arm memory account: the process's RSS holds
  every arm at once and is not split. On GPU also the allocator's peak over one step of this arm alone
  (`torch.cuda.max_memory_allocated`, reset before it, minus what was allocated before it), plus
  TFLOP/s (analytic FLOPs × tokens/s) and MFU against accounting's dense bf16 peak table (also
  for fp32 runs: `mfu_vs_bf16_dense_peak`).

The block-dominated CPU comparison (its targets: ora ≤ 0.97, ora_hadamard ≤ 0.90 × vanilla step
time; the current figures in RESULTS.md beside this file):

    python -m pretrain.research.benchmarks.compare_arms --config tiny --arms vanilla,ora,ora_hadamard \\
        --steps 20 --warmup 3 \\
        --set model.num_layers=8 --set model.hidden_size=512 --set model.num_attention_heads=8 \\
        --set model.ffn_hidden_size=2048 --set model.seq_length=256 --set model.vocab_size=4096 \\
        --set train.micro_batch_size=8 --set train.global_batch_size=8 --json bench.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import platform
import statistics
import sys
import time
import typing
from dataclasses import dataclass, field

import torch
from torch.profiler import record_function
from torch.utils.flop_counter import FlopCounterMode

from ora_megatron.builder import padded_vocab_size
from ora_megatron.config_io import ConfigError
from ora_megatron.model_config import AttentionType, ModelConfig
from ora_megatron.orthogonal import METHODS
from ora_megatron.summary import train_flops_per_token
from pretrain.config.run_config import RunConfig, load_run_config, validate_for_world
from pretrain.research.benchmarks.outputs import publish, rerun_command
from pretrain.research.memory_plan import (
    config_path,  # a file, or a preset name: resolved as `python -m pretrain.research.memory_plan` does
)

if typing.TYPE_CHECKING:  # the engine imports DeepSpeed: only when an arm is built (build_arm)
    from pretrain.runtime.engine import TrainEngine

SCHEMA = "ora-bench/1"
# A step's stretches as profiler ranges (the GPU report's profile reads them, pretrain.research.trace_breakdown):
# each micro-batch's forward and backward, the last one's apart (its backward runs ZeRO's gradient hooks),
# and DeepSpeed's step calls (the optimizer's at the accumulation boundary).
PROFILED_STRETCHES = ("micro_batch", "last_micro_batch", "optimizer_step")
ATTENTION_TYPES = typing.get_args(AttentionType)


# ----------------------------------------------------------------------------- arms and configs

def arm_overrides(arm: str) -> list[str]:
    """The `--set` overrides that turn a run config into arm `arm`."""
    if arm in ATTENTION_TYPES:
        return [f"model.attention.type={arm}"]
    prefix, _, method = arm.partition("_")
    if prefix == "ora" and method in METHODS:
        return ["model.attention.type=ora", f"model.attention.orthogonal_method={method}"]
    names = ", ".join([*ATTENTION_TYPES, *(f"ora_{m}" for m in METHODS)])
    raise ConfigError("--arms", f"unknown arm {arm!r}; expected one of {names}")


def arm_config(config: str, overrides: list[str], arm: str) -> tuple[RunConfig, int]:
    """(run config, gradient-accumulation steps) of one arm, validated for one process."""
    cfg = load_run_config(str(config_path(config)), [*overrides, *arm_overrides(arm)])
    if cfg.parallel.tensor != 1 or cfg.parallel.pipeline != 1:
        raise ConfigError("parallel.tensor", "the bench runs in one process: tensor and pipeline sizes must be 1")
    return cfg, validate_for_world(cfg, 1)


def synthetic_batches(model: ModelConfig, micro_batch_size: int, count: int,
                      seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """`count` micro-batches of uniform random tokens (the same for every arm of a config)."""
    generator = torch.Generator().manual_seed(seed)
    shape = (micro_batch_size, model.seq_length)
    batches = []
    for _ in range(count):
        tokens = torch.randint(0, model.vocab_size, shape, generator=generator)
        labels = torch.randint(0, model.vocab_size, shape, generator=generator)
        batches.append({"tokens": tokens, "labels": labels, "loss_mask": torch.ones(shape)})
    return batches


# ----------------------------------------------------------------------------- one arm

def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class SavedTensorBytes:
    """Bytes of the distinct storages autograd saves for backward, parameters and buffers left out."""

    def __init__(self, module: torch.nn.Module):
        held = [*module.parameters(), *module.buffers()]
        self.exclude = {t.untyped_storage().data_ptr() for t in held}
        self.storages: dict[int, int] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.exclude:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor  # the same reference autograd would keep: nothing extra is held

    @property
    def total(self) -> int:
        return sum(self.storages.values())


@dataclass
class Arm:
    name: str
    cfg: RunConfig
    grad_accum: int
    train_engine: TrainEngine
    step_times: list[float] = field(default_factory=list)
    step_cpu_times: list[float] = field(default_factory=list)
    inference_times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    probe: dict = field(default_factory=dict)

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.tokens_per_step

    def train_step(self, batches, step: int, forward_context=lambda micro: contextlib.nullcontext(),
                   after_backward=lambda micro: None) -> None:
        """One optimizer step, as Trainer._train_step takes it through a plain engine."""
        from pretrain.runtime.loss import batch_loss

        ds_engine = self.train_engine.ds_engine
        self.train_engine.scheduler.step(1)
        micro_batch, last_micro_batch, optimizer_step = PROFILED_STRETCHES
        for micro in range(self.grad_accum):
            batch = batches[(step * self.grad_accum + micro) % len(batches)]
            last = micro == self.grad_accum - 1
            with record_function(last_micro_batch if last else micro_batch):
                with forward_context(micro):
                    loss = batch_loss(ds_engine, batch)
                self.train_engine.backward(loss, last_micro_batch=last)
                after_backward(micro)
            with record_function(optimizer_step):
                ds_engine.step()
        self.losses.append(loss.item())

    def inference(self, batch) -> None:
        module = self.train_engine.module
        module.eval()
        with torch.no_grad():
            module(batch["tokens"].to(self.train_engine.ds_engine.device))
        module.train()

    def probe_step(self, batches, step: int) -> None:
        """One training step under FlopCounterMode and saved-tensor hooks; reads gradient bytes too."""
        from pretrain.runtime import accounting

        ds_engine = self.train_engine.ds_engine
        saved = SavedTensorBytes(ds_engine.module)
        grad_bytes = {}

        def forward_context(micro):
            # Micro-batch 0 only: each micro-batch's backward frees what its forward saved.
            if micro:
                return contextlib.nullcontext()
            return torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t)

        def after_backward(micro):
            if micro == self.grad_accum - 1:  # what the optimizer step reads
                grad_bytes["total"] = accounting.local_grad_bytes(ds_engine)

        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            allocated_before = torch.cuda.memory_allocated()
        counter = FlopCounterMode(display=False)
        with counter:
            self.train_step(batches, step, forward_context, after_backward)
        if cuda:
            torch.cuda.synchronize()
            self.probe["gpu_step_peak_bytes"] = torch.cuda.max_memory_allocated() - allocated_before
        self.probe["flops_per_step"] = counter.get_total_flops()
        self.probe["gradient_bytes"] = grad_bytes["total"]
        self.probe["saved_activation_bytes"] = saved.total

    def report(self) -> dict:
        from pretrain.runtime import accounting

        ds_engine, model = self.train_engine.ds_engine, self.cfg.model
        params = list(ds_engine.module.parameters())
        trainable = [p for p in params if p.requires_grad]
        state = accounting.allocated_state(ds_engine, self.probe["gradient_bytes"])
        step_time = statistics.median(self.step_times)
        inference_time = statistics.median(self.inference_times)
        tokens_per_s = self.tokens_per_step / step_time
        analytic = train_flops_per_token(model, padded_vocab_size(model))
        memory = {
            "parameter_bytes": _bytes(params),
            "trainable_parameter_bytes": _bytes(trainable),
            "frozen_parameter_bytes": _bytes(params) - _bytes(trainable),
            "gradient_bytes": state["gradient_bytes"],
            "optimizer_state_bytes": state["optimizer_state_bytes"],
            "saved_activation_bytes": self.probe["saved_activation_bytes"],
        }
        memory["accounted_bytes"] = sum(memory[k] for k in ("parameter_bytes", "gradient_bytes",
                                                            "optimizer_state_bytes", "saved_activation_bytes"))
        if "gpu_step_peak_bytes" in self.probe:
            memory["gpu_step_peak_bytes"] = self.probe["gpu_step_peak_bytes"]
            memory["gpu_peak_bytes"] = (memory["parameter_bytes"] + memory["optimizer_state_bytes"]
                                        + self.probe["gpu_step_peak_bytes"])
        out = {
            "arm": self.name,
            "overrides": arm_overrides(self.name),
            "attention": {"type": model.attention.type, "orthogonal_method": model.attention.orthogonal_method},
            "trainable_params": sum(p.numel() for p in trainable),
            "frozen_params": sum(p.numel() for p in params) - sum(p.numel() for p in trainable),
            "step_time_s": {"median": step_time, "min": min(self.step_times), "max": max(self.step_times),
                            "samples": self.step_times},
            "step_cpu_time_s": {"median": statistics.median(self.step_cpu_times), "samples": self.step_cpu_times},
            "tokens_per_s": tokens_per_s,
            "inference_time_s": {"median": inference_time, "samples": self.inference_times},
            "inference_tokens_per_s": self.cfg.train.micro_batch_size * model.seq_length / inference_time,
            "analytic_flops_per_token": analytic,
            "measured_flops_per_token": self.probe["flops_per_step"] / self.tokens_per_step,
            "grad_and_optimizer_state_bytes": state["gradient_bytes"] + state["optimizer_state_bytes"],
            "memory": memory,
            "losses": self.losses,
        }
        peak = accounting.device_peak_tflops()
        if peak is not None:
            out["tflops"] = analytic * tokens_per_s / 1e12
            out["mfu_vs_bf16_dense_peak"] = out["tflops"] / peak
        return out


# ----------------------------------------------------------------------------- the run

RATIO_KEYS = {  # ratio key -> (table label, how to read it from an arm's report)
    "step_time": ("step", lambda r: r["step_time_s"]["median"]),
    "step_cpu_time": ("step cpu", lambda r: r["step_cpu_time_s"]["median"]),
    "tokens_per_s": ("tok/s", lambda r: r["tokens_per_s"]),
    "inference_tokens_per_s": ("infer tok/s", lambda r: r["inference_tokens_per_s"]),
    "analytic_flops": ("FLOP an.", lambda r: r["analytic_flops_per_token"]),
    "measured_flops": ("FLOP meas.", lambda r: r["measured_flops_per_token"]),
    "grad_and_optimizer_state_bytes": ("grad+opt B", lambda r: r["grad_and_optimizer_state_bytes"]),
    "saved_activation_bytes": ("saved B", lambda r: r["memory"]["saved_activation_bytes"]),
}


def ratios(arms: list[dict]) -> list[dict]:
    """Every arm's figures divided by the first arm's."""
    first = arms[0]
    return [{"arm": a["arm"], **{k: get(a) / get(first) if get(first) else None
                                 for k, (_, get) in RATIO_KEYS.items()}} for a in arms]


def run_bench(config: str, overrides: list[str], arm_names: list[str], steps: int, warmup: int,
              log=print) -> dict:
    """Build every arm, warm up, time them round-robin; the report as a JSON-able dict."""
    from pretrain.runtime.engine import build_engine

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    configs = [arm_config(config, overrides, name) for name in arm_names]
    first = configs[0][0]
    batches = synthetic_batches(first.model, first.train.micro_batch_size, count=4)
    arms = []
    for name, (cfg, grad_accum) in zip(arm_names, configs):
        arms.append(Arm(name, cfg, grad_accum, build_engine(cfg, grad_accum)))
        log(f"built {name}")
    step = 0
    for _ in range(warmup):
        for arm in arms:
            arm.train_step(batches, step)
        step += 1
    for arm in arms:
        arm.probe_step(batches, step)
    step += 1
    for arm in arms:
        arm.losses.clear()
    gc.collect()
    for r in range(steps):
        for arm in arms[r % len(arms):] + arms[:r % len(arms)]:
            _sync()
            start, cpu_start = time.perf_counter(), time.process_time()
            arm.train_step(batches, step)
            _sync()
            arm.step_times.append(time.perf_counter() - start)
            arm.step_cpu_times.append(time.process_time() - cpu_start)
        step += 1
        log(f"step {r + 1}/{steps}: " + "  ".join(f"{a.name} {a.step_times[-1]:.3f}s" for a in arms))
    for r in range(steps):
        for arm in arms[r % len(arms):] + arms[:r % len(arms)]:
            _sync()
            start = time.perf_counter()
            arm.inference(batches[r % len(batches)])
            _sync()
            arm.inference_times.append(time.perf_counter() - start)
    reports = [arm.report() for arm in arms]
    model, train = first.model, first.train
    return {
        "schema": SCHEMA,
        "config": str(config),
        "overrides": list(overrides),
        "arms_requested": arm_names,
        "steps": steps,
        "warmup": warmup,
        "environment": {
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
            "threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version(),
        },
        "shape": {
            "family": model.family, "num_layers": model.num_layers, "hidden_size": model.hidden_size,
            "num_attention_heads": model.num_attention_heads, "ffn_hidden_size": model.ffn_size,
            "seq_length": model.seq_length, "vocab_size": model.vocab_size,
            "micro_batch_size": train.micro_batch_size, "global_batch_size": train.global_batch_size,
            "precision": first.deepspeed.precision, "zero_stage": first.deepspeed.zero_stage,
            "tokens_per_step": arms[0].tokens_per_step,
        },
        "arms": reports,
        "ratios": ratios(reports),
    }


def table(report: dict) -> str:
    shape = report["shape"]
    lines = [
        f"{report['environment']['device']}, {report['environment']['threads']} threads; "
        f"{shape['num_layers']}×d{shape['hidden_size']} h{shape['num_attention_heads']} ffn{shape['ffn_hidden_size']} "
        f"seq{shape['seq_length']} vocab{shape['vocab_size']} mb{shape['micro_batch_size']} "
        f"gb{shape['global_batch_size']} {shape['precision']} ZeRO-{shape['zero_stage']}; "
        f"{report['steps']} round-robin steps after {report['warmup']} warm-up",
        f"{'arm':<16}{'step ms':>9}{'tok/s':>9}{'infer tok/s':>12}{'GFLOP/tok an.':>14}{'meas.':>7}"
        f"{'grad+opt MiB':>13}{'saved MiB':>10}",
    ]
    for a in report["arms"]:
        lines.append(f"{a['arm']:<16}{1e3 * a['step_time_s']['median']:>9.1f}{a['tokens_per_s']:>9.0f}"
                     f"{a['inference_tokens_per_s']:>12.0f}{a['analytic_flops_per_token'] / 1e9:>14.4f}"
                     f"{a['measured_flops_per_token'] / 1e9:>7.4f}{a['grad_and_optimizer_state_bytes'] / 2**20:>13.1f}"
                     f"{a['memory']['saved_activation_bytes'] / 2**20:>10.1f}")
    lines.append(f"ratios to {report['arms'][0]['arm']}:")
    lines.append(f"{'arm':<16}" + "".join(f"{label:>12}" for label, _ in RATIO_KEYS.values()))
    for r in report["ratios"]:
        lines.append(f"{r['arm']:<16}" + "".join(f"{r[k]:>12.4f}" if r[k] is not None else f"{'-':>12}"
                                                  for k in RATIO_KEYS))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="run config YAML or preset name (tiny, small, base, large)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="dotted override applied to every arm (repeatable)")
    parser.add_argument("--arms", default="vanilla,ora,ora_hadamard",
                        help="comma-separated arms; ratios are to the first (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per arm (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per arm first (default: %(default)s)")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    from ora_megatron.parallel import destroy_distributed, init_distributed

    own_group = not torch.distributed.is_initialized()
    if own_group:
        init_distributed(1, 1, backend="gloo")
    try:
        report = run_bench(args.config, args.set, [a for a in args.arms.split(",") if a], args.steps, args.warmup,
                           log=lambda msg: print(msg, file=sys.stderr))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if own_group:
            destroy_distributed()
    report["command"] = rerun_command(__spec__.name, argv)
    publish(table(report), json.dumps(report, indent=2), args.json, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
