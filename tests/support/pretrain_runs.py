"""Run the training entry (python -m pretrain.pretrain_ora) as a user does: a subprocess, torchrun for 2."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from pretrain import pretrain_ora
from pretrain.launch import start
from pretrain.paths import ENTRY_MODULE, REPO
from pretrain.run_files.run_dir import RunDir

TINY_RUN = """
model:
  num_layers: 2
  hidden_size: 64
  num_attention_heads: 4
  seq_length: 32
  vocab_size: 256
  hidden_dropout: 0.0
  attention_dropout: 0.0
  attention: {type: ora}
train: {micro_batch_size: 4, global_batch_size: 8, steps: 6, eval_interval: 3}
eval: {iters: 2}
optimizer: {lr: 1.0e-3, warmup_steps: 2}
data: {mock: true}
deepspeed: {zero_stage: 0}
logging: {wandb_mode: disabled, progress: false, tensorboard: false}
checkpoint: {save_interval: 3}
"""

# Two-process layouts of TINY_RUN (fixtures in conftest.py train each once per session). TP2 and PP2
# leave one data-parallel rank, where ZeRO-1 would run as ZeRO-0 unless kept (config.for_world).
ONE_RANK_ZERO1 = ["deepspeed.zero_stage=1", "deepspeed.zero_with_one_rank=true"]
LAYOUTS = {
    "dp2-zero0": ["deepspeed.zero_stage=0"],
    "dp2-zero1": ["deepspeed.zero_stage=1"],
    "dp2-zero2": ["deepspeed.zero_stage=2"],
    "dp2-zero3": ["deepspeed.zero_stage=3"],
    "tp2-zero1": ["parallel.tensor=2", *ONE_RANK_ZERO1],
    "pp2-zero1": ["parallel.pipeline=2", *ONE_RANK_ZERO1],
}
# After TINY_RUN's 6 AdamW steps at lr <= 1e-3 a layout's weights differ from the one process's only by
# summation order (DP gradient reduction, TP-split matmuls, vocab-parallel cross entropy). Most differ
# by < 1e-7, but Adam's normalised update moves a weight whose gradient is near zero by up to a whole
# update whatever the gradient's size, so a few outliers set the maximum (measured over the 118,272
# weights, 3 above 1e-6 with TP: DP 1.5e-8 to 1.2e-7; PP 1.5e-7; TP 1.9e-6 to 3.8e-6 under megatron-core
# 0.16.1, 1.2e-5 under 0.19.2). A wrong shard order, a stale checkpoint or a bf16 copy differ by an
# update (~1e-3; the norm weights near 1 round to bf16 by up to 4e-3) or a weight (~2e-2).
LAYOUT_WEIGHT_ATOL = 5e-5


# TINY_RUN under the partial-frozen schedule on two processes (ZeRO-1): 60 steps (a few seconds, two
# engine rebuilds) that tests kill, hang and resume, against this training uninterrupted (the run
# cache trains it once).
PARTIAL_FROZEN = ["train.steps=60", "freeze.schedule=partial_frozen", "deepspeed.zero_stage=1"]
# Runs stopped by a signal or a fault long before their last step.
LONG = "train.steps=1000"


def write_config(directory: Path, text: str = TINY_RUN) -> Path:
    path = directory / "run.yaml"
    path.write_text(text)
    return path


def arguments(config: Path, run_dir: Path, overrides=(), nproc: int = 1) -> list[str]:
    """The entry's arguments: `pretrain_ora.main(arguments(...))` runs it in this process (see forbid_workers)."""
    args = ["--config", str(config), "--run-dir", str(run_dir), "--nproc-per-node", str(nproc)]
    for item in overrides:
        args += ["--set", item]
    return args


def command(config: Path, run_dir: Path, overrides=(), nproc: int = 1) -> list[str]:
    return [sys.executable, "-m", ENTRY_MODULE, *arguments(config, run_dir, overrides, nproc)]


def keep_environment(monkeypatch) -> None:
    """The entry, run in this process, leaves this process's environment as it is: main() would set
    the offline variables in it (environment.keep_offline, keep_wandb_offline)."""
    monkeypatch.setattr(start, "keep_offline", lambda: None)
    monkeypatch.setattr(start, "keep_wandb_offline", lambda wandb_mode: None)


def forbid_workers(monkeypatch) -> None:
    """Fail the test if the entry, run in this process, starts a worker (torchrun's or its own): for
    refusals and --check-only, which must not start one. The environment stays as it is."""
    def started(*args, **kwargs):
        raise AssertionError("a worker was started")

    from pretrain.training import worker

    keep_environment(monkeypatch)
    monkeypatch.setattr(pretrain_ora, "spawn_workers", started)
    monkeypatch.setattr(pretrain_ora, "launched_worker", started)
    monkeypatch.setattr(worker, "train_worker", started)


def env() -> dict:
    """A training's environment: one thread per process, output unbuffered (and, as everywhere in the
    suite, the virtualenv's tools first on PATH: conftest.py)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def run(config: Path, run_dir: Path, overrides=(), nproc: int = 1, check: bool = True,
        timeout: int = 300) -> subprocess.CompletedProcess:
    out = subprocess.run(command(config, run_dir, overrides, nproc), cwd=REPO, env=env(),
                         capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise AssertionError(f"run failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return out


def records(run_dir: Path, split: str = "train") -> list:
    return RunDir(run_dir).read_records(split)


def losses_by_step(run_dir: Path) -> dict[int, float]:
    return {r.step: r.loss for r in records(run_dir)}


def summary(run_dir: Path):
    return RunDir(run_dir).read_summary()


class RunCache:
    """Each distinct training — (config text, overrides, process count) — runs once per test session.

    `trained(...)` returns the finished run dir, which tests only read; a test that changes a run,
    resumes it or trains it further takes `copy(...)`, its own copy. Tests that ask for the same
    training share one run, wherever they are in the suite: with pytest-xdist, `root` is a folder every
    worker sees, and the first worker to ask trains the run under a lock while the others wait for it
    (a training takes both cores: with a cache per worker, 8 of the suite's 26 trainings ran twice)."""

    def __init__(self, root: Path):
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)

    def trained(self, overrides=(), nproc: int = 1, config: str = TINY_RUN) -> Path:
        name = hashlib.sha256(repr((config, tuple(overrides), nproc)).encode()).hexdigest()[:12]
        folder, finished = self.root / name, self.root / f"{name}.finished"
        with open(self.root / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not finished.exists():
                shutil.rmtree(folder, ignore_errors=True)  # what a worker's failed training left
                folder.mkdir()
                run(write_config(folder, config), folder / "run", overrides, nproc)
                finished.touch()
        return folder / "run"

    def copy(self, dest: Path, overrides=(), nproc: int = 1, config: str = TINY_RUN) -> Path:
        """A copy of the trained run at `dest`, and its config beside it (`dest.parent / "run.yaml"`)."""
        shutil.copytree(self.trained(overrides, nproc, config), dest)
        write_config(dest.parent, config)
        return dest

