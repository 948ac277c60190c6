"""Data and training runs shared by the whole suite (session scope: each is built once)."""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys

import pytest
import torch
from data_fixtures import build_slimpajama
from one_process import process_group
from pretrain_runs import LAYOUTS, REPO, RunCache

# Fixtures that train: a test using one starts worker processes, whatever its own marks say.
TRAINING_FIXTURES = {"trained_runs", "reference", "layout_runs"}
# Fixtures that build data through the data tools' commands (seconds of subprocesses).
SLOW_FIXTURES = {"shards"}


def pytest_configure(config):
    """Every process of the suite (this one, the ranks it spawns, the commands it runs) finds the
    virtualenv's tools first on PATH, as in an activated virtualenv. DeepSpeed JIT-builds its CPU
    communication op with the first ninja there, and two ninja versions taking turns rebuild it
    (about 35 s) each time the other one ran.

    The suite runs on CPUs: unless the session selects the gpu-marked tests (`-m gpu`), the machine's
    GPUs are hidden from all of these processes (CUDA_VISIBLE_DEVICES=""), so that on a machine with
    GPUs no rank or command takes one (a CUDA context each, NCCL instead of gloo)."""
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    if not re.search(r"(?<!not )\bgpu\b", config.option.markexpr):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


def pytest_ignore_collect(collection_path, config):
    """`-m gpu` alone (the GPU report's tests, on a GPU machine that has only pyproject.toml's GPU set beside
    its torch) collects only the test files that mark a test gpu (`mark.gpu` in their text): the others may
    import what that set leaves out (scipy, datasets, matplotlib, ...)."""
    if config.option.markexpr.strip() == "gpu" and collection_path.is_file() and collection_path.match("test_*.py"):
        return "mark.gpu" not in collection_path.read_text() or None
    return None


def pytest_collection_modifyitems(items):
    for item in items:
        if item.get_closest_marker("gpu") and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device (select gpu tests with -m gpu)"))
        if TRAINING_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.distributed)
        elif SLOW_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.slow)


def pytest_collection_finish(session):
    """What collection imported (torch, megatron-core, transformers: some 600,000 objects) lives as long as the
    process. Frozen, it is skipped by every full garbage collection after it: the collector's own passes during
    the tests, pytest's at the end of the session and the interpreter's at exit (about 4 s of make test-fast)."""
    gc.freeze()


@pytest.fixture(scope="session")
def trained_runs(tmp_path_factory, worker_id) -> RunCache:
    """The session's trainings. Under pytest-xdist in this session's folder above the workers' own, so
    that a run one worker trained is read by the others."""
    if worker_id == "master":
        return RunCache(tmp_path_factory.mktemp("trained_runs"))
    return RunCache(tmp_path_factory.getbasetemp().parent / "trained_runs")


@pytest.fixture(scope="session")
def reference(trained_runs):
    """TINY_RUN on one process, ZeRO-0: what every layout is compared with."""
    return trained_runs.trained()


@pytest.fixture(scope="session")
def layout_runs(trained_runs):
    """TINY_RUN on two processes in each of LAYOUTS."""
    return {name: trained_runs.trained(overrides, nproc=2) for name, overrides in LAYOUTS.items()}


@pytest.fixture(scope="session")
def shards(tmp_path_factory):
    """A small SlimPajama-style corpus → sentencepiece (vocab 400) → shards split train/valid/test."""
    root = tmp_path_factory.mktemp("pretrain_data")
    build_slimpajama(str(root / "corpus"), documents_per_file=60, words=(40, 120), bad_records=False)
    for args in (["data_tools.train_tokenizer", "--input", str(root / "corpus"), "--model-prefix",
                  str(root / "tok" / "sp"), "--vocab-size", "400"],
                 ["data_tools.build_shards", "--input", str(root / "corpus"), "--tokenizer",
                  str(root / "tok" / "sp.model"), "--output-dir", str(root / "shards"), "--split-by-source",
                  "--split", "train=0.8,valid=0.1,test=0.1", "--quiet"]):
        subprocess.run([sys.executable, "-m", *args], cwd=REPO, check=True, capture_output=True)
    return root / "shards"


@pytest.fixture(scope="module")
def one_process_group():
    """torch.distributed and megatron-core's parallel state for one rank (gloo), for a module's tests."""
    with process_group():
        yield
