"""A run dir received from someone else is data: none of its files can run code when it is resumed,
consolidated, converted to another topology or exported — even with its integrity record rewritten
to match. Every load goes through the restricted unpickler (pretrain/checkpoint/unpickling.py: safe_load, and
DeepSpeed's own readers behind a restricted checkpoint engine or a check of its files first).

Each test copies a trained run (tests/conftest.py), replaces one file with a pickle that, unpickled,
runs a shell command creating a marker file, rewrites the record as its sender would, and checks
that the operation is refused naming the file and that the marker never appears.
"""

from __future__ import annotations

import os
import random
import shlex
import shutil

import numpy as np
import pytest
import torch
from pretrain_runs import LAYOUTS

from ora_megatron.parallel import destroy_distributed, init_distributed
from pretrain import pretrain_ora
from pretrain.checkpoint import reshard
from pretrain.checkpoint.checkpointer import Checkpointer, _rng_state, _set_rng_state
from pretrain.checkpoint.consolidate import consolidated_state_dict
from pretrain.checkpoint.unpickling import UnsafeCheckpointFile, safe_load
from pretrain.config.run_config import read_run_config, validate_for_world
from pretrain.export import convert_to_hf
from pretrain.run_files.run_dir import RunDir
from pretrain.runtime.engine import build_engine

MODEL_STATES = "mp_rank_00_model_states.pt"
ZERO1 = LAYOUTS["dp2-zero1"]  # on 2 processes: DeepSpeed's partitioned optimizer files, one per rank
ZERO_OPTIMIZER_STATES = "zero_pp_rank_1_mp_rank_00_optim_states.pt"


class CreatesMarker:
    """Unpickling it runs `touch marker` (what any pickle can do under torch.load(weights_only=False))."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(self.marker)}",)


def received(run, tmp_path) -> RunDir:
    return RunDir(shutil.copytree(run, tmp_path / "received", ignore=shutil.ignore_patterns("tensorboard", "wandb")))


def plant(run_dir: RunDir, name: str, marker) -> str:
    """Replace file `name` of the latest checkpoint and rewrite the integrity record to match."""
    tag = run_dir.latest_checkpoint()
    path = run_dir.checkpoint(tag) / name
    assert path.is_file()
    torch.save({"module": {}, "optimizer": CreatesMarker(marker)}, path)
    run_dir.write_integrity_record(tag)
    assert not run_dir.verify_checkpoint(tag), "the record vouches for the planted file"
    return str(path)


@pytest.fixture
def marker(tmp_path):
    path = tmp_path / "code-ran"
    yield path
    assert not path.exists(), "a pickle in the run dir ran code"


# ---------------------------------------------------------------------------- before any worker starts
def test_launcher_refuses_to_resume(reference, tmp_path, marker, capsys):
    run_dir = received(reference, tmp_path)
    path = plant(run_dir, MODEL_STATES, marker)
    code = pretrain_ora.main(["--config", str(run_dir.config), "--run-dir", str(run_dir.path), "--check-only"])
    err = capsys.readouterr().err
    assert code == 2 and path in err and "config ok" not in err, err


# ---------------------------------------------------------------------------- consolidation, export, conversion
def test_consolidation_refuses(trained_runs, tmp_path, marker):
    """ZeRO-1: DeepSpeed's zero_to_fp32 unpickles the optimizer files itself; they are checked first."""
    run_dir = received(trained_runs.trained(ZERO1, nproc=2), tmp_path)
    path = plant(run_dir, ZERO_OPTIMIZER_STATES, marker)
    with pytest.raises(UnsafeCheckpointFile, match=path):
        consolidated_state_dict(read_run_config(run_dir), run_dir.checkpoint(run_dir.latest_checkpoint()))


def test_export_refuses(reference, tmp_path, marker, capsys):
    run_dir = received(reference, tmp_path)
    path = plant(run_dir, MODEL_STATES, marker)
    out = tmp_path / "export"
    assert convert_to_hf.main(["--run-dir", str(run_dir.path), "--output", str(out), "--no-verify"]) == 2
    err = capsys.readouterr().err
    assert path in err and "Traceback" not in err, err
    assert not out.exists() and not out.with_name("export.partial").exists()


@pytest.mark.parametrize("overrides, nproc, name", [([], 1, MODEL_STATES),  # ZeRO-0: torch's optimizer state
                                                   (ZERO1, 2, ZERO_OPTIMIZER_STATES)],  # DeepSpeed's extraction
                         ids=["reference", "dp2-zero1"])
def test_topology_conversion_refuses(trained_runs, tmp_path, marker, overrides, nproc, name):
    run_dir = received(trained_runs.trained(overrides, nproc=nproc), tmp_path)
    path = plant(run_dir, name, marker)
    tag = run_dir.latest_checkpoint()
    with pytest.raises(UnsafeCheckpointFile, match=path):
        reshard.convert_checkpoint(run_dir, tag, read_run_config(run_dir), reshard.checkpoint_topology(run_dir, tag))
    assert not reshard.converted_dir(run_dir, tag).exists()


# ---------------------------------------------------------------------------- the training worker's load
@pytest.fixture(scope="module")
def one_process_group():
    init_distributed(1, 1, backend="gloo")
    yield
    destroy_distributed()


@pytest.fixture(scope="module")
def train_engine(reference, one_process_group):
    """A training engine for the reference run's config (ZeRO-0, fp32), built once."""
    cfg = read_run_config(RunDir(reference))
    return build_engine(cfg, validate_for_world(cfg, 1))


def load_latest(run_dir: RunDir, train_engine) -> None:
    """What the training worker does on resume (Trainer.resume, same topology)."""
    checkpointer = Checkpointer(run_dir, read_run_config(run_dir).checkpoint)
    tag = checkpointer.latest()
    checkpointer.load(train_engine, tag, checkpointer.read_state(tag))


@pytest.mark.parametrize("name", [MODEL_STATES,  # read by DeepSpeed's load_checkpoint
                                  "rng_rank0.pt"])  # read by the checkpointer itself
def test_worker_load_refuses(reference, train_engine, tmp_path, marker, name):
    run_dir = received(reference, tmp_path)
    path = plant(run_dir, name, marker)
    with pytest.raises(UnsafeCheckpointFile, match=path):
        load_latest(run_dir, train_engine)


def test_worker_load_restores_rng_state(reference, train_engine, tmp_path):
    """RNG states are saved as numbers and lists and read back exactly."""
    run_dir = received(reference, tmp_path)
    load_latest(run_dir, train_engine)
    rng_file = run_dir.rng_state_file(run_dir.latest_checkpoint(), 0)
    saved = torch.load(rng_file, weights_only=True)
    assert random.getstate() == saved["python"] and torch.equal(torch.get_rng_state(), saved["torch"])
    assert np.random.get_state()[1].tolist() == saved["numpy"][1]


def test_rng_state_holds_no_numpy_objects(tmp_path):
    torch.save(_rng_state(), tmp_path / "rng.pt")
    safe_load(tmp_path / "rng.pt")  # torch's own types only: no numpy array


def test_rng_file_with_a_numpy_array_is_refused(tmp_path):
    state = _rng_state()
    state["numpy"] = np.random.get_state()  # numpy's own pickle: outside what the restricted unpickler reads
    torch.save(state, tmp_path / "rng.pt")
    with pytest.raises(UnsafeCheckpointFile, match="rng.pt"):
        _set_rng_state(tmp_path / "rng.pt")
