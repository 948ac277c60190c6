"""The GPU report: its refusal without CUDA (before DeepSpeed or megatron-core loads), the report built from
hand-made measurements (gpu_report_build: schema, derived figures, Markdown), its commands' time limits; on a GPU, the
profiler's kernel table. The CPU suite hides the machine's GPUs from what it starts (tests/conftest.py)."""

from __future__ import annotations

import gzip
import importlib
import json
import os
import subprocess
import sys

import pytest
import torch

import pretrain.research
from pretrain.config.run_config import load_run_config, validate_for_world
from pretrain.paths import preset_path
from pretrain.research import gpu_report, gpu_report_build

GIB = 2**30
PEAK = {"device": "NVIDIA H100 80GB HBM3", "model": "H100 SXM", "dtype": "bf16", "tflops": 989.5}
JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0" failures="1"
skipped="1" tests="5" time="3.2"><testcase classname="a" name="b" time="1.0"/></testsuite></testsuites>"""


def outcome(status: str = "ok", detail: str | None = None) -> dict:
    return {"status": status, "seconds": 12.0, "command": ["python", "-m", "x"], "returncode": 0 if status == "ok"
            else 1, "log": "logs/x.log", "detail": detail}


def plan(total_gib: float) -> dict:
    return {"bytes": {"weights": GIB, "activations": int((total_gib - 1) * GIB), "total": int(total_gib * GIB)}}


def bench_arm(arm: str, samples: list[float], flops_per_token: float) -> dict:
    """What compare_arms reports of an arm, the fields the report reads."""
    return {"arm": arm, "step_time_s": {"median": sorted(samples)[len(samples) // 2], "samples": samples},
            "analytic_flops_per_token": flops_per_token, "memory": {"gpu_peak_bytes": 4 * GIB}}


def train_record(step: int, step_time_s: float, peak_gib: float) -> dict:
    return {"step": step, "split": "train", "step_time_s": step_time_s, "tokens_per_s": 65536 / step_time_s,
            "mfu": 0.3, "peak_mem_bytes": int(peak_gib * GIB)}


def measurements() -> dict:
    """What `measure` gathers, made by hand: small benched and trained, base's bench failed, one arm profiled."""
    events = [(f"kernel_{i}", float(100 * (i + 1)), i + 1) for i in range(20)]
    return {
        "created": "2026-01-01T00:00:00+00:00", "command": ["python", "-m", "pretrain.research.gpu_report"],
        "budget_s": 600.0, "elapsed_s": 321.0, "bench_steps": 5, "train_steps": 50, "profile_steps": 3,
        "overrides": ["train.micro_batch_size=32"],
        "environment": {"device": PEAK["device"], "capability": "9.0", "memory_bytes": 80 * GIB, "device_count": 1,
                        "torch": "2.11.0+cu130", "cuda": "13.0", "cudnn": 91000, "deepspeed": "0.19.8",
                        "megatron_core": "0.19.2", "python": "3.12.3", "hostname": "gpu",
                        "git_revision": "e36b532"},
        "peaks": {"bf16": PEAK},
        "tests": {"outcome": outcome("failed"), "junit_xml": JUNIT},
        "bench": {"small": {"outcome": outcome(), "report": {
                      "shape": {"precision": "bf16", "tokens_per_step": 65536},
                      "arms": [bench_arm("vanilla", [0.30, 0.20, 0.25], 1e9),
                               bench_arm("ora", [0.2, 0.2, 0.2], 0.9e9)]}},
                  "base": {"outcome": outcome("timed out", "stopped after 180 s"), "report": None}},
        "train": {"small": {"outcome": outcome(), "arm": "ora", "precision": "bf16", "log_interval": 5,
                            "tokens_per_step": 65536, "flops_per_token": 1e9,
                            "records": [train_record(5, 2.0, 9.0), train_record(10, 0.3, 5.0),
                                        train_record(15, 0.2, 5.0), train_record(20, 0.4, 5.0)]}},
        "plans": {"small": {"outcome": outcome(), "arms": {"vanilla": plan(8.0), "ora": plan(7.0)},
                            "train": plan(10.0)}},
        "profile": {"small": {"vanilla": {"outcome": outcome(), "trace": "profile/small-vanilla.json.gz",
                                          "events": events, "breakdown": {
                                              "steps": 3, "kernels_per_step": 4192.0, "span_ms": 290.2,
                                              "busy_ms": 154.7, "busy_share": 0.533, "kernel_ms": 154.7,
                                              "categories": {"gemm": 58.7, "elementwise": 32.6, "attention": 16.1},
                                              "ops": {"_LinearCrossEntropy": {"gemm_ms": 13.2, "other_ms": 27.0},
                                                      "optimizer_step": {
                                                          "gemm_ms": 0.0, "other_ms": 4.0, "kernels": 20.0,
                                                          "host_ms": 40.0, "busy_ms": 4.0, "wall_ms": 41.0}}}},
                              "ora": {"outcome": outcome("skipped", "the time budget is spent")}}},
    }


