"""The GPU report: on a machine with a CUDA device, one command measures what the project's GPU path does.

    python -m pretrain.research.gpu_report --out DIR [--presets small,base] [--arms vanilla,ora,ora_hadamard]
        [--sections tests,bench,train,profile] [--bench-steps 5] [--train-steps 50] [--profile-steps 3]
        [--set KEY=VALUE ...] [--budget-s 330]
    python -m pretrain.research.gpu_report --check-imports

Within --budget-s (330 s by default) it runs, in this order:
  tests    the gpu-marked tests, `python -m pytest -m gpu` (counts from their JUnit XML);
  bench    pretrain.research.benchmarks.compare_arms for each preset with the arms side by side (a few
           round-robin steps on synthetic tokens, in the preset's precision: bf16 for small and base);
  train    the training entry, `python -m pretrain.pretrain_ora --config PRESET`, for --train-steps steps on
           megatron-core's mock data in one process, its run dir in DIR/train/PRESET. Its metrics.jsonl
           logs every 5 steps, each record timed over the steps since the previous one; the first window
           (start-up) is left out;
  profile  for each preset and arm, a torch.profiler trace of --profile-steps training steps after two
           untimed ones (DIR/profile/PRESET-ARM.json.gz: chrome://tracing or ui.perfetto.dev), its 15
           CUDA kernels with the most self device time, and where the device time goes
           (pretrain.research.trace_breakdown: busy share, kernel time by category, the fused loss's).
Every command gets the budget that is left (and at most its section's share); one that fails or runs out
of time is reported so, and the others still run. A profile starts only with PROFILE_ARM_S left. The peak
memory plans come from pretrain.research.memory_plan's model for the same configs, computed here.

The default budget keeps the report within 6 minutes on the GPU machine, so that a GPU window of 15 minutes
holds a second run. On an H100 (docs/results/gpu/) the default work needed more than the budget: the gpu-marked
tests 34 s, compare_arms 39 s (small) and 61 s (base), the training entry 58 and 82 s, a profiled arm 15-32 s;
within 330 s five of the six profiles were skipped. Those step times were at the presets' micro-batches,
where one GPU is bound by the host; `--set train.micro_batch_size=64` measures one filled GPU.

DIR/gpu_report.json (schema ora-gpu-report/1) and DIR/gpu_report.md (a table per section) hold, per
preset and arm: the step time (median, min and max over the timed steps or windows), tokens/s, TFLOP/s
(the analytic training FLOPs of a token: ora_megatron.summary), MFU against the device's dense peak for
the run's precision (pretrain.runtime.accounting), the peak allocated memory beside the plan's total, and
the top kernels; with the device and the torch, CUDA, DeepSpeed and megatron-core versions. Both are made from
the measurements alone (pretrain/research/gpu_report_build.py). Logs of every command: DIR/logs/.

Without a CUDA device it says so and exits with status 2, before DeepSpeed or megatron-core is imported.
`--check-imports` imports what the report runs (RUN_PATH) and exits, 0 when all of it imports: no CUDA device
needed, so that a machine's environment is checked before its GPU time is spent (docker/gpu_bringup.sh).
The report needs the GPU set of pyproject.toml ([tool.ora.gpu]) beside torch, nothing heavier: neither this
module nor RUN_PATH imports datasets, pyarrow, scipy, matplotlib, wandb or lm-eval.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from ora_megatron.config_io import ConfigError
from pretrain.config.run_config import load_run_config
from pretrain.job.environment import git_revision, megatron_core_version
from pretrain.paths import REPO, preset_path
from pretrain.research.gpu_report_build import (
    BENCH_WARMUP,
    FUSED_LOSS_OP,
    GIB,
    NOT_ASKED,
    PROFILE_WARMUP,
    TRAIN_LOG_INTERVAL,
    build_report,
    failures,
    markdown,
    train_overrides,
)
from pretrain.research.trace_breakdown import breakdown, load_events, profiled

EXIT_NO_CUDA = 2
SECTIONS = ("tests", "bench", "train", "profile")
# The most one command of a section may take (seconds), so that one section cannot spend the others' time.
SECTION_LIMIT_S = {"tests": 90, "bench": 120, "train": 120}
MIN_COMMAND_S = 20  # a command given less than this is not started
BUDGET_S = 330.0  # the default --budget-s: with start-up and the files written, within 6 minutes
PROFILE_ARM_S = 45  # what one arm's profile is expected to need at most
# What the report imports as it measures, in this process and in the commands it starts (the training entry,
# compare_arms, the trainer they build, the profiler).
RUN_PATH = ("deepspeed", "megatron.core", "ora_megatron.parallel", "pretrain.training.trainer",
            "pretrain.checkpoint.checkpointer", "pretrain.research.memory_model",
            "pretrain.research.benchmarks.compare_arms", "pretrain.pretrain_ora", "torch.profiler")


# ----------------------------------------------------------------------------- measuring (on the GPU)

@dataclass
class Outcome:
    """How one command or in-process step ended: ok, failed, timed out, skipped (no budget left) or not asked."""

    status: str
    seconds: float = 0.0
    command: Optional[list[str]] = None
    returncode: Optional[int] = None
    log: Optional[str] = None  # relative to the report's folder
    detail: Optional[str] = None  # what went wrong, where something did


class Budget:
    def __init__(self, seconds: float):
        self.seconds, self.start = seconds, time.monotonic()

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.start

    @property
    def left(self) -> float:
        return self.seconds - self.elapsed


def run_command(command: list[str], out: Path, name: str, timeout: float) -> Outcome:
    """Run `command` from the repository root, its output in DIR/logs/NAME.log, in a process group of its
    own that is killed whole when it runs out of time."""
    if timeout < MIN_COMMAND_S:
        return Outcome("skipped", command=command, detail="the time budget is spent")
    log = out / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with open(log, "w") as sink:
        sink.write(f"$ {' '.join(command)}\n")
        sink.flush()
        proc = subprocess.Popen(command, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return Outcome("timed out", time.monotonic() - start, command, None, str(log.relative_to(out)),
                           f"stopped after {timeout:.0f} s")
    tail = None if code == 0 else "\n".join(log.read_text().splitlines()[-20:])
    return Outcome("ok" if code == 0 else "failed", time.monotonic() - start, command, code,
                   str(log.relative_to(out)), tail)


def _timeout(budget: Budget, section: str) -> float:
    return min(budget.left, SECTION_LIMIT_S[section])


def measure_tests(out: Path, budget: Budget) -> dict:
    junit = out / "tests" / "junit.xml"
    junit.parent.mkdir(parents=True, exist_ok=True)
    junit.unlink(missing_ok=True)
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
               "tests"]
    outcome = run_command(command, out, "tests", _timeout(budget, "tests"))
    if outcome.returncode == 5:  # pytest's "no tests collected": nothing failed
        outcome.status, outcome.detail = "ok", "no gpu-marked tests were selected"
    return {"outcome": asdict(outcome), "junit_xml": junit.read_text() if junit.is_file() else None}


def measure_bench(out: Path, budget: Budget, preset: str, arms: list[str], steps: int, sets: list[str]) -> dict:
    report = out / "bench" / f"{preset}.json"
    report.parent.mkdir(parents=True, exist_ok=True)
    report.unlink(missing_ok=True)
    command = [sys.executable, "-m", "pretrain.research.benchmarks.compare_arms", "--config", preset,
               "--arms", ",".join(arms), "--steps", str(steps), "--warmup", str(BENCH_WARMUP), "--json", str(report)]
    for item in sets:
        command += ["--set", item]
    outcome = run_command(command, out, f"bench-{preset}", _timeout(budget, "bench"))
    return {"outcome": asdict(outcome), "report": json.loads(report.read_text()) if report.is_file() else None}


def measure_train(out: Path, budget: Budget, preset: str, steps: int, sets: list[str]) -> dict:
    from pretrain.run_files.run_dir import RunDir
    from pretrain.runtime.accounting import flops_per_token

    config = preset_path(preset)
    overrides = train_overrides(steps, sets)
    cfg = load_run_config(str(config), overrides)
    run_dir = out / "train" / preset
    shutil.rmtree(run_dir, ignore_errors=True)  # a new run, not the resume of an earlier report's
    command = [sys.executable, "-m", "pretrain.pretrain_ora", "--config", str(config), "--run-dir", str(run_dir)]
    for item in overrides:
        command += ["--set", item]
    outcome = run_command(command, out, f"train-{preset}", _timeout(budget, "train"))
    records = [asdict(r) for r in RunDir(run_dir).read_records("train")]
    return {"outcome": asdict(outcome), "arm": cfg.model.attention.type, "precision": cfg.deepspeed.precision,
            "log_interval": cfg.train.log_interval,
            "tokens_per_step": cfg.tokens_per_step,
            "flops_per_token": flops_per_token(cfg.model),
            "records": [{key: r[key] for key in ("step", "split", "step_time_s", "tokens_per_s", "mfu",
                                                 "peak_mem_bytes")} for r in records]}


def memory_plans(preset: str, arms: list[str], train_steps: int, sets: list[str], gpu_memory_gb: float) -> dict:
    """pretrain.research.memory_plan's plan of each arm's config (as compare_arms makes it) and of the
    training run's, for one GPU of this size."""
    from pretrain.research.benchmarks.compare_arms import arm_config
    from pretrain.research.memory_model import plan

    start = time.monotonic()
    try:
        train_cfg = load_run_config(str(preset_path(preset)), train_overrides(train_steps, sets))
        plans = {"arms": {arm: plan(arm_config(preset, sets, arm)[0], 1, gpu_memory_gb) for arm in arms},
                 "train": plan(train_cfg, 1, gpu_memory_gb)}
        return {"outcome": asdict(Outcome("ok", time.monotonic() - start)), **plans}
    except Exception:
        return {"outcome": asdict(Outcome("failed", time.monotonic() - start, detail=traceback.format_exc()))}


