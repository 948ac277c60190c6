"""Pretrain a GPT with any attention variant on DeepSpeed + megatron-core.

    python -m pretrain.pretrain_ora --config pretrain/configs/tiny.yaml [--set k=v ...] [--run-dir DIR]
    python -m pretrain.pretrain_ora --config ... --nproc-per-node 2      # spawns torchrun itself
    torchrun --nproc-per-node 2 -m pretrain.pretrain_ora --config ...
    deepspeed --num_gpus 8 --module pretrain.pretrain_ora --config ...   # see launch/

Parse, resolve, train, report. The start is resolved once, before any worker trains
(pretrain/launch/start.py): the config validated for the process count, the data checked, the run dir locked,
and an existing run dir with a checkpoint resumed — after checking that the checkpoint's files match
their integrity record (falling back to the newest intact one) and that the config changes nothing the
checkpoint cannot take. So the same command continues an interrupted run. `python
pretrain/pretrain_ora.py ...` (a file path, as DeepSpeed's examples run scripts) works too.

With several processes, or supervision.max_restarts > 0, this process spawns the workers through
torchrun and supervises them (pretrain/launch/local.py): a failed or hung rank restarts all of them
from the latest intact checkpoint. One process trains here; under an external launcher each rank
trains (pretrain/training/worker.py). Exit statuses: pretrain/job/exit_status.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: its folder, first on sys.path, would shadow top-level modules
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import os

from ora_megatron.config_io import ConfigError
from pretrain.job.exit_status import EXIT_CONFIG_ERROR
from pretrain.launch.launcher import adopt_scheduler_ranks
from pretrain.launch.local import spawn_workers
from pretrain.launch.start import StartRefused, launched_worker, parse_args, resolve
from pretrain.run_files.run_dir import RunDir


def main(argv=None) -> int:
    args = parse_args(argv, description=__doc__.split("\n\n")[0])
    try:
        adopt_scheduler_ranks()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    under_launcher = "WORLD_SIZE" in os.environ
    if under_launcher and not args.check_only:
        return launched_worker(args)
    try:
        start = resolve(args, under_launcher)
    except (ConfigError, StartRefused) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    if args.check_only:
        print(start.report(), file=sys.stderr if args.print_run_dir else sys.stdout)
        if args.print_run_dir:
            print(start.run_dir)
        return 0
    if start.finished is not None:  # no worker needs starting
        print(start.finished, file=sys.stderr)
        return 0
    # Several processes, or restarts (a process cannot restart itself): torchrun's workers, supervised.
    if start.world_size > 1 or start.cfg.supervision.max_restarts > 0:
        return spawn_workers(start)
    from pretrain.training.worker import train_worker

    return train_worker(RunDir(start.run_dir), start.cfg)


if __name__ == "__main__":
    sys.exit(main())
