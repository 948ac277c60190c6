"""Pretrain a GPT with any attention variant on DeepSpeed + megatron-core.

    python -m pretrain.pretrain_ora --config pretrain/configs/tiny.yaml [--set k=v ...] [--run-dir DIR]
    python -m pretrain.pretrain_ora --config ... --nproc-per-node 2      # spawns torchrun itself
    torchrun --nproc-per-node 2 -m pretrain.pretrain_ora --config ...
    deepspeed --num_gpus 8 --module pretrain.pretrain_ora --config ...   # see launch/

The config is validated (with the process count) before any worker starts. An existing run dir
with a checkpoint is resumed; so the same command continues an interrupted run. Before resuming,
the launching process checks (pretrain/checkpoint/resume_check.py) that the checkpoint's files
match their integrity record — falling back to the newest intact one — and that the config
changes nothing the checkpoint cannot take. `python pretrain/pretrain_ora.py ...` (a file path, as
DeepSpeed's examples run scripts) works too.

With several processes, or train.max_restarts > 0, this process spawns the workers through
torchrun and supervises them (pretrain/supervision.py): a failed or hung rank restarts all of them
from the latest intact checkpoint. Exit statuses: EXIT_* below.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: its folder, first on sys.path, would shadow top-level modules
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import ctypes
import datetime
import os
import platform
import signal
from dataclasses import dataclass
from typing import Optional

import yaml

from ora_megatron.config_io import ConfigError, to_dict
from pretrain.checkpoint.init_from import ImportRefused, apply_record, forget_import, plan_import, write_import
from pretrain.checkpoint.resume_check import ResumeRefused, check_resume
from pretrain.config import RunConfig, for_world, load_run_config, validate_for_world
from pretrain.environment import device_environment, git_revision, keep_offline, megatron_core_version
from pretrain.paths import REPO
from pretrain.run_dir import RunDir, RunDirBusy, RunDirLock, config_hash, step_of_tag
from pretrain.supervision import Attempt, RestartPolicy, StopJob, Supervisor, become_subreaper

ENTRY_MODULE = "pretrain.pretrain_ora"  # python -m
# Exit statuses of the entry (and of every worker). A supervised job never retries those in FINAL.
EXIT_CONFIG_ERROR = 2  # refused before training: the message names the key, file or flag
EXIT_TRAINING_STOPPED = 3  # the run stopped itself: skipped steps or rewinds used up, a checkpoint save failed
EXIT_HUNG = 4  # a rank's hang watchdog fired (train.hang_timeout_s): its stacks are in the run dir's hangs/
EXIT_WALL_TIME = 75  # stopped with a checkpoint at train.max_wall_time: the same command resumes (a requeue)
FINAL = {EXIT_CONFIG_ERROR: "refused", EXIT_TRAINING_STOPPED: "the run stopped itself",
         EXIT_WALL_TIME: "stopped at train.max_wall_time"}
STATUS_NAMES = {**FINAL, EXIT_HUNG: "hung", 1: "error"}
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

# DeepSpeed's OpenMPI and SLURM backends start every rank themselves (mpirun, srun) and leave the
# torch variables to deepspeed.init_distributed's MPI discovery, which this entry point does not use;
# launch/pretrain_ora.sh names the scheduler in ORA_RANKS_FROM (with MASTER_ADDR and MASTER_PORT).
SCHEDULER_RANK_VARIABLES = {
    "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    "slurm": ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
}


def process_count(text: str) -> int:
    """argparse type of --nproc-per-node and --world-size: a whole number >= 1."""
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of processes, got {text!r}") from None
    if count < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {count}")
    return count


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="run config YAML (see pretrain/configs/)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="dotted override, e.g. train.steps=200 (repeatable)")
    parser.add_argument("--run-dir", help="default: runs/<config name>-<hash of the resolved config>")
    parser.add_argument("--nproc-per-node", type=process_count, default=1,
                        help="spawn this many local workers with torchrun (ignored under a launcher)")
    parser.add_argument("--check-only", action="store_true",
                        help="validate the config for --world-size processes and exit (launch/pretrain_ora.sh)")
    parser.add_argument("--world-size", type=process_count,
                        help="process count to validate against (with --check-only)")
    parser.add_argument("--print-run-dir", action="store_true",
                        help="with --check-only: print only the run dir on stdout, the report on stderr")
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # deepspeed launcher
    parser.add_argument("--resume-checked", action="store_true", help=argparse.SUPPRESS)  # set by _launch_local
    return parser.parse_args(argv)


def default_run_dir(config_path: str, cfg: RunConfig) -> Path:
    return REPO / "runs" / f"{Path(config_path).stem}-{config_hash(cfg)[:8]}"


def torchrun_attempt(argv: list[str], lock: RunDirLock) -> Attempt:
    """One launch of the workers through torchrun's elastic agent, in this process: it starts them,
    watches them and stops all of them when one fails (restarts are the supervisor's: max 0 here)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    # A stop signal reaches the workers through the agent, which SIGKILLs them after this many
    # seconds: time enough to save a checkpoint.
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "120")
    try:
        # The workers hold the lock too (as stdin), so it outlives a launcher killed with SIGKILL
        # until they have died of it (die_with_launcher).
        with lock.as_stdin():
            torchrun(argv)
    except SignalException as e:  # the agent stopped the workers on a stop signal
        return Attempt(128 + int(e.sigval), stop_requested=True)
    except ChildFailedError as e:  # workers failed; the agent stopped the others
        return Attempt(1, ranks={rank: failure.exitcode for rank, failure in e.failures.items()})
    except SystemExit as e:
        return Attempt(int(e.code or 0))
    except Exception as e:
        print(f"error: {e}", file=sys.stderr)
        return Attempt(1)
    return Attempt(0)


