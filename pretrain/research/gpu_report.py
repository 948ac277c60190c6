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
the top kernels; with the device and the torch, CUDA, DeepSpeed and megatron-core versions. `build_report`
makes the JSON from the measurements alone. Logs of every command: DIR/logs/.

Without a CUDA device it says so and exits with status 2, before DeepSpeed or megatron-core is imported.
`--check-imports` imports what the report runs (RUN_PATH) and exits, 0 when all of it imports: no CUDA device
needed, so that a machine's environment is checked before its GPU time is spent (docker/gpu_bringup.sh).
The report needs the GPU set of pyproject.toml ([tool.ora] gpu) beside torch, nothing heavier: neither this
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
import statistics
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ElementTree
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from ora_megatron.config_io import ConfigError
from pretrain.config import load_run_config
from pretrain.environment import git_revision, megatron_core_version
from pretrain.paths import REPO, preset_path
from pretrain.research.trace_breakdown import breakdown, load_events

SCHEMA = "ora-gpu-report/1"
EXIT_NO_CUDA = 2
SECTIONS = ("tests", "bench", "train", "profile")
TOP_KERNELS = 15
TRAIN_LOG_INTERVAL = 5
BENCH_WARMUP = 2
PROFILE_WARMUP = 2
# The most one command of a section may take (seconds), so that one section cannot spend the others' time.
SECTION_LIMIT_S = {"tests": 90, "bench": 120, "train": 120}
MIN_COMMAND_S = 20  # a command given less than this is not started
BUDGET_S = 330.0  # the default --budget-s: with start-up and the files written, within 6 minutes
NOT_ASKED = "not asked"  # the outcome of a section left out of --sections
PROFILE_ARM_S = 45  # what one arm's profile is expected to need at most
GIB = 2**30
FUSED_LOSS_OP = "_LinearCrossEntropy"  # ora_megatron.cross_entropy's autograd function, as the profiler names it
# What the report imports as it measures, in this process and in the commands it starts (the training entry,
# compare_arms, the trainer they build, the profiler).
RUN_PATH = ("deepspeed", "megatron.core", "ora_megatron.parallel", "pretrain.training.trainer",
            "pretrain.checkpoint.checkpointer", "pretrain.research.memory_model",
            "pretrain.research.benchmarks.compare_arms", "pretrain.pretrain_ora", "torch.profiler")


# ----------------------------------------------------------------------------- the measurements' shapes

@dataclass
class Outcome:
    """How one command or in-process step ended: ok, failed, timed out, skipped (no budget left) or not asked."""

    status: str
    seconds: float = 0.0
    command: Optional[list[str]] = None
    returncode: Optional[int] = None
    log: Optional[str] = None  # relative to the report's folder
    detail: Optional[str] = None  # what went wrong, where something did


def train_overrides(steps: int, sets: Sequence[str] = ()) -> list[str]:
    """The preset with the report's --set overrides, trained for `steps` steps on mock data, logged every few
    steps, writing nothing but metrics.jsonl, its summary and a final checkpoint."""
    return [*sets, f"train.steps={steps}", f"train.log_interval={TRAIN_LOG_INTERVAL}", "train.eval_iters=1",
            f"optimizer.warmup_steps={max(1, steps // 10)}", "data.mock=true", "data.manifest=null",
            "logging.wandb_mode=disabled", "logging.tensorboard=false", "logging.progress=false"]


# ----------------------------------------------------------------------------- pure: measurements → report

def step_timing(step_times_s: list[float], tokens_per_step: int, flops_per_token: float,
                peak_tflops: Optional[float]) -> dict:
    """Median, min and max of the step times; tokens/s, TFLOP/s and MFU at the median step time (one GPU)."""
    from pretrain.runtime.metrics import throughput  # DeepSpeed and megatron-core load with it

    median = statistics.median(step_times_s)
    speed = throughput(median, 1, tokens_per_step, flops_per_token, 1, peak_tflops)
    return {"step_time_s": {"median": median, "min": min(step_times_s), "max": max(step_times_s),
                            "samples": list(step_times_s)},
            "tokens_per_s": speed.tokens_per_s, "tflops": speed.tflops_per_device, "mfu": speed.mfu}