def profile_arm(preset: str, arm: str, steps: int, sets: list[str], trace: Path) -> list[tuple[str, float, int]]:
    """One arm's engine, built as compare_arms builds it, two untimed steps, then `steps` profiled ones."""
    from pretrain.research.benchmarks.compare_arms import Arm, arm_config, synthetic_batches
    from pretrain.runtime.engine import build_engine

    cfg, grad_accum = arm_config(preset, sets, arm)
    runner = Arm(arm, cfg, grad_accum, build_engine(cfg, grad_accum))
    batches = synthetic_batches(cfg.model, cfg.train.micro_batch_size, count=4)
    for step in range(PROFILE_WARMUP):
        runner.train_step(batches, step)
    return profiled(lambda index: runner.train_step(batches, PROFILE_WARMUP + index), steps, trace)


def measure_profile(out: Path, budget: Budget, preset: str, arm: str, steps: int, sets: list[str]) -> dict:
    if budget.left < PROFILE_ARM_S:
        return {"outcome": asdict(Outcome("skipped", detail="the time budget is spent"))}
    start = time.monotonic()
    trace = out / "profile" / f"{preset}-{arm}.json.gz"
    try:
        events = profile_arm(preset, arm, steps, sets, trace)
        from pretrain.research.benchmarks.compare_arms import PROFILED_STRETCHES

        where = breakdown(load_events(trace), steps, (FUSED_LOSS_OP, *PROFILED_STRETCHES))
        return {"outcome": asdict(Outcome("ok", time.monotonic() - start)), "trace": str(trace.relative_to(out)),
                "events": events, "breakdown": where}
    except Exception:  # one arm's failure (out of memory, say) is its row's, not the report's
        return {"outcome": asdict(Outcome("failed", time.monotonic() - start, detail=traceback.format_exc()))}
    finally:  # the arm's engine is gone with profile_arm's frame: its memory goes back before the next arm
        gc.collect()
        torch.cuda.empty_cache()


