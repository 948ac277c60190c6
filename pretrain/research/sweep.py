"""Seeded sweeps: every arm of an experiment spec × every seed, each a run of pretrain.pretrain_ora.

    python -m pretrain.research.sweep --spec pretrain/experiments/core.yaml --out runs/sweeps/core [--scale cpu|paper]
        [--seeds 42,2024,...] [--set key=value ...] [--jobs N] [--retry-failed]
        [--dry-run | --emit commands | --emit slurm]

A spec (pretrain/experiments/*.yaml; a top-level `base: other.yaml` inherits as in run configs):

    config: small                     # the run config: a preset name (pretrain/configs/) or a path
    description: ...                  #   relative to the spec file given on the command line
    reference: vanilla                # the arm the others are compared with (pretrain.research.report)
    seeds: [42, 2024, 12345, 98765, 555666]
    scales:                           # --scale picks one
      cpu: {processes_per_node: 1, set: {model.num_layers: 4, train.steps: 2000, ...}}
      paper: {processes_per_node: 8, set: {}}
    arms:
      vanilla: {description: trainable Q/K/V, set: {model.attention.type: vanilla}}
      wide: {set: {...}, scales: {cpu: {model.hidden_size: 256}, paper: {model.hidden_size: 1024}}}

Each run is the config with, in this order, the scale's `set`, the arm's `set`, the arm's own
overrides at that scale, the command line's `--set`, then the seed, as `--set key=value` arguments
of the entry point. The seed sets `model.seed` (every weight init, frozen Q/K included, and through
the model build's seeding the dropout RNG) and `data.seed` (megatron-core's shuffling, so
the data order follows the seed too); arms of one seed see the same data in the same order, which
is what makes them paired samples. Every expanded config is validated for its process count
before anything starts; an error names the spec, the arm and the key, and the sweep exits 2.

Run dirs are OUT/<arm>/seed<seed>, ordered seed-major (all arms of the first seed first, so the
first finished runs already form a paired comparison). Each holds the run's own files, `sweep.log`
(the run's stdout and stderr, appended per attempt), its lock `run.lock` (pretrain.run_dir: the one
every job in a run dir takes, by which pretrain_ora.py refuses a second job) and `experiment.yaml`
(pretrain.run_dir.ExperimentRecord: "running" when started, "finished" or "failed" when it ended).
A run's state, read back from them:

    running      its lock is held: a sweep, the run or any other job is alive in it   left alone
    finished     record "finished" (exit 0) and summary.json, or record "running"     skipped
                 and a complete summary (it completed alone after its sweep was gone)
    failed       record "failed" (exit code and log tail recorded)      skipped unless --retry-failed
    interrupted  record "running" or a checkpoint, nobody holds the lock  started again: resumes
    pending      nothing yet                                             started

The sweep takes a run's lock before it records and starts the run, and hands it to the run's
process (pretrain.run_dir.RunDirLock: as its stdin), which holds it to its end: a run outlives a
sweep killed with SIGKILL without being started twice, and if it completes alone the next
invocation records it as finished. A restarted run gets the same command; pretrain_ora.py resumes
the run dir from its checkpoint. SIGTERM/SIGINT stop the sweep: no new run starts, running ones
are sent SIGTERM (they checkpoint and exit) and stay "running" in their record, so the next
invocation resumes them. The sweep exits 0 when every run is finished, 1 when some are not, 2 on
an invalid spec or config or a run to start without its data, 128 + N on signal N.

`--dry-run` prints, for every run, its state and what this invocation would do with it, decided
by the same code as a real invocation (including the warning about finished runs whose config
changed, and the refusal, status 2, when a run to start has no data); it writes nothing.

`--emit commands` prints one shell-quoted entry-point command per run. `--emit slurm` writes
OUT/sweep.sbatch, an array job whose task i calls this module with `--task i`: it runs run i
through `launch/pretrain_ora.sh CONFIG --set ...` (RUN_DIR, NNODES, GPUS_PER_NODE in its
environment) with the same records, skips and locks as a local run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from ora_megatron.config_io import ConfigError, check, from_dict, load_yaml, to_dict
from pretrain.config import REPO, RunConfig, config_hash, load_run_config, preset_path, validate_for_world
from pretrain.pretrain_ora import ENTRY_MODULE
from pretrain.run_dir import LOCK_ON_STDIN, ExperimentRecord, RunDir, RunDirBusy, RunDirLock

LAUNCH_SCRIPT = REPO / "launch" / "pretrain_ora.sh"
DESIGN_SEEDS = [42, 2024, 12345, 98765, 555666]  # DESIGN.md: seeds for every comparison
SEED_KEYS = ("model.seed", "data.seed")
ARM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
LOG_NAME = "sweep.log"
LOG_TAIL_LINES = 40
POLL_S = 0.2

EXIT_ALL_FINISHED, EXIT_NOT_ALL_FINISHED, EXIT_SPEC_ERROR = 0, 1, 2


class SweepError(Exception):
    """A spec, an expanded config or the command line is invalid; nothing was started."""


# ---------------------------------------------------------------------- the spec


@dataclass
class ScaleSpec:
    processes_per_node: int = 1
    """Processes of one run, all on one node (its GPUs on a cluster); multi-node runs are not swept yet."""
    set: dict[str, Any] = field(default_factory=dict)
    """Config overrides (dotted key: value) of every run at this scale."""

    def validate(self, key: str) -> None:
        check(self.processes_per_node >= 1, f"{key}.processes_per_node", "must be >= 1")


@dataclass
class ArmSpec:
    description: str = ""
    """What the arm is (the record's notes)."""
    set: dict[str, Any] = field(default_factory=dict)
    """Config overrides of this arm at every scale."""
    scales: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Config overrides of this arm at one scale (e.g. its width at cpu and at paper scale)."""


@dataclass
class SweepSpec:
    config: str = ""
    """Run config: a preset name (pretrain/configs/NAME.yaml) or a path relative to the spec file."""
    description: str = ""
    reference: str = ""
    """The arm the others are compared with."""
    seeds: list[int] = field(default_factory=lambda: list(DESIGN_SEEDS))
    scales: dict[str, ScaleSpec] = field(default_factory=dict)
    arms: dict[str, ArmSpec] = field(default_factory=dict)

    def validate(self, key: str) -> None:
        check(bool(self.config), "config", "name the run config (a preset name or a path)")
        check(bool(self.arms), "arms", "a spec needs at least one arm")
        check(self.reference in self.arms, "reference", f"{self.reference!r} is not one of the arms {list(self.arms)}")
        check(bool(self.seeds) and len(set(self.seeds)) == len(self.seeds), "seeds", "must be distinct, at least one")
        for name, arm in self.arms.items():
            check(bool(ARM_NAME.fullmatch(name)), f"arms.{name}", "arm names become directory names: "
                  "letters, digits, '_', '.', '-'")
            unknown = sorted(set(arm.scales) - set(self.scales))
            check(not unknown, f"arms.{name}.scales", f"unknown scales {unknown} (the spec has {list(self.scales)})")


@dataclass
class Spec:
    name: str  # the spec file's stem: the first part of every experiment_id
    path: Path
    config_path: Path
    body: SweepSpec


def load_spec(path: Path) -> Spec:
    try:
        body = from_dict(SweepSpec, load_yaml(path))
    except (ConfigError, OSError, yaml.YAMLError) as e:
        raise SweepError(f"{path}: {e}") from None
    config_path = preset_path(body.config) or (path.parent / body.config).resolve()
    if not config_path.is_file():
        raise SweepError(f"{path}: config {body.config!r}: no file {config_path}")
    return Spec(name=path.stem, path=path, config_path=config_path, body=body)


# ---------------------------------------------------------------------- expansion


def yaml_value(value: Any) -> str:
    """A value as the YAML text `--set key=value` parses back to it."""
    return yaml.safe_dump(value, default_flow_style=True, width=2**31).strip().removesuffix("...").strip()


def set_arguments(overrides: dict[str, Any]) -> list[str]:
    return [f"{key}={yaml_value(value)}" for key, value in overrides.items()]


@dataclass
class Run:
    spec: Spec
    arm: str
    seed: int
    scale: ScaleSpec
    run_dir: RunDir
    overrides: list[str]  # the `--set` arguments, in order
    cfg: RunConfig

    @property
    def experiment_id(self) -> str:
        return f"{self.spec.name}/{self.arm}/seed{self.seed}"

    @property
    def log(self) -> Path:
        return self.run_dir.path / LOG_NAME

    def set_flags(self) -> list[str]:
        return [arg for item in self.overrides for arg in ("--set", item)]

    def local_command(self) -> list[str]:
        """The entry point as a user runs it (torchrun spawned by it for more than one process)."""
        return [sys.executable, "-m", ENTRY_MODULE, "--config", str(self.spec.config_path), "--run-dir",
                str(self.run_dir.path), "--nproc-per-node", str(self.scale.processes_per_node), *self.set_flags()]

    def launch_command(self) -> tuple[list[str], dict[str, str]]:
        """launch/pretrain_ora.sh and the environment it reads (a cluster task)."""
        env = {"RUN_DIR": str(self.run_dir.path), "NNODES": "1",
               "GPUS_PER_NODE": str(self.scale.processes_per_node)}
        return [str(LAUNCH_SCRIPT), str(self.spec.config_path), *self.set_flags()], env


def parse_seeds(text: str) -> list[int]:
    """--seeds 42,2024: distinct integers (a usage error, exit 2, otherwise)."""
    try:
        seeds = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"expected distinct integers, got {text!r}")
    return seeds


def expand(spec: Spec, scale_name: str, seeds: Optional[list[int]], extra: list[str], out: Path) -> list[Run]:
    """Every (seed, arm) run with its validated config, seed-major; raises SweepError on the first bad one."""
    body = spec.body
    if scale_name not in body.scales:
        raise SweepError(f"{spec.path}: no scale {scale_name!r} (the spec has {list(body.scales)})")
    seeded = [item for item in extra if item.partition("=")[0] in SEED_KEYS]
    if seeded:
        raise SweepError(f"--set {seeded[0]}: {' and '.join(SEED_KEYS)} are set per run from the seeds (--seeds)")
    scale = body.scales[scale_name]
    runs = []
    for seed in seeds or body.seeds:
        for arm_name, arm in body.arms.items():
            overrides = (set_arguments(scale.set) + set_arguments(arm.set)
                         + set_arguments(arm.scales.get(scale_name, {})) + list(extra)
                         + [f"{key}={seed}" for key in SEED_KEYS])
            try:
                cfg = load_run_config(str(spec.config_path), overrides)
                validate_for_world(cfg, scale.processes_per_node)
            except ConfigError as e:
                raise SweepError(f"{spec.path}: arm '{arm_name}' (scale {scale_name}, seed {seed}, "
                                 f"{scale.processes_per_node} processes): {e}") from None
            runs.append(Run(spec, arm_name, seed, scale, RunDir(out / arm_name / f"seed{seed}"), overrides, cfg))
    return runs


def check_run_data(runs: list[Run]) -> None:
    """The datasets every run reads exist and give each split documents (once per distinct data config)."""
    with warnings.catch_warnings():  # megatron-core warns at import about optional kernels it lacks
        warnings.simplefilter("ignore")
        from pretrain.runtime.data import check_data

    checked = set()
    for run in runs:
        key = json.dumps([to_dict(run.cfg.data), run.cfg.model.seq_length], sort_keys=True)
        if key in checked:
            continue
        checked.add(key)
        try:
            check_data(run.cfg)
        except (ConfigError, OSError) as e:
            raise SweepError(f"{run.spec.path}: arm '{run.arm}' (seed {run.seed}): {e}") from None


# ---------------------------------------------------------------------- run state


def run_state(run: Run) -> str:
    """running, finished, failed, interrupted or pending (see the module docstring)."""
    if run.run_dir.lock_holder() is not None:
        return "running"
    record = run.run_dir.read_experiment()
    if record is not None and record.status == "finished" and run.run_dir.summary.exists():
        return "finished"
    if record is not None and record.status == "running" and completed_summary(run.run_dir):
        return "finished"  # completed alone after its sweep was gone: record_orphans_that_completed
    if record is not None and record.status == "failed":
        return "failed"
    if (record is not None and record.status == "running") or run.run_dir.latest_checkpoint() is not None:
        return "interrupted"
    return "pending"


def to_start(runs: list[Run], retry_failed: bool) -> list[Run]:
    startable = {"pending", "interrupted"} | ({"failed"} if retry_failed else set())
    return [run for run in runs if run_state(run) in startable]


def plan(runs: list[Run], retry_failed: bool) -> list[Run]:
    """What an invocation decides before it starts anything, for the real run and the dry run
    alike: warn about finished runs whose config changed, choose the runs to start, and check
    their data (SweepError). Returns the runs to start."""
    warn_changed_configs(runs)
    starting = to_start(runs, retry_failed)
    if starting:
        check_run_data(starting)
    return starting


def completed_summary(run_dir: RunDir) -> bool:
    """summary.json of a run that trained to its end or stopped early (not one stopped by a signal)."""
    return run_dir.summary.exists() and not run_dir.read_summary().preempted


def record_orphans_that_completed(runs: list[Run]) -> None:
    """A run outlives a sweep killed with SIGKILL and may complete alone: its record still says
    "running", nobody holds its lock and its summary is complete (run_state: finished). Record it
    as finished (exit code unknown)."""
    for run in runs:
        record = run.run_dir.read_experiment()
        if record is not None and record.status == "running" and run_state(run) == "finished":
            record.status, record.results = "finished", results_of(run.run_dir)
            run.run_dir.write_experiment(record)
            print(f"{run.experiment_id}: completed after its sweep was gone; recorded as finished")


def warn_changed_configs(runs: list[Run]) -> None:
    """A finished run is never rerun; say so when the spec or --set now resolve to another config."""
    for run in runs:
        record = run.run_dir.read_experiment()
        if run_state(run) == "finished" and record.config_hash != config_hash(run.cfg):
            print(f"warning: {run.experiment_id} finished with another config (hash {record.config_hash[:12]}, "
                  f"now {config_hash(run.cfg)[:12]}); kept, not rerun: use another --out", file=sys.stderr)


# ---------------------------------------------------------------------- records


def git_revision() -> str:
    """HEAD of this checkout, "-dirty" when the work tree has changes; empty outside git."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()

    try:
        revision = git("rev-parse", "HEAD")
        return revision + ("-dirty" if revision and git("status", "--porcelain") else "")
    except OSError:
        return ""


def started_record(run: Run, revision: str) -> ExperimentRecord:
    """Status "running"; a restarted run keeps the start time of its first attempt."""
    previous = run.run_dir.read_experiment()
    start_time = (previous.start_time if previous is not None
                  else datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    resolved = to_dict(run.cfg)
    return ExperimentRecord(
        experiment_id=run.experiment_id, method=run.arm, seed=run.seed, start_time=start_time,
        model_config=resolved.pop("model"), training_config=resolved, results={},
        notes=run.spec.body.arms[run.arm].description, status="running", exit_code=None, log_tail="",
        config_hash=config_hash(run.cfg), git_revision=revision)


def results_of(run_dir: RunDir) -> dict:
    """The research plan's results from the run's summary (wall time: the last attempt's training loop)."""
    summary = run_dir.read_summary()
    val_loss = summary.final_valid_loss
    return {"final_train_loss": summary.final_train_loss, "final_val_loss": val_loss,
            "final_val_ppl": math.exp(val_loss) if val_loss is not None else None,
            "training_time_hours": summary.wall_time_s / 3600}


def log_tail(log: Path, offset: int) -> str:
    with open(log, errors="replace") as f:
        f.seek(offset)
        return "\n".join(f.read().splitlines()[-LOG_TAIL_LINES:])


# ---------------------------------------------------------------------- running


@dataclass
class Attempt:
    """One start of a run: its process, the lock it holds, where its part of sweep.log begins."""

    run: Run
    record: ExperimentRecord
    process: subprocess.Popen
    lock: RunDirLock
    log_offset: int
    started: float


def start(run: Run, command: list[str], env: dict[str, str], revision: str) -> Attempt:
    """Take the run's lock, record it as running and start its process (RunDirBusy: another job runs it)."""
    lock = run.run_dir.acquire_lock()
    record = started_record(run, revision)
    run.run_dir.write_experiment(record)
    with open(run.log, "a") as log:
        log.write(f"== {datetime.datetime.now().isoformat(timespec='seconds')} sweep starts: {shlex.join(command)}\n")
        log.flush()
        offset = log.tell()
        # The lock goes to the run's process too: it stays held while the run lives, whatever
        # happens to this sweep, so no other job starts in the run dir meanwhile.
        try:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=lock.fd,
                                       env={**env, LOCK_ON_STDIN: "1"})
        except OSError as e:  # e.g. no launch script on this checkout; the record says "running": retried
            lock.release()
            raise SweepError(f"cannot start {run.experiment_id}: {e}") from None
    lock.record_holder(process.pid, shlex.join(command))
    return Attempt(run, record, process, lock, offset, time.time())


def outcome(exit_code: int, preempted: Optional[bool], stopping: bool) -> str:
    """finished, failed or interrupted, from the exit code and summary.json's `preempted` (None: no summary)."""
    if exit_code == 0 and preempted is False:
        return "finished"
    if stopping or (exit_code == 0 and preempted):  # stopped by a signal: to be resumed
        return "interrupted"
    return "failed"


def finish(attempt: Attempt, stopping: bool) -> str:
    """Record how the attempt ended (an interrupted run stays "running"); returns its outcome."""
    run, record, code = attempt.run, attempt.record, attempt.process.returncode
    preempted = run.run_dir.read_summary().preempted if run.run_dir.summary.exists() else None
    state = outcome(code, preempted, stopping)
    if state == "finished":
        record.status, record.exit_code, record.results = "finished", 0, results_of(run.run_dir)
    elif state == "failed":
        record.status, record.exit_code, record.log_tail = "failed", code, log_tail(run.log, attempt.log_offset)
    if state != "interrupted":
        run.run_dir.write_experiment(record)
    attempt.lock.release()
    return state


class StopSignals:
    """SIGTERM/SIGINT: remember the signal, send SIGTERM to the running runs (they checkpoint and exit)."""

    def __init__(self, attempts: list[Attempt]):
        self.attempts, self.signum = attempts, None

    def __enter__(self) -> "StopSignals":
        self.previous = {s: signal.signal(s, self._stop) for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def _stop(self, signum, frame) -> None:
        if self.signum is None:
            print(f"{signal.Signals(signum).name}: stopping; running runs checkpoint and exit", file=sys.stderr)
        self.signum = signum
        for attempt in self.attempts:
            if attempt.process.poll() is None:
                attempt.process.send_signal(signal.SIGTERM)


def run_env(jobs: int) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if jobs > 1 and "OMP_NUM_THREADS" not in env:  # N runs side by side share the cores
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // jobs))
    return env


def describe_end(attempt: Attempt, state: str) -> str:
    seconds = time.time() - attempt.started
    if state == "finished":
        loss = attempt.record.results["final_val_loss"]
        return f"finished {attempt.run.experiment_id}: val loss {_number(loss)}, {seconds:.0f} s"
    if state == "failed":
        return (f"FAILED {attempt.run.experiment_id}: exit code {attempt.record.exit_code} after {seconds:.0f} s "
                f"(log: {attempt.run.log})")
    return f"interrupted {attempt.run.experiment_id} after {seconds:.0f} s: the next invocation resumes it"


def execute(runs: list[Run], jobs: int, launch) -> Optional[int]:
    """Start `runs` `jobs` at a time (launch(run) -> (command, env)); returns the stopping signal, if any."""
    queue, active, revision = deque(runs), [], git_revision()
    with StopSignals(active) as stop:
        while active or (queue and stop.signum is None):
            while queue and len(active) < jobs and stop.signum is None:
                run = queue.popleft()
                try:
                    attempt = start(run, *launch(run), revision)
                except RunDirBusy as e:
                    print(f"skipped {run.experiment_id}: {e}", flush=True)
                    continue
                active.append(attempt)
                print(f"started {run.experiment_id} (log: {run.log})", flush=True)
            time.sleep(POLL_S)
            for attempt in [a for a in active if a.process.poll() is not None]:
                active.remove(attempt)
                print(describe_end(attempt, finish(attempt, stopping=stop.signum is not None)), flush=True)
    return stop.signum


# ---------------------------------------------------------------------- output


def _number(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.4f}"


def _duration(hours: Optional[float]) -> str:
    if hours is None:
        return "-"
    seconds = hours * 3600
    return f"{seconds:.0f} s" if seconds < 3600 else f"{hours:.2f} h"


def status_table(runs: list[Run]) -> str:
    rows = [("arm", "seed", "status", "val loss", "time")]
    for run in runs:
        record, state = run.run_dir.read_experiment(), run_state(run)
        results = record.results if record is not None else {}
        if state == "failed":
            state = f"failed ({record.exit_code})"
        reference = " (ref)" if run.arm == run.spec.body.reference else ""
        rows.append((run.arm + reference, str(run.seed), state, _number(results.get("final_val_loss")),
                     _duration(results.get("training_time_hours"))))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)


def plan_text(runs: list[Run], starting: list[Run]) -> str:
    """Each run's state and what plan() decided for it."""
    started = {"pending": "start", "interrupted": "restart (resumes its checkpoint)", "failed": "retry"}
    skipped = {"finished": "skip", "running": "skip (running elsewhere)",
               "failed": "skip (failed; --retry-failed reruns it)"}
    starting_ids = {run.experiment_id for run in starting}
    lines = []
    for run in runs:
        state = run_state(run)
        action = started[state] if run.experiment_id in starting_ids else skipped[state]
        lines.append(f"{run.experiment_id}: {state} -> {action}")
    return "\n".join(lines)


def slurm_script(runs: list[Run], sweep_args: list[tuple[str, ...]], out: Path) -> str:
    """An array job, task i = run i through this module's --task mode (records, skips, locks).
    sweep_args: the task's command line in groups (an option and its value), one line each."""
    scale = runs[0].scale
    arguments = "".join(f"\n  {shlex.join(group)}" for group in sweep_args)
    return f"""#!/usr/bin/env bash
# Sweep {runs[0].spec.name}: {len(runs)} runs, task i runs run i (seed-major: {runs[0].experiment_id}, ...).
# Submit from an activated environment (sbatch passes it on): sbatch {shlex.quote(str(out / "sweep.sbatch"))}
#SBATCH --job-name=ora-{runs[0].spec.name}
#SBATCH --array=0-{len(runs) - 1}
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={scale.processes_per_node}
set -euo pipefail
out={shlex.quote(str(out))}
exec >>"$out/slurm-${{SLURM_ARRAY_JOB_ID}}_${{SLURM_ARRAY_TASK_ID}}.out" 2>&1
cd {shlex.quote(os.getcwd())}
# Literal arguments, quoted once and never expanded: shellcheck's hints about $ and commas in them do not apply.
# shellcheck disable=SC2016,SC2054
sweep_args=({arguments}
)
exec python -m pretrain.research.sweep "${{sweep_args[@]}}" --task "$SLURM_ARRAY_TASK_ID"
"""


# ---------------------------------------------------------------------- command line


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pretrain.research.sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", required=True, type=Path, help="experiment spec YAML (pretrain/experiments/)")
    parser.add_argument("--out", required=True, type=Path, help="sweep directory: OUT/<arm>/seed<seed>")
    parser.add_argument("--scale", default="cpu", help="one of the spec's scales (default: cpu)")
    parser.add_argument("--seeds", type=parse_seeds, help="comma-separated seeds (default: the spec's)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override for every run, e.g. data.manifest=... (repeatable)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (local)")
    parser.add_argument("--retry-failed", action="store_true", help="start failed runs again")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--dry-run", action="store_true", help="print what would run and exit")
    what.add_argument("--emit", choices=["commands", "slurm"],
                      help="print the runs' commands, or write OUT/sweep.sbatch (a SLURM array job)")
    what.add_argument("--task", type=int, help="run only run TASK through launch/pretrain_ora.sh (SLURM array task)")
    return parser.parse_args(argv)


def sweep_arguments(args: argparse.Namespace, spec_path: Path, out: Path) -> list[tuple[str, ...]]:
    """The command line a SLURM task repeats (same spec, out, scale, seeds, overrides, retry flag), grouped."""
    groups = [("--spec", str(spec_path)), ("--out", str(out)), ("--scale", args.scale)]
    if args.seeds:
        groups.append(("--seeds", ",".join(map(str, args.seeds))))
    groups += [("--set", item) for item in args.set]
    return groups + ([("--retry-failed",)] if args.retry_failed else [])


def emit(args: argparse.Namespace, runs: list[Run], spec_path: Path, out: Path) -> int:
    if args.emit == "commands":
        print("\n".join(shlex.join(run.local_command()) for run in runs))
        return EXIT_ALL_FINISHED
    out.mkdir(parents=True, exist_ok=True)
    script = out / "sweep.sbatch"
    script.write_text(slurm_script(runs, sweep_arguments(args, spec_path, out), out))
    script.chmod(0o755)
    print(f"wrote {script} ({len(runs)} array tasks): sbatch {shlex.quote(str(script))}")
    return EXIT_ALL_FINISHED


def run_locally(args: argparse.Namespace, runs: list[Run]) -> int:
    starting, signum = plan(runs, args.retry_failed), None
    if args.dry_run:
        print(plan_text(runs, starting))
        return EXIT_ALL_FINISHED
    record_orphans_that_completed(runs)
    if not starting:
        print(f"nothing to start: none of the {len(runs)} runs is pending or interrupted"
              f"{'' if args.retry_failed else ' (failed runs start again with --retry-failed)'}")
    else:
        print(f"starting {len(starting)} of {len(runs)} runs, {args.jobs} at a time", flush=True)
        env = run_env(args.jobs)
        signum = execute(starting, args.jobs, lambda run: (run.local_command(), env))
    print(status_table(runs))
    if signum is not None:
        return 128 + signum
    return EXIT_ALL_FINISHED if all(run_state(run) == "finished" for run in runs) else EXIT_NOT_ALL_FINISHED


def run_task(args: argparse.Namespace, runs: list[Run]) -> int:
    if not 0 <= args.task < len(runs):
        raise SweepError(f"--task {args.task}: the sweep has runs 0..{len(runs) - 1}")
    run = runs[args.task]
    record_orphans_that_completed([run])
    if not to_start([run], args.retry_failed):
        print(f"{run.experiment_id}: {run_state(run)}, nothing to do")
    else:
        command, env = run.launch_command()
        signum = execute([run], 1, lambda _: (command, {**os.environ, **env}))
        if signum is not None:
            return 128 + signum
    return EXIT_ALL_FINISHED if run_state(run) == "finished" else EXIT_NOT_ALL_FINISHED


def main(argv=None) -> int:
    args = parse_args(argv)
    spec_path, out = args.spec.resolve(), args.out.resolve()
    try:
        if args.jobs < 1:
            raise SweepError(f"--jobs must be >= 1, got {args.jobs}")
        runs = expand(load_spec(spec_path), args.scale, args.seeds, args.set, out)
        if args.emit:
            return emit(args, runs, spec_path, out)
        if args.task is not None:
            return run_task(args, runs)
        return run_locally(args, runs)
    except SweepError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_SPEC_ERROR


if __name__ == "__main__":
    sys.exit(main())