def run_ended(run_dir: RunDir) -> bool:
    """Whether the run's workers ended it deliberately: its summary is that of its latest checkpoint
    (finished, stopped early or on request, at train.max_wall_time, or nothing left to train)."""
    tag = run_dir.latest_checkpoint()
    if tag is None or not run_dir.summary.exists():
        return False
    try:
        return run_dir.read_summary().steps == step_of_tag(tag)
    except (OSError, ValueError, TypeError):
        return False


def _launch_local(args, start: Start) -> int:
    """Run this script under torchrun with `world_size` local workers, handing them the run dir's lock,
    supervised: a failed attempt is restarted as train.max_restarts allows (pretrain/supervision.py)."""
    argv = [f"--nproc-per-node={start.world_size}", "--standalone", "--max-restarts=0", "--module", ENTRY_MODULE,
            "--config", args.config, "--run-dir", str(start.run_dir), "--resume-checked"]
    for item in args.set:
        argv += ["--set", item]
    train = start.cfg.train
    run_dir = RunDir(start.run_dir)
    become_subreaper()
    supervisor = Supervisor(
        run_dir, RestartPolicy(train.max_restarts, train.restart_backoff_s, FINAL),
        launch=lambda attempt: torchrun_attempt(argv, start.lock), ended=lambda: run_ended(run_dir),
        prepare_restart=lambda: restart_from(run_dir, start), status_names=STATUS_NAMES)
    return supervisor.run()


def restart_from(run_dir: RunDir, start: Start) -> Optional[str]:
    """Before a restart: the checkpoint to resume from, checked as at the job's start (prepare)."""
    try:
        plan = check_resume(run_dir, start.cfg, start.world_size)
    except ResumeRefused as e:
        raise StopJob(EXIT_CONFIG_ERROR, f"cannot restart: {e}") from e
    if nothing_to_train(run_dir, plan.tag, start.cfg) is not None:
        raise StopJob(0, "the run has ended")
    for line in plan.notices():
        print(line, file=sys.stderr)
    plan.apply(run_dir)
    return plan.tag


def versions() -> dict:
    import deepspeed
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "megatron_core": megatron_core_version(), "git_revision": git_revision(),
            "cuda": torch.version.cuda, "hostname": platform.node()}