def environment() -> dict:
    import deepspeed

    props = torch.cuda.get_device_properties(0)
    return {"device": torch.cuda.get_device_name(0), "capability": f"{props.major}.{props.minor}",
            "memory_bytes": props.total_memory, "device_count": torch.cuda.device_count(),
            "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
            "deepspeed": deepspeed.__version__, "megatron_core": megatron_core_version(),
            "python": platform.python_version(), "hostname": platform.node(), "git_revision": git_revision()}


def measure(args: argparse.Namespace, out: Path, log: Callable[[str], None]) -> dict:
    """Everything the report is built from, measured on this machine's GPU within the budget."""
    from ora_megatron.parallel import destroy_distributed, init_distributed
    from pretrain.runtime.accounting import device_peak

    budget = Budget(args.budget_s)
    measured = {"created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "command": ["python", "-m", __spec__.name, *args.argv], "budget_s": args.budget_s,
                "environment": environment(), "bench_steps": args.bench_steps, "train_steps": args.train_steps,
                "profile_steps": args.profile_steps, "overrides": args.set,
                "tests": {"outcome": asdict(Outcome(NOT_ASKED))},
                "bench": {}, "train": {}, "profile": {}, "plans": {}}
    measured["peaks"] = {}
    for preset in args.presets:
        precision = load_run_config(str(preset_path(preset))).deepspeed.precision
        peak = device_peak(precision)
        measured["peaks"][precision] = asdict(peak) if peak else None
    if "tests" in args.sections:
        measured["tests"] = measure_tests(out, budget)
        log(f"tests: {measured['tests']['outcome']['status']}")
    for preset in args.presets if "bench" in args.sections else []:
        measured["bench"][preset] = measure_bench(out, budget, preset, args.arms, args.bench_steps, args.set)
        log(f"bench {preset}: {measured['bench'][preset]['outcome']['status']}")
    for preset in args.presets if "train" in args.sections else []:
        measured["train"][preset] = measure_train(out, budget, preset, args.train_steps, args.set)
        log(f"train {preset}: {measured['train'][preset]['outcome']['status']}")
    init_distributed(1, 1)
    try:
        gpu_memory_gb = measured["environment"]["memory_bytes"] / GIB
        for preset in args.presets:
            measured["plans"][preset] = memory_plans(preset, args.arms, args.train_steps, args.set, gpu_memory_gb)
            log(f"memory plans {preset}: {measured['plans'][preset]['outcome']['status']}")
        for preset in args.presets if "profile" in args.sections else []:
            measured["profile"][preset] = {}
            for arm in args.arms:
                measured["profile"][preset][arm] = measure_profile(out, budget, preset, arm, args.profile_steps,
                                                                   args.set)
                log(f"profile {preset} {arm}: {measured['profile'][preset][arm]['outcome']['status']}")
    finally:
        destroy_distributed()
    measured["elapsed_s"] = budget.elapsed
    return measured


