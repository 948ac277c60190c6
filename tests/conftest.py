"""Training runs shared by several test files (session scope: each layout is trained once)."""

from __future__ import annotations

import pytest
from pretrain_runs import LAYOUTS, run, write_config


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