def nothing_to_train(run_dir: RunDir, tag: Optional[str], cfg: RunConfig) -> Optional[str]:
    """The message for a run that resuming from checkpoint `tag` would not train (it has a summary
    and `tag` is its last step: the command of a finished run, again), else None. Such a run's
    files stay as they are: no run files, resume log line or summary is written. A run that early
    stopping ended is finished too, unless its early-stopping settings changed since."""
    if tag is None or not run_dir.summary.exists():
        return None
    step = step_of_tag(tag)
    if step >= cfg.train.steps:
        return f"run dir {run_dir.path}: finished at step {step}, nothing to train"
    summary = run_dir.read_summary()
    if (summary.stopped_early and summary.steps == step
            and run_dir.read_config().train.early_stopping == cfg.train.early_stopping):
        return (f"run dir {run_dir.path}: stopped early at step {step} (train.early_stopping), nothing to train; "
                "change train.early_stopping to train on")
    return None


def unwritable(run_dir: Path) -> Optional[str]:
    """Why this process cannot write the run dir, or None. The dir itself and every entry at its
    top level (each written or appended to by a run) must be writable, or, before it exists, the
    nearest folder it would be created in. os.access answers for this process's user: root passes
    permission bits, and nobody passes a read-only mount."""
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing == run_dir and not run_dir.is_dir():
        return f"run dir {run_dir} exists and is not a folder"
    written = [run_dir, *run_dir.iterdir()] if existing == run_dir else [existing]
    for path in written:
        if not os.access(path, os.W_OK | (os.X_OK if path.is_dir() else 0)):
            return (f"run dir {run_dir} cannot be written: {path} is read-only (its permissions, or a read-only "
                    "file system); the run writes its config, metrics and checkpoints there. Fix that, or use "
                    "another --run-dir")
    return None


def worker(cfg: RunConfig, run_dir: RunDir, grad_accum: int) -> int:
    import torch
    import torch.distributed as dist

    from ora_megatron.parallel import destroy_distributed, init_distributed
    from pretrain.checkpoint.checkpointer import CheckpointSaveFailed
    from pretrain.runtime.ds_config import deepspeed_config
    from pretrain.training.trainer import Trainer, TrainingStopped
    from pretrain.training.watchdog import Watchdog

    # Before the first CUDA call, for workers a launcher other than ours started (it set them already).
    for name, value in device_environment(cfg).items():
        os.environ.setdefault(name, value)
    if torch.cuda.is_available():
        torch.set_float32_matmul_precision("high" if cfg.train.tf32 else "highest")
    # DeepSpeed runs the pipeline; megatron-core only needs its tensor-parallel groups.
    init_distributed(cfg.parallel.tensor, 1, timeout=datetime.timedelta(seconds=cfg.train.collective_timeout_s))
    rank = dist.get_rank()
    cfg = apply_record(cfg, run_dir)  # an import's settings, recorded by the launching process before rendezvous
    # Under an external launcher main() cannot stop early for a finished run: its other ranks are
    # waiting here. Every rank reads the same `latest` (rank 0 settled it before rendezvous).
    finished = nothing_to_train(run_dir, run_dir.latest_checkpoint(), cfg)
    if finished is not None:
        if rank == 0:
            print(finished, file=sys.stderr)
        destroy_distributed()
        return 0
    if rank == 0:
        run_dir.write_run_files(to_dict(cfg), deepspeed_config(cfg, grad_accum), versions())
    dist.barrier()
    hang_timeout = cfg.train.hang_timeout_s
    watchdog = Watchdog(run_dir, rank, hang_timeout, EXIT_HUNG) if hang_timeout > 0 else None
    trainer = Trainer(cfg, run_dir, grad_accum, watchdog)
    if trainer.resume():
        started = f" (resumed at step {trainer.state.step})"
    elif trainer.import_weights():
        started = f" (weights from {run_dir.read_init_from()['source']})"
    else:
        started = ""
    if rank == 0:
        print(f"run dir: {run_dir.path}{started}", file=sys.stderr)
    code = 0
    try:
        summary = trainer.train()
        if rank == 0:
            run_dir.write_summary(summary)
            saved = run_dir.checkpoint(run_dir.latest_checkpoint())
            if summary.preempted:
                print(f"interrupted at step {summary.steps}: checkpoint {saved} saved; the same command resumes "
                      "from it", file=sys.stderr)
            elif summary.stop_reason == "max_wall_time":
                print(f"stopped at step {summary.steps} before train.max_wall_time ({cfg.train.max_wall_time:g} s) "
                      f"ran out: checkpoint {saved} saved; the same command resumes from it", file=sys.stderr)
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
    destroy_distributed()
    return code


