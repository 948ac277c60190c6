"""launch/ scripts: the DeepSpeed launcher across two "nodes" on localhost (no ssh)."""

from __future__ import annotations

import os
import subprocess

import pytest
from distributed import free_port
from pretrain_runs import REPO, env, losses_by_step, run, write_config

pytestmark = pytest.mark.distributed


def test_multi_node_script_two_local_nodes_match_single_process(tmp_path):
    config = write_config(tmp_path)
    reference = tmp_path / "single"
    run(config, reference, ["deepspeed.zero_stage=2"])
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=1\nnode1 slots=1\n")
    run_dir = tmp_path / "two_nodes"
    port = str(free_port())
    nodes = [subprocess.Popen(
        ["bash", "launch/multi_node.sh", str(hostfile), "--config", str(config), "--run-dir", str(run_dir),
         "--set", "deepspeed.zero_stage=2"],
        cwd=REPO, env={**env(), "NODE_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert all(node.returncode == 0 for node in nodes), outputs[0][-3000:]
    losses, expected = losses_by_step(run_dir), losses_by_step(reference)
    assert sorted(losses) == sorted(expected)
    assert all(abs(losses[s] - expected[s]) <= 1e-4 * expected[s] for s in expected)


def test_single_node_script_validates_before_launching(tmp_path):
    config = write_config(tmp_path)
    out = subprocess.run(["bash", "launch/single_node.sh", "2", "--config", str(config),
                          "--run-dir", str(tmp_path / "never"), "--set", "train.global_batch_size=6"],
                         cwd=REPO, env=env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "train.global_batch_size" in out.stderr
    assert "deepspeed.launcher" not in out.stdout + out.stderr
    assert not (tmp_path / "never").exists()
    assert os.path.exists(REPO / "launch" / "slurm.sbatch")
