"""A run with the default logging (wandb offline, TensorBoard, a progress bar), then its export and a
sample from it, each in its own process as a user runs them under a socket audit hook: nothing
resolves a host name or connects anywhere; wandb takes the run's own id whatever the folder is
called; the progress bar counts every step."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pretrain_runs import REPO, env, write_config

from pretrain.config.run_config import load_run_config
from pretrain.job.environment import HUB_OFFLINE_ENVIRONMENT
from pretrain.run_files.run_dir import RunDir
from pretrain.runtime.metrics import wandb_run_id

# Runs `python -c AUDITED LOG MODULE ARGS...`: MODULE.main(ARGS) with every host name lookup and
# every connection that leaves the machine refused and written to LOG. Local sockets (AF_UNIX:
# wandb's service process) are allowed.
AUDITED = """
import importlib, sys

log, module, *argv = sys.argv[1:]

def refuse_network(event, args):
    lookup = event in ("socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyname_ex",
                       "socket.gethostbyaddr")
    if lookup or (event == "socket.connect" and not isinstance(args[1], (str, bytes))):
        with open(log, "a") as f:
            f.write(f"{event} {args[:2] if lookup else args[1]!r}\\n")
        raise ConnectionRefusedError(f"network use refused by the test: {event}")

sys.addaudithook(refuse_network)
sys.exit(importlib.import_module(module).main(argv))
"""

RUN_DIR_NAME = "lr=1e-3,bs=16"  # , and = are common in sweep folder names; wandb refuses , in ids
STEPS, LOG_INTERVAL = 3, 2  # the last step is not a logged one


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory, shards):
    """Train, export, generate; each command's result and the network use it attempted."""
    root = tmp_path_factory.mktemp("offline_run")
    run_dir, export_dir = root / RUN_DIR_NAME, root / "export"
    settings = [f"data.manifest={shards}/manifest.json", "data.mock=false", "model.vocab_size=400",
                f"train.steps={STEPS}", f"train.log_interval={LOG_INTERVAL}", "train.eval_interval=3",
                "logging.wandb_mode=offline", "logging.tensorboard=true", "logging.progress=true"]
    commands = {
        "train": ["pretrain.pretrain_ora", "--config", str(write_config(root)), "--run-dir", str(run_dir),
                  *[arg for item in settings for arg in ("--set", item)]],
        "export": ["pretrain.export.convert_to_hf", "--run-dir", str(run_dir), "--output", str(export_dir)],
        "generate": ["pretrain.export.generate", "--hf", str(export_dir), "--prompt", "The", "--max-new-tokens", "4"],
    }
    # What the entry points must set themselves, not inherit.
    environment = {k: v for k, v in env().items() if k not in {*HUB_OFFLINE_ENVIRONMENT, "WANDB_MODE"}}
    results = {}
    for name, command in commands.items():
        log = root / f"{name}.network"
        out = subprocess.run([sys.executable, "-c", AUDITED, str(log), *command], cwd=REPO, env=environment,
                             capture_output=True, text=True, timeout=600)
        results[name] = (out, log.read_text() if log.exists() else "")
    return run_dir, results


@pytest.mark.distributed
@pytest.mark.parametrize("command", ["train", "export", "generate"])
def test_nothing_touches_the_network(offline_run, command):
    _, results = offline_run
    out, network = results[command]
    assert out.returncode == 0, out.stderr[-3000:]
    assert network == "", f"{command} attempted network use:\n{network}"


@pytest.mark.distributed
def test_wandb_takes_the_runs_own_id_not_its_folder_name(offline_run):
    run_dir, results = offline_run
    assert results["train"][0].returncode == 0, results["train"][0].stderr[-3000:]
    run_id = (run_dir / "wandb" / "run_id").read_text().strip()
    assert re.fullmatch(r"[0-9a-f]{16}", run_id)
    assert [p.name for p in (run_dir / "wandb").glob("offline-run-*")] == [
        p.name for p in (run_dir / "wandb").glob(f"offline-run-*-{run_id}")] != []


@pytest.mark.distributed
def test_progress_bar_counts_every_step(offline_run):
    out, _ = offline_run[1]["train"]
    assert out.returncode == 0, out.stderr[-3000:]
    assert f" {STEPS}/{STEPS} [" in out.stderr, "the bar ends at the last step, logged or not"
    assert "loss=" in out.stderr


def test_wandb_id_is_kept_by_a_run_and_differs_between_runs(tmp_path):
    config = load_run_config(str(write_config(tmp_path)))
    sweep = tmp_path / "sweep"
    arms = {arm: RunDir(sweep / arm / "seed1") for arm in ("vanilla", "ora")}
    ids = {arm: wandb_run_id(run_dir, config) for arm, run_dir in arms.items()}
    assert ids["vanilla"] != ids["ora"], "arms of one seed share a folder name, not an id"
    assert all(re.fullmatch(r"[0-9a-f]{16}", run_id) for run_id in ids.values())
    longer = dataclasses.replace(config, train=dataclasses.replace(config.train, steps=1000))
    assert wandb_run_id(arms["ora"], longer) == ids["ora"], "a resume with changed settings keeps the id"
    moved = sweep / "moved"
    Path(arms["ora"].path).rename(moved)
    assert wandb_run_id(RunDir(moved), config) == ids["ora"], "a moved run dir keeps the id"
    restarted = RunDir(sweep / "vanilla" / "seed1")
    (restarted.path / "wandb" / "run_id").unlink()
    assert wandb_run_id(restarted, config) != ids["vanilla"], "a run started afresh is a new W&B run"
