"""One rank of a training job: meet the other ranks, read the run's resolved config, train, report.

    python -m pretrain.training.worker --run-dir DIR    (how the training entry's torchrun spawn starts each rank)

A worker reads the config as its start resolved it (pretrain/launch/start.py: the run dir's config.yaml) and
nothing else of the config. Under a launcher other than the entry's own spawn (DeepSpeed's, torchrun,
srun, mpirun) every rank runs the training entry, which hands it to `launched_worker` (pretrain/launch/
start.py): rank 0 resolves the start before the ranks meet, so that the others read config.yaml only after
it was written. A worker imports nothing of the supervisor (pretrain/launch/supervisor.py): what it knows
of its job is pretrain/job/supervision.py's. Exit statuses: pretrain/job/exit_status.py.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
from typing import Optional

import torch
import torch.distributed as dist

from ora_megatron.parallel import destroy_distributed, init_distributed
from pretrain.checkpoint.checkpointer import CheckpointSaveFailed
from pretrain.config.run_config import RunConfig, read_run_config, validate_for_world
from pretrain.job.environment import device_environment, git_revision, megatron_core_version
from pretrain.job.exit_status import EXIT_HUNG, EXIT_TRAINING_STOPPED, EXIT_WALL_TIME
from pretrain.job.supervision import die_with_launcher
from pretrain.run_files.run_dir import RunDir
from pretrain.run_files.run_records import Summary
from pretrain.runtime.ds_config import deepspeed_config
from pretrain.training.trainer import Trainer, TrainingStopped
from pretrain.training.watchdog import Watchdog


def versions() -> dict:
    import deepspeed

    return {"python": platform.python_version(), "torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "megatron_core": megatron_core_version(), "git_revision": git_revision(),
            "cuda": torch.version.cuda, "hostname": platform.node()}


def train_worker(run_dir: RunDir, known: RunConfig, finished: Optional[str] = None) -> int:
    """Train this rank of the run. `known`: the config this rank has before the ranks meet (only its
    device settings, tensor-parallel size and collective timeout are read); `finished`: rank 0's reason
    why the run has nothing to train, if it has none."""
    # Before the first CUDA call, for workers a launcher other than the entry's started (it set them already).
    for name, value in device_environment(known.parallel).items():
        os.environ.setdefault(name, value)
    # DeepSpeed runs the pipeline; megatron-core only needs its tensor-parallel groups.
    timeout = datetime.timedelta(seconds=known.supervision.collective_timeout_s)
    init_distributed(known.parallel.tensor, 1, timeout=timeout)
    finished = _from_rank0(finished)
    if finished is not None:
        if dist.get_rank() == 0:
            print(finished, file=sys.stderr)
        destroy_distributed()
        return 0
    cfg = read_run_config(run_dir)
    if torch.cuda.is_available():
        torch.set_float32_matmul_precision("high" if cfg.speed.tf32 else "highest")
    grad_accum = validate_for_world(cfg, dist.get_world_size())
    if dist.get_rank() == 0:
        run_dir.write_run_files(deepspeed_config(cfg, grad_accum), versions())
    dist.barrier()
    code = _train(cfg, run_dir, grad_accum)
    destroy_distributed()
    return code


def _from_rank0(value: Optional[str]) -> Optional[str]:
    """Rank 0's value on every rank (under an external launcher only rank 0 resolved the start)."""
    if dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _train(cfg: RunConfig, run_dir: RunDir, grad_accum: int) -> int:
    rank, hang_timeout = dist.get_rank(), cfg.supervision.hang_timeout_s
    watchdog = Watchdog(run_dir, rank, hang_timeout, EXIT_HUNG) if hang_timeout > 0 else None
    trainer = Trainer(cfg, run_dir, grad_accum, watchdog)
    started = _start_of(trainer, run_dir)
    if rank == 0:
        print(f"run dir: {run_dir.path}{started}", file=sys.stderr)
    code = 0
    try:
        summary = trainer.train()
        if rank == 0:
            run_dir.write_summary(summary)
            _report_stop(summary, run_dir, cfg.supervision.max_wall_time)
        if summary.stop_reason == "max_wall_time":
            code = EXIT_WALL_TIME
    except TrainingStopped as e:
        if rank == 0:
            if e.summary is not None:
                run_dir.write_summary(e.summary)
            print(f"error: {e}", file=sys.stderr)
        code = EXIT_TRAINING_STOPPED
    except CheckpointSaveFailed as e:  # raised on the ranks whose files could not be written
        print(f"error: {e}", file=sys.stderr)
        code = EXIT_TRAINING_STOPPED
    finally:
        if watchdog is not None:
            watchdog.stop()
    if rank == 0:
        print(f"run dir: {run_dir.path}\nmetrics: {run_dir.metrics}\n"
              f"checkpoints: {run_dir.checkpoints}\nsummary: {run_dir.summary}", file=sys.stderr)
    return code


def _start_of(trainer: Trainer, run_dir: RunDir) -> str:
    """Resume the latest checkpoint, or load the run's imported weights; what the start line says of it."""
    if trainer.resume():
        return f" (resumed at step {trainer.state.step})"
    if trainer.import_weights():
        return f" (weights from {run_dir.read_init_from()['source']})"
    return ""


def _report_stop(summary: Summary, run_dir: RunDir, max_wall_time: float) -> None:
    """Rank 0: how to go on from a run that stopped before its last step with a checkpoint."""
    saved = run_dir.checkpoint(run_dir.latest_checkpoint())
    if summary.preempted:
        print(f"interrupted at step {summary.steps}: checkpoint {saved} saved; the same command resumes "
              "from it", file=sys.stderr)
    elif summary.stop_reason == "max_wall_time":
        print(f"stopped at step {summary.steps} before supervision.max_wall_time ({max_wall_time:g} s) "
              f"ran out: checkpoint {saved} saved; the same command resumes from it", file=sys.stderr)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", required=True, help="the run dir whose config.yaml the start resolved")
    args = parser.parse_args(argv)
    die_with_launcher()
    run_dir = RunDir(args.run_dir)
    with run_dir.handed_down_lock():  # the launcher's, held as long as this rank lives
        return train_worker(run_dir, read_run_config(run_dir))


if __name__ == "__main__":
    sys.exit(main())