def memory_versus_plan(peak_allocated_bytes: Optional[int], plan: Optional[dict]) -> dict:
    """The measured allocator peak beside the memory plan's total (an upper bound: it adds every term)."""
    planned = plan["bytes"]["total"] if plan else None
    ratio = peak_allocated_bytes / planned if peak_allocated_bytes is not None and planned else None
    return {"peak_allocated_bytes": peak_allocated_bytes, "planned_bytes": planned,
            "planned_terms": plan["bytes"] if plan else None, "measured_over_planned": ratio}


def top_kernels(events: list[tuple[str, float, int]], count: int = TOP_KERNELS) -> list[dict]:
    """The `count` CUDA kernels with the most self device time, from (name, self device µs, calls) per
    kernel; `share` is of all kernels' time together."""
    total = sum(us for _, us, _ in events)
    ranked = sorted(events, key=lambda event: event[1], reverse=True)[:count]
    return [{"name": name, "self_device_ms": us / 1e3, "calls": calls, "share": us / total if total else None}
            for name, us, calls in ranked]


def pytest_counts(junit_xml: str) -> dict:
    """Test counts of a JUnit XML report (pytest --junitxml)."""
    root = ElementTree.fromstring(junit_xml)
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    counts = {key: sum(int(suite.get(key, 0)) for suite in suites)
              for key in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def bench_rows(preset: str, bench: dict, peaks: dict, plans: dict) -> list[dict]:
    """One row per arm of a compare_arms report: its timed steps, its GPU peak beside the arm's plan."""
    shape = bench["shape"]
    peak = peaks.get(shape["precision"])
    return [{"preset": preset, "arm": arm["arm"], "precision": shape["precision"],
             "timing": step_timing(arm["step_time_s"]["samples"], shape["tokens_per_step"],
                                   arm["analytic_flops_per_token"], peak["tflops"] if peak else None),
             "memory": memory_versus_plan(arm["memory"].get("gpu_peak_bytes"), plans.get(arm["arm"]))}
            for arm in bench["arms"]]


def train_row(preset: str, train: dict, peaks: dict, plan: Optional[dict]) -> Optional[dict]:
    """The training run's logged windows after the first (start-up), or None where fewer were logged."""
    windows = train["records"][1:]
    if not windows:
        return None
    peak = peaks.get(train["precision"])
    return {"preset": preset, "arm": train["arm"], "precision": train["precision"], "windows": len(windows),
            "steps_per_window": train["log_interval"],
            "timing": step_timing([r["step_time_s"] for r in windows], train["tokens_per_step"],
                                  train["flops_per_token"], peak["tflops"] if peak else None),
            "logged": {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in windows),
                       "mfu": statistics.median(r["mfu"] for r in windows) if windows[0]["mfu"] is not None
                       else None},
            "memory": memory_versus_plan(max(r["peak_mem_bytes"] for r in train["records"]), plan)}


def build_report(measured: dict) -> dict:
    """The report (JSON-able) from the measurements: environment, peaks, and per section the outcomes of
    its commands and the rows derived from what they measured."""
    plans, peaks = measured["plans"], measured["peaks"]
    bench, train, profile = measured["bench"], measured["train"], measured["profile"]
    tests = measured["tests"]
    return {
        "schema": SCHEMA,
        "created": measured["created"],
        "command": measured["command"],
        "budget_s": measured["budget_s"],
        "elapsed_s": measured["elapsed_s"],
        "overrides": measured["overrides"],
        "environment": measured["environment"],
        "peaks": peaks,
        "memory_plans": {preset: run["outcome"] for preset, run in plans.items()},
        "tests": {"outcome": tests["outcome"],
                  "counts": pytest_counts(tests["junit_xml"]) if tests.get("junit_xml") else None},
        "bench": {"steps": measured["bench_steps"], "warmup": BENCH_WARMUP,
                  "outcomes": {preset: run["outcome"] for preset, run in bench.items()},
                  "rows": [row for preset, run in bench.items() if run.get("report")
                           for row in bench_rows(preset, run["report"], peaks, plans.get(preset, {}).get("arms", {}))]},
        "train": {"steps": measured["train_steps"],
                  "overrides": train_overrides(measured["train_steps"], measured["overrides"]),
                  "outcomes": {preset: run["outcome"] for preset, run in train.items()},
                  "rows": [row for preset, run in train.items() if run.get("records")
                           if (row := train_row(preset, run, peaks, plans.get(preset, {}).get("train")))]},
        "profile": {"steps": measured["profile_steps"], "warmup": PROFILE_WARMUP,
                    "rows": [{"preset": preset, "arm": arm, "outcome": run["outcome"], "trace": run.get("trace"),
                              "top_kernels": top_kernels(run["events"]) if run.get("events") else None,
                              "breakdown": run.get("breakdown")}
                             for preset, arms in profile.items() for arm, run in arms.items()]},
    }


