"""One job at a time per run dir (pretrain/run_files/run_dir.py's lock): a second job is refused with status 2
naming the first and every process that holds the lock, a killed holder never blocks (what is left of
it gets a bounded wait), the lock is handed down to the processes a job starts (torchrun's workers, a
sweep's run) and no further, and the sweep's dry run decides as a real sweep does."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from pretrain_runs import REPO, arguments, command, env, forbid_workers, records, summary, write_config
from processes import workers_of

from pretrain import pretrain_ora
from pretrain.research.sweep.__main__ import main as sweep_main
from pretrain.research.sweep.runner import DoneSincePlanned, start
from pretrain.research.sweep.spec import LOG_NAME, Run, expand, load_spec
from pretrain.research.sweep.state import Task, run_state, started_record
from pretrain.run_files import run_dir as run_dir_module
from pretrain.run_files.lock import LOCK_ON_STDIN, RunDirBusy
from pretrain.run_files.run_dir import RunDir, config_hash
from pretrain.run_files.run_records import Summary

# Takes (or adopts) a run dir's lock as a job does, says so, and keeps it until killed.
HOLDER = ("import sys, time\nfrom pretrain.run_files.run_dir import RunDir\n"
          "lock = RunDir(sys.argv[1]).acquire_lock()\nprint('held', flush=True)\ntime.sleep(600)\n")


def holder_command(run_dir: Path) -> list[str]:
    return [sys.executable, "-c", HOLDER, str(run_dir)]


def start_holder(run_dir: Path, **popen) -> subprocess.Popen:
    holder = subprocess.Popen(holder_command(run_dir), cwd=REPO, stdout=subprocess.PIPE, text=True, **popen)
    assert holder.stdout.readline() == "held\n"
    return holder


def kill(process: subprocess.Popen) -> None:
    process.kill()
    process.wait()


# ---------------------------------------------------------------------- the lock


def test_lock_is_exclusive_records_its_holder_and_dies_with_it(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    assert run_dir.lock_holder() is None and not run_dir.path.exists()  # asking creates nothing
    holder = start_holder(run_dir.path)
    try:
        held_by = run_dir.lock_holder()
        assert held_by.startswith(f"pid {holder.pid} on ")
        assert held_by.endswith(f": {shlex.join([sys.executable, '-c', str(run_dir.path)])}")
        with pytest.raises(RunDirBusy, match=f"run dir {run_dir.path} is in use by pid {holder.pid} on "):
            run_dir.acquire_lock()
        with pytest.raises(RunDirBusy):
            run_dir.check_lock()
    finally:
        kill(holder)  # SIGKILL: no chance to release anything
    assert run_dir.lock_holder() is None
    run_dir.check_lock()
    lock = run_dir.acquire_lock()
    assert run_dir.lock_holder().startswith(f"pid {os.getpid()} on ")
    lock.release()
    assert run_dir.lock_holder() is None


def test_handed_down_lock_is_adopted_and_outlives_the_process_that_took_it(tmp_path):
    """The child gets the lock as stdin with LOCK_ON_STDIN: it adopts it instead of being refused,
    and keeps it held once the parent's descriptor is closed (as a killed parent's is)."""
    run_dir = RunDir(tmp_path / "run")
    lock = run_dir.acquire_lock()
    child = start_holder(run_dir.path, stdin=lock.fd, env={**os.environ, LOCK_ON_STDIN: "1"})
    try:
        lock.release()
        assert run_dir.lock_holder() is not None, "the child holds the lock"
    finally:
        kill(child)
    assert run_dir.lock_holder() is None

    # Without the variable, the same stdin is another job's lock: refused.
    lock = run_dir.acquire_lock()
    refused = subprocess.run(holder_command(run_dir.path), cwd=REPO, stdin=lock.fd, capture_output=True, text=True,
                             env={k: v for k, v in os.environ.items() if k != LOCK_ON_STDIN}, timeout=60)
    assert refused.returncode != 0 and "RunDirBusy" in refused.stderr
    lock.release()


def test_as_stdin_hands_the_lock_to_processes_started_within_and_then_restores_stdin(tmp_path):
    """As pretrain_ora.py hands its lock to the workers torchrun starts (which inherit only 0, 1, 2)."""
    run_dir = RunDir(tmp_path / "run")
    lock = run_dir.acquire_lock()
    stdin_before = os.fstat(0)
    with lock.as_stdin():
        child = start_holder(run_dir.path)
    assert os.path.samestat(os.fstat(0), stdin_before) and LOCK_ON_STDIN not in os.environ
    lock.release()
    try:
        assert run_dir.lock_holder() is not None, "the child holds the lock"
    finally:
        kill(child)
    assert run_dir.lock_holder() is None


def test_refusal_names_every_process_that_holds_the_lock(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    lock = run_dir.acquire_lock()  # recorded: this process, which lives on
    helpers = [subprocess.Popen(["sleep", "600"], stdin=lock.fd) for _ in range(2)]  # they inherited it
    lock.release()
    try:
        with pytest.raises(RunDirBusy) as refused:
            run_dir.acquire_lock()
        first, *held_by = str(refused.value).splitlines()
        assert first.startswith(f"run dir {run_dir.path} is in use by pid {os.getpid()} on ")
        assert sorted(held_by) == sorted(f"  held by pid {helper.pid}: sleep 600" for helper in helpers)
    finally:
        for helper in helpers:
            kill(helper)


def left_by_a_killed_job(run_dir: RunDir, straggler: list[str]) -> subprocess.Popen:
    """The lock as a job killed a moment ago leaves it: the process recorded in run.lock has ended, and
    `straggler`, a process of that job, still holds the lock."""
    lock = run_dir.acquire_lock()
    ended = subprocess.Popen(["true"])
    ended.wait()
    lock.record_holder(ended.pid, "the killed job")
    process = subprocess.Popen(straggler, stdin=lock.fd)
    lock.release()
    return process


def test_a_start_waits_for_what_is_left_of_a_killed_job(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    straggler = left_by_a_killed_job(run_dir, ["sleep", "1"])
    started = time.monotonic()
    run_dir.check_lock()
    lock = run_dir.acquire_lock()
    assert time.monotonic() - started < run_dir_module.STRAGGLER_WAIT_S
    assert straggler.poll() == 0, "the lock was taken once the straggler had exited"
    assert run_dir.lock_holder().startswith(f"pid {os.getpid()} on ")
    lock.release()


def test_a_straggler_that_outlives_the_wait_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(run_dir_module, "STRAGGLER_WAIT_S", 0.5)
    run_dir = RunDir(tmp_path / "run")
    straggler = left_by_a_killed_job(run_dir, ["sleep", "600"])
    try:
        for start in (run_dir.check_lock, run_dir.acquire_lock):
            started = time.monotonic()
            with pytest.raises(RunDirBusy) as refused:
                start()
            assert time.monotonic() - started >= 0.5
            message = str(refused.value)
            assert message.splitlines()[1:] == [f"  held by pid {straggler.pid}: sleep 600"]
            assert ": the killed job, which has ended, but 0.5 s later other processes still hold it" in message
    finally:
        kill(straggler)
    run_dir.acquire_lock().release()


# A rank as the entry's spawn starts it: holds the handed-down lock, starts a helper and forks a child.
RANK = ("import os, subprocess, sys, time\nfrom pretrain.run_files.run_dir import RunDir\n"
        "with RunDir(sys.argv[1]).handed_down_lock():\n"
        "    helper = subprocess.Popen(['sleep', '600'])\n"
        "    who = 'rank' if os.fork() else 'forked'\n"  # each says so once fork() has returned in it
        "    os.write(1, f'{who} {helper.pid} {os.getpid()}\\n'.encode())\n"
        "    time.sleep(600)\n")


def test_a_rank_keeps_the_handed_down_lock_from_the_processes_it_starts(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    lock = run_dir.acquire_lock()
    rank = subprocess.Popen([sys.executable, "-c", RANK, str(run_dir.path)], cwd=REPO, stdin=lock.fd,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, LOCK_ON_STDIN: "1"},
                            start_new_session=True)
    try:
        said = {who: (int(helper), int(pid)) for who, helper, pid in (rank.stdout.readline().split() for _ in "12")}
        (helper, _), (_, forked) = said["rank"], said["forked"]
        lock.release()
        assert [holder.pid for holder in run_dir.lock_holders()] == [rank.pid]
        assert os.readlink(f"/proc/{helper}/fd/0") == "/dev/null"
        kill(rank)
        assert run_dir.lock_holder() is None, "the rank's helper and forked child, still alive, do not hold it"
        assert all(Path(f"/proc/{pid}").exists() for pid in (helper, forked))
    finally:
        os.killpg(rank.pid, signal.SIGKILL)
        rank.wait()


# ---------------------------------------------------------------------- the entry point


@pytest.mark.slow
def test_second_job_exits_2_naming_the_holder_and_a_killed_holder_does_not_block(tmp_path, capsys):
    config, run_dir = write_config(tmp_path), tmp_path / "run"
    holder = start_holder(run_dir)
    try:
        for extra in ([], ["--check-only"]):
            assert pretrain_ora.main(["--config", str(config), "--run-dir", str(run_dir), *extra]) == 2
            err = capsys.readouterr().err
            assert f"error: run dir {run_dir} is in use by pid {holder.pid} on " in err, err
            assert "Traceback" not in err
        assert sorted(p.name for p in run_dir.iterdir()) == ["run.lock"], "the refused job wrote nothing"
    finally:
        kill(holder)
    record = RunDir(run_dir).lock_file.read_text()
    assert pretrain_ora.main(["--config", str(config), "--run-dir", str(run_dir), "--check-only"]) == 0
    assert RunDir(run_dir).lock_file.read_text() == record, "--check-only writes nothing"
    assert RunDir(run_dir).lock_holder() is None, "--check-only keeps nothing"


@pytest.mark.distributed
def test_the_same_two_process_command_started_twice_trains_once(tmp_path, capsys, monkeypatch):
    config, run_dir = write_config(tmp_path), tmp_path / "run"
    # Long enough to outlive the second start; stopped by SIGTERM (checkpoint, exit 0) once it was refused.
    overrides = ["train.steps=5000", "train.eval_interval=5000", "checkpoint.save_interval=5000"]
    log = tmp_path / "first.log"
    with open(log, "w") as first_log:
        first = subprocess.Popen(command(config, run_dir, overrides, nproc=2), cwd=REPO, env=env(),
                                 stdout=first_log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 240
        while not records(run_dir) and first.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert records(run_dir), "the first run did not start training"
        workers = workers_of(first)
        assert len(workers) == 2
        # Handed down by the launcher, held while any of them lives, on a descriptor their children do not get.
        assert {holder.pid for holder in RunDir(run_dir).lock_holders()} == {first.pid, *workers}
        for pid in workers:
            assert os.readlink(f"/proc/{pid}/fd/0") == "/dev/null"

        # The second start, in this process: refused before it would start a worker.
        forbid_workers(monkeypatch)
        started = time.time()
        assert pretrain_ora.main(arguments(config, run_dir, overrides, nproc=2)) == 2
        err = capsys.readouterr().err
        assert f"run dir {run_dir} is in use by pid {first.pid} on " in err
        assert "pretrain_ora.py" in err.splitlines()[-4]  # the holder's command, then the processes holding it
        assert all(f"  held by pid {pid}: " in err for pid in (first.pid, *workers))
        assert time.time() - started < 120 and first.poll() is None

        os.kill(workers[0], signal.SIGTERM)  # every rank agrees to stop after the current step
        first.wait(timeout=180)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 0, log.read_text()[-3000:]
    steps = [r.step for r in records(run_dir)]
    assert steps == list(range(1, len(steps) + 1)), "one job wrote metrics.jsonl, each step once"
    assert summary(run_dir).preempted and summary(run_dir).steps == steps[-1]
    assert RunDir(run_dir).lock_holder() is None


# ---------------------------------------------------------------------- the sweep


def _spec(directory: Path) -> Path:
    write_config(directory)
    spec = {"config": "run.yaml", "reference": "finished", "seeds": [1],
            "scales": {"cpu": {"processes_per_node": 1, "set": {"train.steps": 4}}},
            "arms": {name: {"set": {"model.attention.type": "ora"}} for name in
                     ("finished", "completed_alone", "held", "pending", "killed_before_a_save")}}
    path = directory / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def _finish(run: Run, status: str, config_hash: str) -> None:
    record = started_record(run, "revision")
    record.status, record.config_hash = status, config_hash
    run.run_dir.write_experiment(record)
    run.run_dir.write_summary(Summary(final_train_loss=5.0, final_valid_loss=5.0, final_test_loss=5.0,
                                      wall_time_s=1.0, steps=4, stopped_early=False, preempted=False,
                                      tokens_seen=1, skipped_steps=0, trainable_params=1, frozen_params=1))


def test_sweep_hands_the_lock_to_its_run_which_outlives_the_sweep(tmp_path):
    (run, *_) = expand(load_spec(_spec(tmp_path)), "cpu", None, [], tmp_path / "out")
    task = Task(run, train=True, evaluations=[])

    def launch(run: Run) -> tuple[list[str], dict[str, str]]:
        return holder_command(run.run_dir.path), dict(os.environ)

    attempt = start(task, launch, dict(os.environ), "revision")
    try:
        deadline = time.time() + 60
        while attempt.process.poll() is None and "held" not in (run.run_dir.path / LOG_NAME).read_text():
            assert time.time() < deadline
            time.sleep(0.05)
        attempt.lock.release()  # the sweep's descriptor closed, as a SIGKILLed sweep's is
        assert run_state(run) == "running"
        assert run.run_dir.lock_holder().startswith(f"pid {attempt.process.pid} on ")  # the run, not the sweep
        with pytest.raises(RunDirBusy):
            start(task, launch, dict(os.environ), "revision")
    finally:
        kill(attempt.process)
    assert run_state(run) == "interrupted"  # its record says "running", nobody holds the lock


def test_a_step_another_sweep_finished_since_the_plan_is_skipped_under_the_lock(tmp_path):
    """Two sweeps on one sweep dir: each planned the pending run; the first trains it to the end; the
    second, when its turn comes, reads the run again under the lock and starts nothing."""
    (run, *_) = expand(load_spec(_spec(tmp_path)), "cpu", None, [], tmp_path / "out")
    training, evaluation = Task(run, train=True, evaluations=["attention"]), Task(run, False, ["attention"])

    def launch(run: Run) -> tuple[list[str], dict[str, str]]:
        raise AssertionError("a finished run was started again")

    _finish(run, "finished", config_hash(run.cfg))  # the other sweep, after this one planned
    with pytest.raises(DoneSincePlanned, match="finished by another job since this sweep planned it"):
        start(training, launch, dict(os.environ), "revision")
    assert run.run_dir.lock_holder() is None and run.run_dir.read_experiment().status == "finished"
    run.run_dir.evaluation_file("attention").parent.mkdir(parents=True, exist_ok=True)
    run.run_dir.evaluation_file("attention").write_text("{}")
    with pytest.raises(DoneSincePlanned):
        start(evaluation, launch, {}, "revision")
    assert run.run_dir.lock_holder() is None


@pytest.mark.slow
def test_dry_run_decides_as_the_real_sweep_does(tmp_path, capsys):
    spec, out = _spec(tmp_path), tmp_path / "out"
    runs = {run.arm: run for run in expand(load_spec(spec), "cpu", None, [], out)}
    _finish(runs["finished"], "finished", "0" * 64)  # finished with another config than the spec's now
    _finish(runs["completed_alone"], "running", config_hash(runs["completed_alone"].cfg))
    runs["killed_before_a_save"].run_dir.write_experiment(started_record(runs["killed_before_a_save"], "revision"))
    held = runs["held"].run_dir.acquire_lock()  # any job in the run dir, not only a sweep
    try:
        assert sweep_main(["--spec", str(spec), "--out", str(out), "--dry-run"]) == 0
        captured = capsys.readouterr()
        assert captured.out.splitlines() == ["spec/finished/seed1: finished -> skip",
                                             "spec/completed_alone/seed1: finished -> skip",
                                             "spec/held/seed1: running -> skip (running elsewhere)",
                                             "spec/pending/seed1: pending -> start",
                                             "spec/killed_before_a_save/seed1: interrupted -> "
                                             "restart (from step 0: it saved no checkpoint)"]
        assert "warning: spec/finished/seed1 finished with another config" in captured.err
        assert runs["completed_alone"].run_dir.read_experiment().status == "running", "a dry run writes nothing"

        # A run to start without its data: the real sweep refuses before starting anything, and so does the dry run.
        missing = ["--set", "data.mock=false", "--set", f"data.manifest={tmp_path / 'missing.json'}"]
        outcomes = []
        for mode in (["--dry-run"], []):
            code = sweep_main(["--spec", str(spec), "--out", str(out), *missing, *mode])
            outcomes.append((code, capsys.readouterr()))
        (dry_code, dry), (real_code, real) = outcomes
        assert dry_code == real_code == 2
        assert dry.err == real.err
        assert "arm 'pending'" in dry.err and "missing.json" in dry.err and "warning: spec/finished" in dry.err
        assert dry.out == "" and "-> start" not in real.out
        assert not runs["pending"].run_dir.path.exists()
    finally:
        held.release()
