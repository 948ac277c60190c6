"""A Supervisor (pretrain/launch/supervisor.py) over stand-in attempts, in a process of its own (it installs
signal handlers, becomes a subreaper and kills what it leaves behind, none of which a test process may
undergo):

    python tests/support/supervised.py SCENARIOS.json

SCENARIOS.json: a list of {"run_dir", "result", "max_restarts", "attempts"}; each attempt (the last one
repeats) says what the stand-in launch does: "print" a line, log train "step", save checkpoint
"checkpoint", start a "worker" ("sleep": a rank that stops on SIGTERM with status 0; "stop": one that
SIGSTOPs itself), then "hang" (write a hang dump, as a watchdog would) or "stop_signal" (SIGUSR1 to the
supervisor, as the batch script would) and wait for the worker; else end with "status" and "ranks".
"ended": what the run says afterwards. The result file gets {"status", "attempts"}.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from pretrain.launch.supervisor import Attempt, RestartPolicy, Supervisor, become_subreaper  # noqa: E402
from pretrain.run_files.run_dir import RunDir, checkpoint_tag  # noqa: E402
from pretrain.run_files.run_records import TrainRecord  # noqa: E402

WORKERS = {
    "sleep": "import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
             "print('worker up', flush=True)\ntime.sleep(60)\nsys.exit(1)\n",
    "stop": "import os, signal\nprint('worker up', flush=True)\nos.kill(os.getpid(), signal.SIGSTOP)\n",
}


def log_step(run_dir: RunDir, step: int) -> None:
    metrics = run_dir.open_metrics()
    metrics.append(TrainRecord(step=step, loss=1.0, lr=1e-3, grad_norm=1.0, tokens_per_s=1.0, step_time_s=1.0,
                               skipped_steps=0, trainable_params=1, peak_mem_bytes=1))
    metrics.close()


def scenario(spec: dict) -> None:
    run_dir = RunDir(spec["run_dir"])
    run_dir.checkpoints.mkdir(parents=True, exist_ok=True)
    attempts, seen = spec["attempts"], []

    def plan(n: int) -> dict:
        return attempts[min(n, len(attempts) - 1)]

    def launch(n: int) -> Attempt:
        seen.append(n)
        step = plan(n)
        print(step.get("print", f"attempt {n} says goodbye"), flush=True)
        if step.get("step") is not None:
            log_step(run_dir, step["step"])
        if step.get("checkpoint") is not None:
            tag = checkpoint_tag(step["checkpoint"])
            run_dir.checkpoint(tag).mkdir(parents=True, exist_ok=True)
            run_dir.write_integrity_record(tag)
            run_dir.set_latest_checkpoint(tag)
        if step.get("worker"):
            worker = subprocess.Popen([sys.executable, "-c", WORKERS[step["worker"]]],
                                      env={**os.environ, "LOCAL_RANK": "0"}, stdout=subprocess.PIPE, text=True)
            assert worker.stdout.readline() == "worker up\n"
            if step.get("hang"):
                path = run_dir.hang_dump_file(0, step.get("step") or 0)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text("stacks\n")
            if step.get("stop_signal"):
                os.kill(os.getpid(), signal.SIGUSR1)
            return Attempt(worker.wait())
        return Attempt(step["status"], ranks={int(rank): code for rank, code in step.get("ranks", {}).items()})

    become_subreaper()
    policy = RestartPolicy(spec["max_restarts"], 0.01, {2: "refused", 3: "the run stopped itself"})
    supervisor = Supervisor(run_dir, policy, launch, ended=lambda: plan(seen[-1]).get("ended", False),
                            status_names={2: "refused", 4: "hung"}, hang_grace_s=0.2)
    status = supervisor.run()
    Path(spec["result"]).write_text(json.dumps({"status": status, "attempts": seen}))


if __name__ == "__main__":
    for spec in json.loads(Path(sys.argv[1]).read_text()):
        scenario(spec)
