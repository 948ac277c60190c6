"""Resume checks before any worker starts: config compatibility and checkpoint integrity records."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from pretrain_runs import REPO, command, env, records, run, write_config

from ora_megatron.config_io import to_dict
from pretrain.checkpoint.resume_check import POLICIES, TOPOLOGY, TOPOLOGY_KEYS, UNCLASSIFIED, flatten, policy_of
from pretrain.config import RunConfig
from pretrain.run_dir import RunDir

pytestmark = pytest.mark.distributed

NPROC = 2
LAYOUT = ["deepspeed.zero_stage=1"]  # 2 ranks, ZeRO-1: model states + one optimizer file per rank


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One finished run (6 steps, checkpoints at 3 and 6); tests work on copies of it."""
    workdir = tmp_path_factory.mktemp("resume_safety")
    config = write_config(workdir)
    run_dir = workdir / "trained"
    run(config, run_dir, LAYOUT, nproc=NPROC)
    assert RunDir(run_dir).checkpoint_tags() == ["step00000003", "step00000006"]
    return config, run_dir


def _copy(trained, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(trained[1], copy)
    return copy


def _snapshot(run_dir: Path) -> dict:
    """Every file's mtime and content, but the lock's: each start records itself there as the holder."""
    lock = RunDir(run_dir).lock_file
    return {str(p.relative_to(run_dir)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(run_dir.rglob("*")) if p.is_file() and p != lock}


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _check_only(config, run_dir) -> subprocess.CompletedProcess:
    args = command(config, run_dir, LAYOUT, nproc=NPROC) + ["--check-only", "--world-size", str(NPROC)]
    return subprocess.run(args, cwd=REPO, env=env(), capture_output=True, text=True, timeout=120)


def _refused_without_starting(config, run_dir, overrides) -> str:
    before = _snapshot(run_dir)
    started = time.time()
    out = run(config, run_dir, LAYOUT + overrides, nproc=NPROC, check=False)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "torch.distributed" not in out.stderr and "Traceback" not in out.stderr
    assert time.time() - started < 60
    assert _snapshot(run_dir) == before, "no worker may have started"
    return out.stderr


@pytest.mark.parametrize("overrides, named", [
    (["model.hidden_size=128", "model.attention.type=vanilla"],
     ["model.hidden_size 64 → 128: the checkpoint holds this model's weights",
      'model.attention.type "ora" → "vanilla": the checkpoint holds this model\'s weights']),
    (["parallel.tensor=2", "deepspeed.precision=bf16"],  # a topology change alone is allowed (reshard)
     ['deepspeed.precision "fp32" → "bf16": DeepSpeed lays the optimizer state out per precision']),
], ids=["model", "precision-topology"])
def test_incompatible_config_is_refused_before_any_worker(trained, tmp_path, overrides, named):
    config, run_dir = trained[0], _copy(trained, tmp_path)
    stderr = _refused_without_starting(config, run_dir, overrides)
    assert f"cannot resume {run_dir} from checkpoint step00000006 with this config" in stderr
    for change in named:
        assert change in stderr


def test_safe_change_resumes_and_is_logged(trained, tmp_path):
    config, run_dir = trained[0], _copy(trained, tmp_path)
    changes = ["train.steps=9", "train.micro_batch_size=2", "checkpoint.keep_last=10",
               "checkpoint.save_interval=4"]
    out = run(config, run_dir, LAYOUT + changes, nproc=NPROC)
    assert "resumed at step 6" in out.stderr
    line = ("resuming from step00000006 with changed settings: train.micro_batch_size 4 → 2, train.steps 6 → 9, "
            "checkpoint.save_interval 3 → 4, checkpoint.keep_last 2 → 10")
    assert line in out.stderr.splitlines()
    (entry,) = RunDir(run_dir).read_resume_log()
    assert entry["checkpoint"] == "step00000006" and entry["skipped"] == {}
    assert entry["changes"] == {"train.micro_batch_size": [4, 2], "train.steps": [6, 9],
                                "checkpoint.save_interval": [3, 4], "checkpoint.keep_last": [2, 10]}
    assert [r.step for r in records(run_dir)] == list(range(1, 10))

    # every save (before and after the resume) wrote a record that lists every file of its tag
    rd = RunDir(run_dir)
    assert rd.checkpoint_tags() == ["step00000003", "step00000006", "step00000008", "step00000009"]
    for tag in rd.checkpoint_tags():
        files = {p.name for p in rd.checkpoint(tag).iterdir()} - {rd.integrity_record_file(tag).name}
        assert {"mp_rank_00_model_states.pt", "rng_rank0.pt", "rng_rank1.pt", "train_state.json",
                "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"} <= files
        record = json.loads(rd.integrity_record_file(tag).read_text())
        assert record["algorithm"] == "sha256" and set(record["files"]) == files, tag
        for name, entry in record["files"].items():
            content = (rd.checkpoint(tag) / name).read_bytes()
            assert entry == {"size": len(content), "sha256": hashlib.sha256(content).hexdigest()}
        assert rd.verify_checkpoint(tag) == []


def test_truncated_latest_falls_back_to_the_previous_checkpoint(trained, tmp_path):
    config, run_dir = trained[0], _copy(trained, tmp_path)
    rd = RunDir(run_dir)
    bad = rd.checkpoint("step00000006") / "mp_rank_00_model_states.pt"
    _truncate(bad)
    logged = len(records(run_dir))
    out = run(config, run_dir, LAYOUT, nproc=NPROC)
    assert f"warning: checkpoint step00000006 is damaged ({bad} has" in out.stderr
    assert "resumed at step 3" in out.stderr
    expected = {r.step: r.loss for r in records(trained[1])}
    resumed = records(run_dir)[logged:]
    assert [r.step for r in resumed] == [4, 5, 6]
    for r in resumed:  # bitwise what the uninterrupted run logged (fp32, CPU)
        assert r.loss == expected[r.step], f"step {r.step}"
    assert rd.latest_checkpoint() == "step00000006" and rd.verify_checkpoint("step00000006") == []
    (entry,) = rd.read_resume_log()
    assert entry["checkpoint"] == "step00000003" and entry["latest_was"] == "step00000006"
    assert str(bad) in entry["skipped"]["step00000006"][0]


def test_no_intact_checkpoint_is_refused(trained, tmp_path):
    config, run_dir = trained[0], _copy(trained, tmp_path)
    rd = RunDir(run_dir)
    truncated = rd.checkpoint("step00000006") / "mp_rank_00_model_states.pt"
    _truncate(truncated)
    flipped = rd.checkpoint("step00000003") / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    content = bytearray(flipped.read_bytes())
    content[len(content) // 2] ^= 0xFF  # same size, other content
    flipped.write_bytes(bytes(content))
    stderr = _refused_without_starting(config, run_dir, [])
    assert f"no intact checkpoint to resume {run_dir} from" in stderr
    assert f"step00000006: {truncated} has" in stderr
    assert f"step00000003: {flipped} does not match its recorded sha256" in stderr


def test_missing_record_is_damage_unless_the_run_predates_records(trained, tmp_path):
    """--check-only reports the decision and writes nothing."""
    config, run_dir = trained[0], _copy(trained, tmp_path)
    rd = RunDir(run_dir)
    rd.integrity_record_file("step00000006").unlink()  # an older checkpoint has one: this code wrote it
    before = _snapshot(run_dir)
    out = _check_only(config, run_dir)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"step00000006 is damaged ({rd.integrity_record_file('step00000006')} is missing)" in out.stderr
    assert "resumes from step00000003" in out.stdout
    assert _snapshot(run_dir) == before

    rd.integrity_record_file("step00000003").unlink()  # no record anywhere: written before records existed
    out = _check_only(config, run_dir)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "checkpoint step00000006 has no integrity record" in out.stderr and "damaged" not in out.stderr
    assert "resumes from step00000006" in out.stdout


def test_every_config_key_has_an_explicit_policy():
    keys = [key for key, _ in flatten(to_dict(RunConfig()))]
    assert [k for k in keys if policy_of(k) is UNCLASSIFIED] == []
    assert all(POLICIES[k] is TOPOLOGY for k in TOPOLOGY_KEYS)  # one place decides topology changes
    assert {k for k in keys if k.startswith("model.")} and all(not policy_of(k).allowed for k in keys
                                                                   if k.startswith("model."))
    assert policy_of("train.steps").allowed and not policy_of("train.global_batch_size").allowed