def adopt_scheduler_ranks(environ=os.environ) -> None:
    """RANK, WORLD_SIZE, LOCAL_RANK from the scheduler named by ORA_RANKS_FROM, unless already set."""
    scheduler = environ.get("ORA_RANKS_FROM")
    if scheduler is None or "WORLD_SIZE" in environ:
        return
    if scheduler not in SCHEDULER_RANK_VARIABLES:
        raise ConfigError("ORA_RANKS_FROM", f"expected one of {list(SCHEDULER_RANK_VARIABLES)}, got {scheduler!r}")
    names = SCHEDULER_RANK_VARIABLES[scheduler]
    missing = [name for name in names if name not in environ]
    if missing:
        raise ConfigError("ORA_RANKS_FROM", f"{scheduler} ranks need {', '.join(missing)} in the environment")
    rank, size, local_rank = (environ[name] for name in names)
    environ.update(RANK=rank, WORLD_SIZE=size, LOCAL_RANK=local_rank)


def die_with_launcher() -> None:
    """Have the kernel SIGKILL this worker when its launcher dies.

    torchrun starts workers in their own sessions, so a launcher killed hard (the OOM killer, a
    `kill -9`) would leave them training beside whatever job replaces it, both writing the run dir.
    PR_SET_PDEATHSIG fires when the thread that started us exits: torch elastic's agent and
    DeepSpeed's launch.py start workers from their main thread, which lives until the workers end.
    A launcher that stops its workers itself (SIGTERM, a failed rank) still does so first.
    """
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the launcher died before the setting took
        os.kill(os.getpid(), signal.SIGKILL)


class StartRefused(ValueError):
    """The run cannot start as asked; the message names the key, flag, file or holder (exit 2)."""


@dataclass
class Start:
    """A start that passed every check made before workers exist."""

    cfg: RunConfig
    world_size: int
    grad_accum: int
    run_dir: Path
    resume_from: Optional[str] = None  # the checkpoint tag the run resumes from
    finished: Optional[str] = None  # why there is nothing to train, for a finished run's command
    lock: Optional[RunDirLock] = None  # the run dir's lock, held by this process