def outcomes(report: dict) -> list[tuple[str, str, dict]]:
    """(section, item, outcome) of every command and in-process step of the report."""
    found = [("tests", "pytest -m gpu", report["tests"]["outcome"])]
    for section in ("bench", "train"):
        found += [(section, preset, outcome) for preset, outcome in report[section]["outcomes"].items()]
    found += [("memory plan", preset, outcome) for preset, outcome in report["memory_plans"].items()]
    found += [("profile", f"{row['preset']} {row['arm']}", row["outcome"]) for row in report["profile"]["rows"]]
    return found


def failures(report: dict) -> list[str]:
    """Every command or step of the report that did not end ok, as `section item: status`."""
    return [f"{section} {item}: {outcome['status']}" for section, item, outcome in outcomes(report)
            if outcome["status"] not in ("ok", NOT_ASKED)]


# ----------------------------------------------------------------------------- pure: report → Markdown

def _cell(value, fmt: str = "{}") -> str:
    return "–" if value is None else fmt.format(value).replace("|", "\\|")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(row) + " |" for row in rows)]


def _speed_cells(timing: dict) -> list[str]:
    step = timing["step_time_s"]
    return [_cell(1e3 * step["median"], "{:.1f}"), f"{1e3 * step['min']:.1f}–{1e3 * step['max']:.1f}",
            _cell(timing["tokens_per_s"], "{:,.0f}"), _cell(timing["tflops"], "{:.1f}"),
            _cell(timing["mfu"], "{:.1%}")]


def _memory_cells(memory: dict) -> list[str]:
    gib = [None if memory[key] is None else memory[key] / GIB for key in ("peak_allocated_bytes", "planned_bytes")]
    return [_cell(gib[0], "{:.2f}"), _cell(gib[1], "{:.2f}"), _cell(memory["measured_over_planned"], "{:.2f}")]


