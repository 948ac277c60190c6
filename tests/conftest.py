"""Data and training runs shared by several test files (session scope: each is built once)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from data_fixtures import build_slimpajama
from pretrain_runs import LAYOUTS, REPO, run, write_config

# Fixtures that train: a test using one starts worker processes, whatever its own marks say.
TRAINING_FIXTURES = {"reference", "layout_runs"}


def pytest_collection_modifyitems(items):
    for item in items:
        if TRAINING_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.distributed)


@pytest.fixture(scope="session")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("pretrain_parallel")


@pytest.fixture(scope="session")
def reference(workdir):
    run_dir = workdir / "single"
    run(write_config(workdir), run_dir)
    return run_dir


@pytest.fixture(scope="session")
def layout_runs(workdir):
    config = write_config(workdir)
    runs = {}
    for name, overrides in LAYOUTS.items():
        runs[name] = workdir / name
        run(config, runs[name], overrides, nproc=2)
    return runs


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