def prepare(args: argparse.Namespace, under_launcher: bool) -> Start:
    """Config, data, run dir, lock and resume, checked once per start: here, or under a launcher
    in rank 0 (before rendezvous, so the other ranks read `latest` after it); workers spawned by
    _launch_local were checked by their parent. Raises StartRefused."""
    try:
        cfg = load_run_config(args.config, args.set)
        if under_launcher:
            world_size = int(os.environ["WORLD_SIZE"])
        else:
            world_size = args.nproc_per_node if args.world_size is None else args.world_size
        grad_accum = validate_for_world(cfg, world_size)
        configured, cfg = cfg, for_world(cfg, world_size)
    except (ConfigError, OSError, yaml.YAMLError) as e:
        raise StartRefused(str(e)) from e
    if cfg is not configured and not args.resume_checked and os.environ.get("RANK", "0") == "0":
        print(f"deepspeed.zero_stage={configured.deepspeed.zero_stage} with one data-parallel rank: training at "
              "ZeRO-0, the same step with nothing to partition (deepspeed.zero_with_one_rank=true keeps the stage)",
              file=sys.stderr)
    keep_offline(cfg.logging.wandb_mode)  # before anything imports wandb or a Hugging Face library
    if under_launcher:
        die_with_launcher()
    if not cfg.data.mock:  # (megatron-core's datasets take seconds to import: only for data to check)
        from pretrain.runtime.data import check_data

        try:
            check_data(cfg)
        except (ConfigError, OSError) as e:
            raise StartRefused(str(e)) from e
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(args.config, cfg)
    start = Start(cfg, world_size, grad_accum, run_dir)
    problem = unwritable(start.run_dir)
    if problem is not None:
        raise StartRefused(problem)
    if args.resume_checked or (under_launcher and os.environ.get("RANK", "0") != "0"):
        return start
    run_dir = RunDir(start.run_dir)
    # A fresh start's import is checked (read only) before the run dir is locked or created.
    planned = None
    if cfg.train.init_from is not None and run_dir.latest_checkpoint() is None:
        try:
            planned = plan_import(cfg)
        except ImportRefused as e:
            raise StartRefused(str(e)) from e
    # One job per run dir, locked before anything reads or changes it; the lock is held until this
    # process (and the workers it hands it to) end. --check-only tests it, keeping nothing.
    try:
        if args.check_only:
            run_dir.check_lock()
        else:
            start.lock = run_dir.acquire_lock()
    except (RunDirBusy, OSError) as e:  # OSError: the run dir cannot be created
        raise StartRefused(str(e)) from e
    # A run that started from imported weights trains the settings its import took over (init_from.json).
    resumed_cfg = apply_record(cfg, run_dir)
    try:
        plan = check_resume(run_dir, resumed_cfg, world_size)
        topology_change = None
        if plan.tag is not None:  # (reshard imports DeepSpeed: only for a checkpoint to resume)
            from pretrain.checkpoint.reshard import plan_topology_change

            topology_change = plan_topology_change(run_dir, plan.tag, resumed_cfg, world_size)
    except ResumeRefused as e:
        raise StartRefused(str(e)) from e
    for line in plan.notices():
        print(line, file=sys.stderr)
    if plan.tag is not None:
        start.cfg = resumed_cfg
        if cfg.train.init_from is not None:
            print(f"train.init_from is read at a run's first start only: resuming from {plan.tag}, nothing is "
                  "imported", file=sys.stderr)
    start.resume_from, start.finished = plan.tag, nothing_to_train(run_dir, plan.tag, start.cfg)
    if plan.tag is None:
        _prepare_import(start, run_dir, args.check_only, planned)
    if not args.check_only and start.finished is None:
        plan.apply(run_dir)
        if topology_change is not None:  # converted once, here, before any worker starts
            print(topology_change.convert(), file=sys.stderr)
    return start


def _prepare_import(start: Start, run_dir: RunDir, check_only: bool, plan=None) -> None:
    """A fresh start: check and convert train.init_from (unless `plan` did), write it for the workers to
    load, and take its numerics over into start.cfg; without it, forget an import an earlier start left."""
    if start.cfg.train.init_from is None:
        if not check_only:
            forget_import(run_dir)
        return
    try:
        plan = plan or plan_import(start.cfg)
    except ImportRefused as e:
        raise StartRefused(str(e)) from e
    print(plan.notice(), file=sys.stderr)
    start.cfg = plan.cfg
    if not check_only:
        write_import(run_dir, plan)


def check_report(start: Start) -> str:
    resumes = f", resumes from {start.resume_from}" if start.resume_from else ""
    return (f"config ok for {start.world_size} processes: gradient accumulation {start.grad_accum}, "
            f"run dir {start.run_dir}{resumes}")


def check_launch(argv: list[str], world_size: int) -> Start:
    """What `--check-only --world-size N` checks, for a launcher about to start N processes
    (pretrain/launch/launcher.py): the report on stderr; returns the checked start; StartRefused."""
    start = prepare(parse_args([*argv, "--check-only", "--world-size", str(world_size)]), under_launcher=False)
    print(check_report(start), file=sys.stderr)
    return start


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        adopt_scheduler_ranks()
        under_launcher = "WORLD_SIZE" in os.environ
        start = prepare(args, under_launcher)
    except (ConfigError, StartRefused) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    if args.check_only:
        print(check_report(start), file=sys.stderr if args.print_run_dir else sys.stdout)
        if args.print_run_dir:
            print(start.run_dir)
        return 0
    if start.finished is not None and not under_launcher:  # no worker needs starting
        print(start.finished, file=sys.stderr)
        return 0
    # Several processes, or restarts (a process cannot restart itself): torchrun's workers, supervised.
    if not under_launcher and (start.world_size > 1 or start.cfg.train.max_restarts > 0):
        os.environ.update(device_environment(start.cfg))  # torchrun's workers inherit it
        return _launch_local(args, start)
    return worker(start.cfg, RunDir(start.run_dir), start.grad_accum)


if __name__ == "__main__":
    sys.exit(main())
