"""The GPU report made from its measurements, no GPU needed: the JSON (build_report), with the figures derived
from what pretrain.research.gpu_report measured (step times, tokens/s, TFLOP/s, MFU, peak memory beside the
plan, the top kernels); what did not end ok (failures); and the Markdown, a table per section (markdown). Also
the settings of the report's runs that the report records (train_overrides, the warm-up steps)."""

from __future__ import annotations

import statistics
import xml.etree.ElementTree as ElementTree
from typing import Optional, Sequence

SCHEMA = "ora-gpu-report/1"
TOP_KERNELS = 15
TRAIN_LOG_INTERVAL = 5
BENCH_WARMUP = 2
PROFILE_WARMUP = 2
NOT_ASKED = "not asked"  # the outcome of a section left out of --sections
GIB = 2**30
FUSED_LOSS_OP = "_LinearCrossEntropy"  # ora_megatron.cross_entropy's autograd function, as the profiler names it


def train_overrides(steps: int, sets: Sequence[str] = ()) -> list[str]:
    """The preset with the report's --set overrides, trained for `steps` steps on mock data, logged every few
    steps, writing nothing but metrics.jsonl, its summary and a final checkpoint."""
    return [*sets, f"train.steps={steps}", f"train.log_interval={TRAIN_LOG_INTERVAL}", "eval.iters=1",
            f"optimizer.warmup_steps={max(1, steps // 10)}", "data.mock=true", "data.manifest=null",
            "logging.wandb_mode=disabled", "logging.tensorboard=false", "logging.progress=false"]


# ----------------------------------------------------------------------------- measurements → report

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


# ----------------------------------------------------------------------------- report → Markdown

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
    stretches = [[row["preset"], row["arm"], name, f"{v['kernels']:.0f}", f"{v['host_ms']:.1f}", f"{v['busy_ms']:.1f}",
                  f"{v['wall_ms']:.1f}"]
                 for row in profile["rows"] if (where := row.get("breakdown"))
                 for name, v in where["ops"].items() if name != FUSED_LOSS_OP]
    if stretches:
        lines += ["", "Each stretch of a step (compare_arms' profiler ranges; host: the time inside the range, "
                  "wall: from its start to its last kernel's end; the profiler slows the host):", ""]
        lines += _table(["preset", "arm", "stretch", "kernels", "host ms", "device busy ms", "wall ms"], stretches)
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