# ---------------------------------------------------------------------------- without CUDA
def test_without_cuda_it_says_so_and_exits_2_before_loading_deepspeed(monkeypatch, capsys, tmp_path):
    """Imported afresh and run with DeepSpeed and megatron-core unimportable: neither is needed to refuse."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("deepspeed", "megatron", "megatron.core"):
        monkeypatch.setitem(sys.modules, name, None)  # an import of it raises ImportError
    monkeypatch.delitem(sys.modules, "pretrain.research.gpu_report")
    monkeypatch.setattr(pretrain.research, "gpu_report", gpu_report)  # the import below replaces it: put back after
    fresh = importlib.import_module("pretrain.research.gpu_report")
    assert fresh is not gpu_report
    assert fresh.main(["--out", str(tmp_path / "report")]) == gpu_report.EXIT_NO_CUDA == 2
    err = capsys.readouterr().err
    assert err.startswith("no CUDA device: the GPU report needs one;") and len(err.splitlines()) == 1
    assert not (tmp_path / "report").exists()


@pytest.mark.parametrize("argv, message", [
    (["--sections", "tests,speed"], "unknown speed"),
    (["--presets", "small,huge"], "no preset huge"),
    (["--train-steps", "5"], "--train-steps >= 10"),
    (["--set", "train.micro_batch=4"], "--set on preset small: config error at 'train.micro_batch'"),
    (["--set", "train.micro_batch_size=3"], "train.global_batch_size"),
])
def test_arguments_are_checked_first(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        gpu_report.main(["--out", "unused", *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_out_is_required_but_to_check_the_imports(capsys):
    with pytest.raises(SystemExit) as exit_:
        gpu_report.main([])
    assert exit_.value.code == 2 and "--out is required" in capsys.readouterr().err
    assert gpu_report.parse_args(["--check-imports"]).check_imports  # its run: tests/project/test_gpu_set.py


def test_default_work_is_budgeted_within_six_minutes():
    """The default budget and what runs outside it (this module's imports, the files written) stay within the
    6 minutes a report may take on the GPU machine; any one command or profile fits in the budget."""
    args = gpu_report.parse_args(["--out", "unused"])
    assert args.budget_s + 30 <= 6 * 60
    assert max(gpu_report.SECTION_LIMIT_S.values()) + gpu_report.PROFILE_ARM_S < args.budget_s


# ---------------------------------------------------------------------------- the report
def test_report_from_measurements():
    measured = measurements()
    report = gpu_report_build.build_report(measured)
    json.dumps(report, allow_nan=False)  # JSON as it is written
    assert report["schema"] == "ora-gpu-report/1"
    assert set(report) == {"schema", "created", "command", "budget_s", "elapsed_s", "overrides", "environment",
                           "peaks", "memory_plans", "tests", "bench", "train", "profile"}
    assert report["train"]["overrides"][0] == "train.micro_batch_size=32"  # the report's own keys come after
    assert report["environment"]["device"] == "NVIDIA H100 80GB HBM3" and report["peaks"] == {"bf16": PEAK}
    assert report["tests"]["counts"] == {"tests": 5, "failures": 1, "errors": 0, "skipped": 1, "passed": 3}

    vanilla, ora = report["bench"]["rows"]
    assert (vanilla["preset"], vanilla["arm"], ora["arm"]) == ("small", "vanilla", "ora")
    assert vanilla["timing"]["step_time_s"] == {"median": 0.25, "min": 0.2, "max": 0.3, "samples": [0.3, 0.2, 0.25]}
    assert vanilla["timing"]["tokens_per_s"] == 65536 / 0.25
    achieved = 1e9 * 65536 / 0.25 / 1e12  # analytic FLOPs of the tokens of a second
    assert vanilla["timing"]["tflops"] == pytest.approx(achieved, rel=1e-12)
    assert vanilla["timing"]["mfu"] == pytest.approx(achieved / 989.5, rel=1e-12)  # achieved / peak
    assert vanilla["memory"]["measured_over_planned"] == 4 / 8 and ora["memory"]["planned_bytes"] == 7 * GIB
    assert report["bench"]["outcomes"]["base"]["status"] == "timed out"  # no rows, its outcome says why

    train, = report["train"]["rows"]
    assert train["windows"] == 3 and train["steps_per_window"] == 5  # the first window (start-up) left out
    assert train["timing"]["step_time_s"]["median"] == 0.3 and train["timing"]["step_time_s"]["max"] == 0.4
    assert train["timing"]["mfu"] == pytest.approx(1e9 * 65536 / 0.3 / 1e12 / 989.5, rel=1e-12)
    assert train["logged"] == {"tokens_per_s": 65536 / 0.3, "mfu": 0.3}
    assert train["memory"]["peak_allocated_bytes"] == 9 * GIB  # the peak over the whole run
    assert train["memory"]["measured_over_planned"] == 0.9

    profiled, skipped = report["profile"]["rows"]
    kernels = profiled["top_kernels"]
    assert len(kernels) == 15 and kernels[0] == {"name": "kernel_19", "self_device_ms": 2.0, "calls": 20,
                                                 "share": 2000 / sum(100 * (i + 1) for i in range(20))}
    assert [k["self_device_ms"] for k in kernels] == sorted((k["self_device_ms"] for k in kernels), reverse=True)
    assert skipped["top_kernels"] is None and skipped["outcome"]["status"] == "skipped"
    assert profiled["breakdown"]["busy_share"] == 0.533 and skipped["breakdown"] is None

    assert gpu_report_build.failures(report) == ["tests pytest -m gpu: failed", "bench base: timed out",
                                           "profile small ora: skipped"]
    measured["tests"] = {"outcome": outcome(gpu_report_build.NOT_ASKED)}  # left out of --sections: no failure
    assert gpu_report_build.failures(gpu_report_build.build_report(measured))[0] == "bench base: timed out"


def test_markdown_has_a_table_per_section():
    text = gpu_report_build.markdown(gpu_report_build.build_report(measurements()))
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert [h.split(" (")[0] for h in headings] == ["## Environment", "## GPU tests", "## Arms side by side",
                                                     "## Training loop", "## Where the device time goes",
                                                     "## Top CUDA kernels by self device time",
                                                     "## Commands and steps"]
    for section in text.split("\n## ")[1:]:
        assert "|---|" in section, section.splitlines()[0]
    assert "| small | vanilla | 250.0 | 200.0–300.0 | 262,144 | 262.1 | 26.5% | 4.00 | 8.00 | 0.50 |" in text
    assert "H100 SXM bf16 dense 989.5 TFLOP/s" in text and "| revision | `e36b532` |" in text
    assert "| small | vanilla | 4192 | 154.7 | 53% | 58.7 | 16.1 | 79.9 | 13.2 / 27.0 |" in text
    assert "| small | vanilla | optimizer_step | 20 | 40.0 | 4.0 | 41.0 |" in text  # a stretch of the step
    assert "| bench | base | timed out | 12 | logs/x.log | stopped after 180 s |" in text


def test_train_overrides_make_a_one_gpu_run_of_each_preset():
    for preset in ("small", "base"):
        cfg = load_run_config(str(preset_path(preset)), gpu_report_build.train_overrides(50))
        validate_for_world(cfg, 1)
        assert cfg.data.mock and cfg.train.steps == 50 and cfg.logging.wandb_mode == "disabled"


# ---------------------------------------------------------------------------- commands
@pytest.mark.slow
def test_commands_log_their_output_and_stop_at_their_limit(tmp_path, monkeypatch):
    ok = gpu_report.run_command([sys.executable, "-c", "print('hello')"], tmp_path, "ok", timeout=60)
    assert ok.status == "ok" and ok.returncode == 0 and "hello" in (tmp_path / "logs" / "ok.log").read_text()
    failed = gpu_report.run_command([sys.executable, "-c", "raise SystemExit('broken')"], tmp_path, "bad", timeout=60)
    assert failed.status == "failed" and failed.returncode == 1 and failed.detail.endswith("broken")
    monkeypatch.setattr(gpu_report, "MIN_COMMAND_S", 0)
    stuck = gpu_report.run_command([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path, "slow",
                                   timeout=0.5)
    assert stuck.status == "timed out" and stuck.seconds < 30 and stuck.log == "logs/slow.log"
    monkeypatch.setattr(gpu_report, "MIN_COMMAND_S", 20)
    assert gpu_report.run_command(["true"], tmp_path, "late", timeout=5).status == "skipped"


def test_the_cpu_suite_hides_gpus_from_what_it_starts():
    out = subprocess.run([sys.executable, "-c", "import os; print(repr(os.environ['CUDA_VISIBLE_DEVICES']))"],
                         capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "''" and os.environ["CUDA_VISIBLE_DEVICES"] == ""


# ---------------------------------------------------------------------------- on a GPU
@pytest.mark.gpu
def test_profiled_steps_give_a_trace_and_the_kernels_by_device_time(tmp_path):
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    trace = tmp_path / "trace.json.gz"
    events = gpu_report.profiled(lambda index: a @ a, 3, trace)
    kernels = gpu_report_build.top_kernels(events)
    assert kernels and kernels[0]["self_device_ms"] > 0 and kernels[0]["calls"] >= 3
    assert sum(k["share"] for k in kernels) == pytest.approx(1.0) or len(events) > len(kernels)
    assert json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