def _breakdown_cells(where: dict) -> list[str]:
    gemm, attention = where["categories"].get("gemm", 0.0), where["categories"].get("attention", 0.0)
    loss = where["ops"].get(FUSED_LOSS_OP)
    return [f"{gemm:.1f}", f"{attention:.1f}", f"{where['kernel_ms'] - gemm - attention:.1f}",
            f"{loss['gemm_ms']:.1f} / {loss['other_ms']:.1f}" if loss else "–"]


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = ["# GPU report", "",
             f"{report['created']}, {report['elapsed_s']:.0f} s of a {report['budget_s']:.0f} s budget: "
             f"`{' '.join(report['command'])}`", "", "## Environment", ""]
    peaks = "; ".join(f"{precision} runs: {peak['model']} {peak['dtype']} dense {peak['tflops']:g} TFLOP/s"
                      if peak else f"{precision} runs: no peak known for this device (no MFU)"
                      for precision, peak in report["peaks"].items())
    lines += _table(["", ""], [
        ["device", f"{env['device']} (compute capability {env['capability']}, {env['memory_bytes'] / GIB:.1f} GiB)"],
        ["MFU against", peaks or "–"],
        ["torch / CUDA / cuDNN", f"{env['torch']} / {env['cuda']} / {env['cudnn']}"],
        ["DeepSpeed / megatron-core", f"{env['deepspeed']} / {env['megatron_core']}"],
        ["Python / host", f"{env['python']} / {env['hostname']}"],
        ["revision", f"`{env['git_revision']}`" if env["git_revision"]
         else "unknown (no .git here; ORA_GIT_REVISION not set)"],
    ])
    tests = report["tests"]
    counts = tests["counts"] or {}
    lines += ["", "## GPU tests (`pytest -m gpu`)", ""]
    lines += _table(["status", "passed", "failed", "errors", "skipped", "seconds"], [[
        tests["outcome"]["status"], *(_cell(counts.get(k)) for k in ("passed", "failures", "errors", "skipped")),
        f"{tests['outcome']['seconds']:.0f}"]])
    bench = report["bench"]
    lines += ["", f"## Arms side by side (compare_arms: {bench['steps']} timed round-robin steps after "
              f"{bench['warmup']} warm-up; step time over the timed steps)", ""]
    lines += _table(["preset", "arm", "step ms", "min–max ms", "tokens/s", "TFLOP/s", "MFU", "peak GiB", "plan GiB",
                     "peak/plan"],
                    [[row["preset"], row["arm"], *_speed_cells(row["timing"]), *_memory_cells(row["memory"])]
                     for row in bench["rows"]])
    train = report["train"]
    lines += ["", f"## Training loop (pretrain_ora: {train['steps']} steps on mock data; step time over the logged "
              "windows after the first)", ""]
    lines += _table(["preset", "arm", "windows", "step ms", "min–max ms", "tokens/s", "TFLOP/s", "MFU", "logged MFU",
                     "peak GiB", "plan GiB", "peak/plan"],
                    [[row["preset"], row["arm"], f"{row['windows']} × {row['steps_per_window']}",
                      *_speed_cells(row["timing"]), _cell(row["logged"]["mfu"], "{:.1%}"),
                      *_memory_cells(row["memory"])] for row in train["rows"]])
    profile = report["profile"]
    lines += ["", f"## Where the device time goes (torch.profiler, {profile['steps']} steps; "
              "pretrain.research.trace_breakdown; ms a step)", ""]
    lines += _table(["preset", "arm", "kernels", "kernel ms", "busy / profiled span", "GEMM", "attention",
                     "the rest", "fused loss: GEMM / the rest"],
                    [[row["preset"], row["arm"], f"{where['kernels_per_step']:.0f}", f"{where['kernel_ms']:.1f}",
                      _cell(where["busy_share"], "{:.0%}"), *_breakdown_cells(where)]
                     for row in profile["rows"] if (where := row.get("breakdown"))])
    lines += ["", f"## Top CUDA kernels by self device time (torch.profiler, {profile['steps']} steps)", ""]
    lines += _table(["preset", "arm", "#", "kernel", "self ms", "calls", "share"],
                    [[row["preset"], row["arm"], str(rank), f"`{_cell(kernel['name'][:90])}`",
                      f"{kernel['self_device_ms']:.2f}", str(kernel["calls"]), _cell(kernel["share"], "{:.1%}")]
                     for row in profile["rows"] for rank, kernel in enumerate(row["top_kernels"] or [], 1)])
    lines += ["", "## Commands and steps", ""]
    lines += _table(["section", "item", "status", "seconds", "log", "detail (last line)"],
                    [[section, item, outcome["status"], f"{outcome['seconds']:.0f}", _cell(outcome["log"]),
                      _cell(outcome["detail"].strip().splitlines()[-1] if outcome["detail"] else None)]
                     for section, item, outcome in outcomes(report)])
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- measuring (on the GPU)

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
    from pretrain.run_dir import RunDir
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


def profiled(step: Callable[[int], object], steps: int, trace: Path) -> list[tuple[str, float, int]]:
    """Run step(0), ..., step(steps - 1) under torch.profiler (CPU and CUDA), write the Chrome trace to
    `trace` (gzip-compressed for a .gz name) and return (name, self device µs, calls) of each CUDA kernel."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for index in range(steps):
            step(index)
        torch.cuda.synchronize()
    trace.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace))
    return [(event.key, event.self_device_time_total, event.count) for event in prof.key_averages()
            if event.device_type == DeviceType.CUDA]


def profile_arm(preset: str, arm: str, steps: int, sets: list[str], trace: Path) -> list[tuple[str, float, int]]:
    """One arm's engine, built as compare_arms builds it, two untimed steps, then `steps` profiled ones."""
    from pretrain.research.benchmarks.compare_arms import Arm, arm_config, synthetic_batches
    from pretrain.runtime.engine import build_engine

    cfg, grad_accum = arm_config(preset, sets, arm)
    runner = Arm(arm, cfg, grad_accum, build_engine(cfg, grad_accum))
    batches = synthetic_batches(cfg, count=4)
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
        where = breakdown(load_events(trace), steps, (FUSED_LOSS_OP,))
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
