"""The training entry's own spawn: `world_size` local workers through torchrun's elastic agent, in the
entry's process, supervised (pretrain/launch/supervisor.py): a failed attempt is restarted from the latest
intact checkpoint as supervision.max_restarts allows. Each worker runs pretrain/training/worker.py on
the run dir, whose config the start resolved, and holds the run dir's lock (handed down as stdin)."""

from __future__ import annotations

import os
import sys

from pretrain.job.environment import device_environment
from pretrain.job.supervision import LAUNCHER_VARIABLE
from pretrain.launch.start import Start, restart_from
from pretrain.launch.supervisor import Attempt, supervise
from pretrain.run_files.lock import RunDirLock
from pretrain.run_files.run_dir import RunDir

WORKER_MODULE = "pretrain.training.worker"


def torchrun_attempt(argv: list[str], lock: RunDirLock) -> Attempt:
    """One launch of the workers through torchrun's elastic agent, in this process: it starts them,
    watches them and stops all of them when one fails (restarts are the supervisor's: max 0 here)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    # A stop signal reaches the workers through the agent, which SIGKILLs them after this many
    # seconds: time enough to save a checkpoint.
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "120")
    os.environ[LAUNCHER_VARIABLE] = str(os.getpid())  # the workers' parent: the agent runs here
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


def spawn_workers(start: Start) -> int:
    """Run the start's workers on this node until the job ends; the job's exit status."""
    os.environ.update(device_environment(start.cfg.parallel))  # torchrun's workers inherit it
    argv = [f"--nproc-per-node={start.world_size}", "--standalone", "--max-restarts=0", "--module", WORKER_MODULE,
            "--run-dir", str(start.run_dir)]
    return supervise(RunDir(start.run_dir), start.cfg.supervision, lambda attempt: torchrun_attempt(argv, start.lock),
                     prepare_restart=lambda: restart_from(start))
