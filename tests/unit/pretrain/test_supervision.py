"""A job that needs no one watching (pretrain/launch/supervisor.py): which failures are restarted, the records
each failure leaves, stops on request, hangs reported by a watchdog; and the watchdog itself
(pretrain/training/watchdog.py). The supervisor runs over stand-in attempts in a process of its own
(tests/support/supervised.py); real trainings are in tests/integration/test_unattended.py."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from pretrain_runs import REPO

from pretrain.launch.supervisor import RestartPolicy, describe_status
from pretrain.run_files.run_dir import RunDir
from pretrain.training.watchdog import Watchdog

FINAL = {2: "refused", 3: "the run stopped itself"}


# ---------------------------------------------------------------------- the policy
def test_refusals_and_stops_the_run_decided_are_never_retried():
    policy = RestartPolicy(max_restarts=5, backoff_s=1.0, final=FINAL)
    assert policy.decide(2, progressed=True) == "exit 2 (refused) is never retried"
    assert policy.decide(3, progressed=False) == "exit 3 (the run stopped itself) is never retried"


def test_a_crash_loop_stops_after_max_restarts_failures_in_a_row_without_progress():
    policy = RestartPolicy(max_restarts=2, backoff_s=1.0, final=FINAL)
    assert policy.decide(1, progressed=True) is None and policy.backoff() == 1.0
    assert policy.decide(-9, progressed=False) is None and policy.backoff() == 2.0  # doubled in a streak
    assert "3 failures in a row without a newer checkpoint" in policy.decide(1, progressed=False)
    # A failure after progress (a newer checkpoint) starts a new streak: a long run's faults never add up.
    policy = RestartPolicy(max_restarts=1, backoff_s=1.0, final=FINAL)
    assert all(policy.decide(1, progressed=True) is None for _ in range(50))
    assert policy.backoff() == 1.0
    assert RestartPolicy(0, 1.0, FINAL).decide(1, progressed=True) == "supervision.max_restarts is 0"


@pytest.mark.slow
def test_a_worker_never_loads_the_supervisor():
    """Every rank imports the worker: what it knows of its job comes from pretrain/job/, and the supervisor
    (its process-tree scans, its restarts) stays the launching process's."""
    probe = ("import sys, pretrain.training.worker\n"
             "print(sorted(m for m in sys.modules if m.startswith('pretrain.launch')))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("launcher", ["parent", "gone"])
def test_a_worker_whose_named_launcher_is_gone_dies_at_once(launcher):
    """A launcher that died while its worker was importing: the worker's parent is no longer the process
    named in LAUNCHER_VARIABLE, and die_with_launcher kills it instead of leaving it to train alone."""
    code = ("import os, sys; from pretrain.job.supervision import LAUNCHER_VARIABLE, die_with_launcher\n"
            "os.environ[LAUNCHER_VARIABLE] = str(os.getppid() if sys.argv[1] == 'parent' else 2**22 + 1)\n"
            "die_with_launcher(); print('alive')")
    done = subprocess.run([sys.executable, "-c", code, launcher], cwd=REPO, capture_output=True, text=True)
    if launcher == "parent":
        assert (done.returncode, done.stdout) == (0, "alive\n")
    else:
        assert done.returncode == -signal.SIGKILL and done.stdout == ""


def test_statuses_are_described_by_name():
    assert describe_status(-signal.SIGKILL, {}) == "SIGKILL"
    assert describe_status(4, {4: "hung"}) == "exit 4 (hung)"
    assert describe_status(1, {}) == "exit 1"


# ---------------------------------------------------------------------- the supervisor
SCENARIOS = {
    # a failure at step 7, resumed from 5; the same step fails twice more without a newer checkpoint
    "crash loop": (2, [{"status": 1, "ranks": {"1": -9, "0": 1}, "step": 7, "checkpoint": 5,
                        "print": "rank 1 dies"},
                       {"status": 1, "ranks": {"0": 1}, "step": 7}]),
    "refused": (3, [{"status": 2, "print": "error: config error"}]),
    # torchrun's status is 1 whatever its ranks' were: a rank's refusal still ends the job
    "a rank refused": (3, [{"status": 1, "ranks": {"0": 2, "1": 2}}]),
    "recovers": (1, [{"status": 1, "ranks": {"1": -9}, "checkpoint": 5, "step": 6, "print": "boom"},
                     {"status": 0, "checkpoint": 10, "step": 10, "ended": True}]),
    "stop signal": (3, [{"worker": "sleep", "stop_signal": True, "ended": True}]),
    "hang": (3, [{"worker": "stop", "hang": True, "step": 3, "checkpoint": 2},
                 {"status": 0, "checkpoint": 4, "ended": True}]),
    "launcher exits 0 early": (1, [{"status": 0, "ended": False}, {"status": 0, "ended": True}]),
}


@pytest.fixture(scope="module")
def supervised(tmp_path_factory) -> dict:
    """name -> (status, attempts launched, restart records, stderr) of each of SCENARIOS."""
    root = tmp_path_factory.mktemp("supervised")
    specs = [{"run_dir": str(root / f"run{i}"), "result": str(root / f"result{i}.json"), "max_restarts": limit,
              "attempts": attempts} for i, (limit, attempts) in enumerate(SCENARIOS.values())]
    (root / "scenarios.json").write_text(json.dumps(specs))
    driver = REPO / "tests" / "support" / "supervised.py"
    out = subprocess.run([sys.executable, str(driver), str(root / "scenarios.json")], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    results = {}
    for name, spec in zip(SCENARIOS, specs):
        result = json.loads(Path(spec["result"]).read_text())
        results[name] = (result["status"], result["attempts"], RunDir(spec["run_dir"]).read_restarts())
    return {**results, "stderr": out.stderr}


@pytest.mark.slow
def test_a_crash_loop_stops_with_its_causes(supervised):
    status, attempts, records = supervised["crash loop"]
    assert status == 1 and attempts == [0, 1, 2]
    assert [r.action for r in records] == ["restart", "restart", "stop"]
    first = records[0]
    assert first.ranks == {"0": "exit 1", "1": "SIGKILL"} and first.cause == "rank 0: exit 1, rank 1: SIGKILL"
    assert (first.failed_at_step, first.resumed_from_step, first.steps_redone) == (7, 5, 2)
    assert "rank 1 dies" in first.log_tail
    assert "error: the job stops: 3 failures in a row without a newer checkpoint" in supervised["stderr"]
    assert "  attempt 2 at step 7: rank 0: exit 1" in supervised["stderr"]


@pytest.mark.slow
def test_a_refusal_is_never_retried(supervised):
    status, attempts, records = supervised["refused"]
    assert status == 2 and attempts == [0]
    assert [(r.action, r.cause) for r in records] == [("stop", "launcher exit 2 (refused)")]
    assert "error: config error" in records[0].log_tail


@pytest.mark.slow
def test_a_rank_s_refusal_is_never_retried_whatever_the_launcher_s_status(supervised):
    status, attempts, records = supervised["a rank refused"]
    assert status == 2 and attempts == [0]
    assert [(r.action, r.cause) for r in records] == [("stop", "rank 0: exit 2 (refused), rank 1: exit 2 (refused)")]


@pytest.mark.slow
def test_a_failed_job_restarts_and_records_what_it_lost(supervised):
    status, attempts, records = supervised["recovers"]
    assert status == 0 and attempts == [0, 1]
    (record,) = records
    assert (record.action, record.attempt, record.resumed_from_step, record.steps_redone) == ("restart", 0, 5, 1)
    assert record.seconds_lost >= 0 and record.backoff_s == 0.01 and record.host


@pytest.mark.slow
def test_a_stop_signal_reaches_the_workers_and_is_never_restarted(supervised):
    status, attempts, records = supervised["stop signal"]
    assert status == 0 and attempts == [0] and records == []


@pytest.mark.slow
def test_a_reported_hang_kills_a_stopped_worker_and_restarts(supervised):
    status, attempts, records = supervised["hang"]
    assert status == 0 and attempts == [0, 1]
    (record,) = records
    assert record.cause.startswith("launcher SIGKILL; hang reported in ") and record.hang_dumps
    assert "a rank reported a hang: stopping the job's ranks" in record.log_tail


@pytest.mark.slow
def test_a_launcher_that_exits_0_before_the_run_ended_counts_as_a_failure(supervised):
    status, attempts, records = supervised["launcher exits 0 early"]
    assert status == 0 and attempts == [0, 1]
    assert records[0].cause == "launcher exit 0 although the run did not end"


# ---------------------------------------------------------------------- the watchdog
@pytest.mark.slow
def test_watchdog_dumps_every_stack_and_exits_with_its_status_after_a_silent_step(tmp_path):
    exits = []
    watchdog = Watchdog(RunDir(tmp_path), rank=1, timeout_s=0.2, exit_code=4, exit=exits.append)
    try:
        time.sleep(0.3)  # start-up (before the first step) never counts
        assert not exits
        with watchdog.paused():  # nor does evaluation or a checkpoint save
            watchdog.beat(2)
            time.sleep(0.3)
        assert not exits
        deadline = time.time() + 30
        while not exits and time.time() < deadline:
            time.sleep(0.05)
        assert exits == [4]
    finally:
        watchdog.stop()
    (dump,) = RunDir(tmp_path).hang_dumps()
    assert dump.name.endswith("-step00000002-rank1.txt") and watchdog.fired == str(dump)
    text = dump.read_text()
    assert text.startswith("rank 1 (pid ") and "after step 2 (supervision.hang_timeout_s=0.2)" in text
    assert "test_watchdog_dumps_every_stack" in text  # the loop's thread, blocked where it was
    assert threading.current_thread() is threading.main_thread()


def test_watchdog_stays_quiet_while_steps_finish(tmp_path):
    exits = []
    watchdog = Watchdog(RunDir(tmp_path), rank=0, timeout_s=5.0, exit_code=4, exit=exits.append)
    for step in range(1, 6):
        watchdog.beat(step)
        time.sleep(0.02)
    watchdog.stop()
    assert exits == [] and RunDir(tmp_path).hang_dumps() == []
