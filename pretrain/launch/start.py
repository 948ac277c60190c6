"""A run's start, settled once before any worker trains: the command line read, the config resolved,
the data and the run dir checked, the run dir locked, the resume or the weight import decided.

`resolve` does it in the process that starts the job (the training entry, or rank 0 under a launcher
other than the entry's own spawn, before rendezvous, so that the other ranks meet it only after), and
writes the config as the run trains it to the run dir's config.yaml: the YAML with its overrides, for
the process count (`for_world`), with the settings a weight import took over (at the run's first start,
or from its record on a resume). The workers read that file (pretrain/training/worker.py) and nothing
else of the config. A start that cannot work is refused (StartRefused, exit status 2) with a message
naming the key, flag, file or holder: a config error, data that does not match, a run dir that cannot
be written or that another job holds, a resume the checkpoint cannot take (pretrain/checkpoint/
resume_check.py), an import that does not fit (pretrain/checkpoint/import_plan.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import yaml

from ora_megatron.config_io import ConfigError, to_dict
from pretrain.checkpoint.resume_check import ResumePlan, ResumeRefused, check_resume, nothing_to_train, recorded_model
from pretrain.config.init_from import ImportRefused
from pretrain.config.run_config import RunConfig, for_world, load_run_config, validate_for_world
from pretrain.job.environment import keep_offline, keep_wandb_offline
from pretrain.job.exit_status import EXIT_CONFIG_ERROR
from pretrain.job.supervision import die_with_launcher
from pretrain.launch.supervisor import StopJob
from pretrain.paths import REPO
from pretrain.run_files.lock import RunDirBusy, RunDirLock
from pretrain.run_files.run_dir import RunDir, config_hash

if TYPE_CHECKING:
    from pretrain.checkpoint.import_plan import ImportPlan
    from pretrain.checkpoint.reshard import TopologyChange


class StartRefused(ValueError):
    """The run cannot start as asked; the message names the key, flag, file or holder (exit 2)."""


def process_count(text: str) -> int:
    """argparse type of --nproc-per-node and --world-size: a whole number >= 1."""
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of processes, got {text!r}") from None
    if count < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {count}")
    return count


def parse_args(argv=None, description: Optional[str] = None) -> argparse.Namespace:
    """The training entry's command line (the launch script passes its arguments on unchanged)."""
    parser = argparse.ArgumentParser(description=description)
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
    return parser.parse_args(argv)


@dataclass
class Start:
    """A start that passed every check made before workers train."""

    cfg: RunConfig
    world_size: int
    grad_accum: int
    run_dir: Path
    under_launcher: bool = False  # a worker of an external launcher (its rank is RANK)
    resume_from: Optional[str] = None  # the checkpoint tag the run resumes from
    finished: Optional[str] = None  # why there is nothing to train, for a finished run's command
    lock: Optional[RunDirLock] = None  # the run dir's lock, held by this process

    @property
    def resolves(self) -> bool:
        """This process settles the start (the others of an external launcher only check their config)."""
        return not self.under_launcher or os.environ.get("RANK", "0") == "0"

    def report(self) -> str:
        resumes = f", resumes from {self.resume_from}" if self.resume_from else ""
        return (f"config ok for {self.world_size} processes: gradient accumulation {self.grad_accum}, "
                f"run dir {self.run_dir}{resumes}")


def default_run_dir(config_path: str, cfg: RunConfig) -> Path:
    return REPO / "runs" / f"{Path(config_path).stem}-{config_hash(cfg)[:8]}"


def resolve(args: argparse.Namespace, under_launcher: bool) -> Start:
    """Config, data, run dir, lock, resume and import, checked once per start; raises StartRefused."""
    start = _configured(args, under_launcher)
    run_dir = RunDir(start.run_dir)
    problem = run_dir.unwritable()
    if problem is not None:
        raise StartRefused(problem)
    if not start.resolves:
        return start
    planned = _planned_import(start.cfg, run_dir)  # checked (read only) before the run dir is locked or created
    # One job per run dir, locked before anything reads or changes it; the lock is held until this
    # process (and the workers it hands it to) end. --check-only tests it, keeping nothing.
    try:
        if args.check_only:
            run_dir.check_lock()
        else:
            start.lock = run_dir.acquire_lock()
    except (RunDirBusy, OSError) as e:  # OSError: the run dir cannot be created
        raise StartRefused(str(e)) from e
    plan, topology_change = _start_point(start, run_dir, args.check_only, planned)
    if not args.check_only and start.finished is None:
        plan.apply(run_dir)
        if topology_change is not None:  # converted once, here, before any worker starts
            print(topology_change.convert(), file=sys.stderr)
        run_dir.write_config(to_dict(start.cfg))
    return start


