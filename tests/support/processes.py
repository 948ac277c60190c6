"""The processes of a training job as /proc shows them: its workers, whether they live, and a kill
as the OOM killer or a machine failure would deliver it; and trainings that a SIGTERM interrupts at
a chosen step."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from pretrain_runs import records


def wait_for_step(run_dir, step: int, proc, timeout: float = 240.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if any(r.step >= step for r in records(run_dir)):
            return
        assert proc.poll() is None, "run ended before it could be interrupted"
        time.sleep(0.02)
    raise TimeoutError(f"step {step} not reached")


def workers_of(proc) -> list[int]:
    return children_of(proc.pid)


def children_of(pid: int) -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _parent(int(p.name)) == pid]


def kill_job(proc) -> None:
    """SIGKILL the launcher, as the OOM killer or a machine failure would. Its workers, which torchrun
    starts in their own sessions, must die with it (supervision.die_with_launcher) rather than
    train on beside the job that resumes the run."""
    workers = workers_of(proc)
    assert workers, "no workers to kill"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 10  # the kernel signals them as the launcher exits
    while any(_alive(pid) for pid in workers) and time.time() < deadline:
        time.sleep(0.05)
    survivors = [pid for pid in workers if _alive(pid)]
    for pid in survivors:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not survivors, "workers outlived their SIGKILLed launcher"


def _alive(pid: int) -> bool:
    """Running, not gone or a zombie waiting to be reaped."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _parent(pid: int) -> int:
    try:
        return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def trainings_preempted_at(rank: int, config_path: str, trainings: list) -> list:
    """Train each of `trainings` — (run dir, overrides, step) — in this process (a rank of
    distributed.run_on_ranks), a real SIGTERM arriving during `step`. Returns, for each, the tags
    DeepSpeed was asked to save, in order, and the summary. One process trains them all: its start
    (imports, process group) is most of a tiny training's time."""
    from deepspeed import DeepSpeedEngine

    from pretrain.config.run_config import load_run_config, validate_for_world
    from pretrain.run_files.run_dir import RunDir
    from pretrain.training.trainer import Trainer

    saved, sigterm_step = [], None  # the training's under way (the patches read them when called)
    save_checkpoint, train_step = DeepSpeedEngine.save_checkpoint, Trainer._train_step

    def counting_save(self, save_dir, tag=None, **kwargs):
        saved.append(tag)
        return save_checkpoint(self, save_dir, tag=tag, **kwargs)

    def step_then_sigterm(self, step):
        loss = train_step(self, step)
        if step + 1 == sigterm_step:
            os.kill(os.getpid(), signal.SIGTERM)
        return loss

    DeepSpeedEngine.save_checkpoint, Trainer._train_step = counting_save, step_then_sigterm
    results = []
    for run_dir, overrides, step in trainings:
        saved, sigterm_step = [], step
        cfg = load_run_config(config_path, overrides)
        summary = Trainer(cfg, RunDir(run_dir), validate_for_world(cfg, 1)).train()
        results.append((saved, summary))
    return results


def trainings_in_one_process(rank: int, config_path: str, trainings: list) -> list:
    """Train each of `trainings` — (run dir, overrides, segments) — in this process (a rank of
    distributed.run_on_ranks), `segments` times in a row in the same run dir (a segment ends where the
    config's faults stop it; the next resumes), as the entry's workers would. Returns, for each: the
    summary of every segment (or the TrainingStopped's), the 0-based data positions the training steps
    read, in order, and the train records."""
    from pretrain.config.run_config import load_run_config, validate_for_world
    from pretrain.run_files.run_dir import RunDir
    from pretrain.runtime.data import StepBatches
    from pretrain.training.trainer import Trainer, TrainingStopped

    positions, micro_batch = [], StepBatches.micro_batch

    def recording(self, split, step, micro):
        if split == "train" and micro == 0:
            positions.append(step)
        return micro_batch(self, split, step, micro)

    StepBatches.micro_batch = recording
    results = []
    for run_dir, overrides, segments in trainings:
        positions.clear()
        cfg = load_run_config(config_path, overrides)
        summaries = []
        for _ in range(segments):
            trainer = Trainer(cfg, RunDir(run_dir), validate_for_world(cfg, 1))
            trainer.resume()
            try:
                summaries.append(trainer.train())
            except TrainingStopped as e:
                summaries.append(e.summary)
        results.append((summaries, list(positions), RunDir(run_dir).read_records()))
    return results
