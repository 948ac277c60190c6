"""A run's state, read back from its run dir; what an invocation plans to do with each run (the dry
run's plan too); the experiment records a sweep writes; the tables it prints."""

from __future__ import annotations

import datetime
import json
import math
import shlex
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ora_megatron.config_io import ConfigError, to_dict
from pretrain.research.sweep.spec import Run, SweepError
from pretrain.run_files.run_dir import RunDir, config_hash
from pretrain.run_files.run_records import ExperimentRecord

LOG_TAIL_LINES = 40


# ---------------------------------------------------------------------- run state


def run_state(run: Run) -> str:
    """running, finished, failed, interrupted or pending (see the package docstring)."""
    if run.run_dir.lock_holder() is not None:
        return "running"
    return recorded_state(run)


def recorded_state(run: Run) -> str:
    """finished, failed, interrupted or pending, from the run dir's files alone (the lock not asked:
    what the holder of the lock reads)."""
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


def evaluation_state(run: Run, name: str) -> str:
    """finished (its evaluations/<name>.json exists), failed (recorded so, no file) or pending."""
    if run.run_dir.evaluation_file(name).exists():
        return "finished"
    record = run.run_dir.read_experiment()
    entry = record.evaluations.get(name) if record is not None else None
    return "failed" if entry is not None and entry["status"] == "failed" else "pending"


@dataclass
class Task:
    """What an invocation does in one run dir, in order: train it (unless it is finished), then run
    the spec's evaluations that are not finished, each in turn."""

    run: Run
    train: bool
    evaluations: list[str]

    def after(self, state: str) -> Optional["Task"]:
        """What is left once the first step ended in `state`: the evaluations follow a finished
        training; a failed evaluation does not stop the next one."""
        rest = self.evaluations if self.train else self.evaluations[1:]
        if not rest or (self.train and state != "finished"):
            return None
        return Task(self.run, False, rest)


def done_since_planned(task: Task) -> Optional[str]:
    """Why the task's first step is no longer to do, read by the holder of the run's lock, or None:
    another invocation on the same sweep dir may have done it between this one's plan and its turn."""
    done = (recorded_state(task.run) if task.train else evaluation_state(task.run, task.evaluations[0])) == "finished"
    return "finished by another job since this sweep planned it" if done else None


def tasks_of(runs: list[Run], retry_failed: bool) -> list[Task]:
    """The runs to start, each with the evaluations to run after it, and the finished runs' evaluations
    that are pending (or failed, with retry_failed), in the runs' order."""
    starting = {run.experiment_id for run in to_start(runs, retry_failed)}
    runnable = {"pending"} | ({"failed"} if retry_failed else set())
    tasks = []
    for run in runs:
        states = {name: evaluation_state(run, name) for name in run.spec.body.evaluations}
        if run.experiment_id in starting:  # a fresh training: every evaluation without a file follows it
            tasks.append(Task(run, True, [name for name, state in states.items() if state != "finished"]))
        elif run_state(run) == "finished" and any(state in runnable for state in states.values()):
            tasks.append(Task(run, False, [name for name, state in states.items() if state in runnable]))
    return tasks


def plan(runs: list[Run], retry_failed: bool) -> list[Task]:
    """What an invocation decides before it starts anything, for the real run and the dry run
    alike: warn about finished runs whose config changed, choose the runs to start and the
    evaluations to run, and check the data of the runs to start (SweepError). Returns the tasks."""
    warn_changed_configs(runs)
    tasks = tasks_of(runs, retry_failed)
    starting = [task.run for task in tasks if task.train]
    if starting:
        check_run_data(starting)
    return tasks


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


def completed_summary(run_dir: RunDir) -> bool:
    """summary.json of a run that trained to its end or stopped early (not one stopped by a signal, at
    supervision.max_wall_time or by a divergence)."""
    if not run_dir.summary.exists():
        return False
    summary = run_dir.read_summary()
    return not summary.preempted and summary.stop_reason is None


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


# ---------------------------------------------------------------------- output


def loss_text(value: Optional[float]) -> str:
    """A loss as the sweep prints it: four decimals, "-" when there is none."""
    return "-" if value is None else f"{value:.4f}"


def _duration(hours: Optional[float]) -> str:
    if hours is None:
        return "-"
    seconds = hours * 3600
    return f"{seconds:.0f} s" if seconds < 3600 else f"{hours:.2f} h"


def evaluations_text(run: Run) -> str:
    """Each of the spec's evaluations and its state, "failed (exit code)" when it failed."""
    record, cells = run.run_dir.read_experiment(), []
    for name in run.spec.body.evaluations:
        state = evaluation_state(run, name)
        if state == "failed":
            state = f"failed ({record.evaluations[name]['exit_code']})"
        cells.append(f"{name} {state}")
    return ", ".join(cells)


def status_table(runs: list[Run]) -> str:
    evaluations = bool(runs) and bool(runs[0].spec.body.evaluations)
    rows = [("arm", "seed", "status", "val loss", "time") + (("evaluations",) if evaluations else ())]
    for run in runs:
        record, state = run.run_dir.read_experiment(), run_state(run)
        results = record.results if record is not None else {}
        if state == "failed":
            state = f"failed ({record.exit_code})"
        reference = " (ref)" if run.arm == run.spec.body.reference else ""
        rows.append((run.arm + reference, str(run.seed), state, loss_text(results.get("final_val_loss")),
                     _duration(results.get("training_time_hours")))
                    + ((evaluations_text(run),) if evaluations else ()))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)


def restart_text(run: Run) -> str:
    """A run killed before its first save starts again from step 0; the plan says which it is."""
    if run.run_dir.latest_checkpoint() is None:
        return "restart (from step 0: it saved no checkpoint)"
    return "restart (resumes its checkpoint)"


def plan_text(runs: list[Run], tasks: list[Task]) -> str:
    """Each run's state and what plan() decided for it, then each of its evaluations' with the command."""
    started = {"pending": "start", "failed": "retry"}
    skipped = {"finished": "skip", "running": "skip (running elsewhere)",
               "failed": "skip (failed; --retry-failed reruns it)"}
    planned = {task.run.experiment_id: task for task in tasks}
    lines = []
    for run in runs:
        state, task = run_state(run), planned.get(run.experiment_id)
        if not (task and task.train):
            action = skipped[state]
        else:
            action = restart_text(run) if state == "interrupted" else started[state]
        lines.append(f"{run.experiment_id}: {state} -> {action}")
        for name in run.spec.body.evaluations:
            evaluation = evaluation_state(run, name)
            if task is not None and name in task.evaluations:
                action = f"{'after the training, ' if task.train else ''}run {shlex.join(run.evaluation_command(name))}"
            elif evaluation == "pending":
                action = "wait for the training"
            else:
                action = skipped[evaluation]
            lines.append(f"{run.experiment_id} evaluation {name}: {evaluation} -> {action}")
    return "\n".join(lines)