def _configured(args: argparse.Namespace, under_launcher: bool) -> Start:
    """The YAML with its overrides, checked for the process count and taken to it (for_world), and its data."""
    keep_offline()  # before anything imports a Hugging Face library (the data check's tokenizer may)
    try:
        cfg = load_run_config(args.config, args.set)
        if not cfg.data.mock:  # (megatron-core's datasets take seconds to import: only for data to check)
            from pretrain.runtime.data import check_data

            check_data(cfg)
        if under_launcher:
            world_size = int(os.environ["WORLD_SIZE"])
        else:
            world_size = args.nproc_per_node if args.world_size is None else args.world_size
        configured, cfg = cfg, for_world(cfg, world_size)
        grad_accum = validate_for_world(configured, world_size)
        keep_wandb_offline(cfg.logging.wandb_mode)  # before anything imports wandb
    except (ConfigError, OSError, yaml.YAMLError) as e:
        raise StartRefused(str(e)) from e
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(args.config, cfg)
    start = Start(cfg, world_size, grad_accum, run_dir, under_launcher=under_launcher)
    if cfg is not configured and start.resolves:
        print(f"deepspeed.zero_stage={configured.deepspeed.zero_stage} with one data-parallel rank: training at "
              "ZeRO-0, the same step with nothing to partition (deepspeed.zero_with_one_rank=true keeps the stage)",
              file=sys.stderr)
    return start


def _start_point(start: Start, run_dir: RunDir, check_only: bool,
                 planned: Optional[ImportPlan]) -> tuple[ResumePlan, Optional[TopologyChange]]:
    """Where the run starts: the checkpoint it resumes, if any, checked against the config (and the
    conversion a topology change needs; a resumed run trains the model settings its import took over,
    init_from.json), or, fresh, init_from.path's converted weights, written for the workers to load with
    its numerics taken over into start.cfg (without one, an import an earlier start left is forgotten)."""
    resumed_cfg = replace(start.cfg, model=recorded_model(start.cfg.model, run_dir))
    try:
        plan = check_resume(run_dir, resumed_cfg, start.world_size)
        topology_change = None
        if plan.tag is not None:  # (reshard imports DeepSpeed: only for a checkpoint to resume)
            from pretrain.checkpoint.reshard import plan_topology_change

            topology_change = plan_topology_change(run_dir, plan.tag, resumed_cfg, start.world_size)
    except ResumeRefused as e:
        raise StartRefused(str(e)) from e
    for line in plan.notices():
        print(line, file=sys.stderr)
    if plan.tag is not None:
        if start.cfg.init_from.path is not None:
            print(f"init_from.path is read at a run's first start only: resuming from {plan.tag}, nothing is "
                  "imported", file=sys.stderr)
        start.cfg = resumed_cfg
    start.resume_from, start.finished = plan.tag, nothing_to_train(run_dir, plan.tag, start.cfg)
    if plan.tag is None and planned is not None:
        from pretrain.checkpoint.import_plan import write_import

        print(planned.notice(), file=sys.stderr)
        start.cfg = planned.cfg
        if not check_only:
            write_import(run_dir, planned)
    elif plan.tag is None and not check_only:
        run_dir.forget_init_from()
    return plan, topology_change


def _planned_import(cfg: RunConfig, run_dir: RunDir) -> Optional[ImportPlan]:
    """A fresh start's import, checked and converted, or None."""
    if cfg.init_from.path is None or run_dir.latest_checkpoint() is not None:
        return None
    from pretrain.checkpoint.import_plan import plan_import  # builds megatron modules

    try:
        return plan_import(cfg)
    except ImportRefused as e:
        raise StartRefused(str(e)) from e


def restart_from(start: Start) -> Optional[str]:
    """Before a supervised restart: the checkpoint to resume from, checked as at the job's start."""
    run_dir = RunDir(start.run_dir)
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


def check_start(argv: list[str], world_size: int) -> Start:
    """What `--check-only --world-size N` checks, for a launcher about to start N processes
    (pretrain/launch/launcher.py): the report on stderr; returns the checked start; StartRefused."""
    start = resolve(parse_args([*argv, "--check-only", "--world-size", str(world_size)]), under_launcher=False)
    print(start.report(), file=sys.stderr)
    return start


def launched_worker(args: argparse.Namespace) -> int:
    """A rank that an external launcher started (the training entry's arguments): rank 0 resolves the
    start before the ranks meet, then every rank trains."""
    from pretrain.training.worker import train_worker  # the training stack: only where a rank trains

    die_with_launcher()
    try:
        start = resolve(args, under_launcher=True)
    except (ConfigError, StartRefused) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    # Rank 0 adopted a handed-down lock as it resolved the start (start.lock); the others adopt it here.
    run_dir = RunDir(start.run_dir)
    with run_dir.handed_down_lock():
        return train_worker(run_dir, start.cfg, start.finished if start.resolves else None)