# ----------------------------------------------------------------------------- the command

def check_imports() -> int:
    """Import RUN_PATH (no CUDA device needed): 0 and the versions when all of it imports, else 1 and the
    first failure."""
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to stdout as it loads
        for name in RUN_PATH:
            try:
                importlib.import_module(name)
            except Exception:
                print(f"cannot import {name}, which the GPU report runs:\n{traceback.format_exc()}", file=sys.stderr)
                return 1
    import deepspeed

    print(f"the GPU report's imports: ok (torch {torch.__version__}, DeepSpeed {deepspeed.__version__}, "
          f"megatron-core {megatron_core_version()}, CUDA device: {torch.cuda.is_available()})")
    return 0


def _names(text: str) -> list[str]:
    return [name for name in text.split(",") if name]


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="folder for gpu_report.json, gpu_report.md, logs, runs, traces (required)")
    parser.add_argument("--check-imports", action="store_true",
                        help="only import what the report runs (no CUDA device needed) and exit: 0 when all imports")
    parser.add_argument("--presets", type=_names, default=["small", "base"],
                        help="comma-separated presets (default small,base)")
    parser.add_argument("--arms", type=_names, default=["vanilla", "ora", "ora_hadamard"],
                        help="comma-separated compare_arms arms (default vanilla,ora,ora_hadamard)")
    parser.add_argument("--sections", type=_names, default=list(SECTIONS), help=f"any of {','.join(SECTIONS)} (all)")
    parser.add_argument("--bench-steps", type=int, default=5, help="timed compare_arms steps per arm (default 5)")
    parser.add_argument("--train-steps", type=int, default=50, help="training steps per preset (default 50)")
    parser.add_argument("--profile-steps", type=int, default=3, help="profiled steps per arm (default 3)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="dotted override of every preset's runs (bench, train, plans, profiles), repeatable: "
                             "e.g. train.micro_batch_size=64 to fill the GPU with fewer accumulation steps")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S,
                        help=f"time for all of it, seconds (default {BUDGET_S:g})")
    args = parser.parse_args(argv)
    if args.out is None and not args.check_imports:
        parser.error("--out is required")
    unknown = sorted(set(args.sections) - set(SECTIONS))
    if unknown:
        parser.error(f"--sections: unknown {', '.join(unknown)}; expected some of {', '.join(SECTIONS)}")
    if min(args.bench_steps, args.profile_steps) < 1 or args.train_steps < 2 * TRAIN_LOG_INTERVAL:
        parser.error(f"--bench-steps and --profile-steps must be >= 1, --train-steps >= {2 * TRAIN_LOG_INTERVAL}")
    missing = [preset for preset in args.presets if preset_path(preset) is None]
    if missing:
        parser.error(f"--presets: no preset {', '.join(missing)} in pretrain/configs/")
    for preset in args.presets:  # before any GPU time is spent, naming the key
        try:
            load_run_config(str(preset_path(preset)), train_overrides(args.train_steps, args.set))
        except ConfigError as e:
            parser.error(f"--set on preset {preset}: {e}")
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.check_imports:
        return check_imports()
    if not torch.cuda.is_available():
        print("no CUDA device: the GPU report needs one; run it on a machine with an NVIDIA GPU "
              "(docs/launching.md, GPU report on a bare machine)", file=sys.stderr)
        return EXIT_NO_CUDA
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with contextlib.redirect_stdout(sys.stderr):  # stdout is the report's: DeepSpeed logs there as it loads
        measured = measure(args, out, log=lambda line: print(line, file=sys.stderr, flush=True))
    report = build_report(measured)
    (out / "gpu_report.json").write_text(json.dumps(report, indent=1) + "\n")
    text = markdown(report)
    (out / "gpu_report.md").write_text(text)
    print(text)
    problems = failures(report)
    for problem in problems:
        print(f"not ok: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
