"""pretrain.research.benchmarks.chaos without its runs: the seeded fault plan, the injected faults it
asks for, the Young/Daly model and the tables."""

from __future__ import annotations

import json

import pytest

from pretrain.job.faults import FaultInjection
from pretrain.research.benchmarks.chaos import (
    Fault,
    base_checkpoint_bytes,
    daly_interval,
    fault_override,
    goodput,
    paper_table,
    plan_faults,
)

KINDS = ["kill", "stop", "preempt", "spike", "nan", "kill", "stop"]


def test_the_plan_is_seeded_spread_out_and_knows_each_process_fault_s_job_and_attempt():
    faults = plan_faults(0, 1000, KINDS, nproc=2)
    assert faults == plan_faults(0, 1000, KINDS, nproc=2) != plan_faults(1, 1000, KINDS, nproc=2)
    assert sorted(f.kind for f in faults) == sorted(KINDS)
    steps = [f.step for f in faults]
    assert steps == sorted(steps) and 100 <= steps[0] and steps[-1] <= 900
    assert all(b - a >= 50 for a, b in zip(steps, steps[1:]))
    job = attempt = 0
    for fault in (f for f in faults if f.kind in ("kill", "stop", "preempt")):
        assert (fault.job, fault.attempt) == (job, attempt)  # each kill or hang restarts, a preemption requeues
        job, attempt = (job + 1, 0) if fault.kind == "preempt" else (job, attempt + 1)


def test_the_faults_are_valid_injections():
    faults = [Fault("kill", 10, rank=1, attempt=2), Fault("nan", 20), Fault("spike", 30)]
    entries = json.loads(fault_override(faults, streak=3).split("=", 1)[1])
    assert [(e["kind"], e.get("step"), e.get("batch")) for e in entries] == [
        ("kill", 10, None), ("nan", None, 20), ("nan", None, 21), ("nan", None, 22), ("spike", None, 30)]
    for i, entry in enumerate(entries):
        FaultInjection(**entry).validate(f"faults[{i}]")


def test_young_daly():
    assert daly_interval(10.0, 20_000.0) == pytest.approx((2 * 10.0 * 20_000.0) ** 0.5 - 10)
    best = daly_interval(10.0, 20_000.0)
    assert goodput(best, 10.0, 60.0, 20_000.0) > max(goodput(best * f, 10.0, 60.0, 20_000.0) for f in (0.5, 2.0))
    assert goodput(600.0, 0.0, 0.0, float("inf")) == 1.0
    table = paper_table(save_s=5.0, restart_s=60.0, hang_timeout_s=300.0)
    assert [row["mtbf_h"] for row in table["rows"]][:4] == [4, 12, 24, 96] and 300 < table["llama3_mtbf_h"] < 500
    assert all(row["goodput_hangs_only"] < row["goodput_at_daly"] for row in table["rows"])
    assert all(row["goodput_slow_restart"] < row["goodput_at_daly"] for row in table["rows"])
    assert 1.2e9 < base_checkpoint_bytes() < 1.6e9  # ~110M parameters in bf16 + fp32 master and Adam of ~96M
