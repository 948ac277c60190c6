"""Resume checks before any worker starts: config compatibility and checkpoint integrity records."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from pretrain_runs import LAYOUTS, arguments, forbid_workers, records, run

from ora_megatron.config_io import to_dict
from pretrain import pretrain_ora
from pretrain.checkpoint.resume_check import POLICIES, TOPOLOGY, TOPOLOGY_KEYS, UNCLASSIFIED, flatten, policy_of
from pretrain.config.run_config import RunConfig
from pretrain.run_files.run_dir import RunDir

pytestmark = pytest.mark.distributed

NPROC = 2
LAYOUT = LAYOUTS["dp2-zero1"]  # 2 ranks, ZeRO-1: model states + one optimizer file per rank


@pytest.fixture
def trained(trained_runs) -> Path:
    """The session's finished run in LAYOUT (6 steps, checkpoints at 3 and 6): read only."""
    run_dir = trained_runs.trained(LAYOUT, nproc=NPROC)
    assert RunDir(run_dir).checkpoint_tags() == ["step00000003", "step00000006"]
    return run_dir


@pytest.fixture
def copied(trained, trained_runs, tmp_path) -> tuple[Path, Path]:
    """(config, run dir): this test's copy of the trained run."""
    run_dir = trained_runs.copy(tmp_path / "run", LAYOUT, nproc=NPROC)
    return run_dir.parent / "run.yaml", run_dir


def _snapshot(run_dir: Path) -> dict:
    """Every file's mtime and content, but the lock's: each start records itself there as the holder."""
    lock = RunDir(run_dir).lock_file
    return {str(p.relative_to(run_dir)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(run_dir.rglob("*")) if p.is_file() and p != lock}


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _start_in_process(config, run_dir, overrides, capsys, monkeypatch, extra=()) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of the entry's command, run in this process: it must start no worker."""
    forbid_workers(monkeypatch)
    code = pretrain_ora.main(arguments(config, run_dir, LAYOUT + overrides, nproc=NPROC) + list(extra))
    out = capsys.readouterr()
    return code, out.out, out.err


def _check_only(config, run_dir, capsys, monkeypatch) -> tuple[int, str, str]:
    return _start_in_process(config, run_dir, [], capsys, monkeypatch, ["--check-only", "--world-size", str(NPROC)])


def _refused_without_starting(config, run_dir, overrides, capsys, monkeypatch) -> str:
    before = _snapshot(run_dir)
    code, _, stderr = _start_in_process(config, run_dir, overrides, capsys, monkeypatch)
    assert code == 2, stderr[-3000:]
    assert "torch.distributed" not in stderr and "Traceback" not in stderr
    assert _snapshot(run_dir) == before, "no worker may have started"
    return stderr


@pytest.mark.parametrize("overrides, named", [
    (["model.hidden_size=128", "model.attention.type=vanilla"],
     ["model.hidden_size 64 → 128: the checkpoint holds this model's weights",
      'model.attention.type "ora" → "vanilla": the checkpoint holds this model\'s weights']),
    (["parallel.tensor=2", "deepspeed.precision=bf16"],  # a topology change alone is allowed (reshard)
     ['deepspeed.precision "fp32" → "bf16": DeepSpeed lays the optimizer state out per precision']),
], ids=["model", "precision-topology"])
def test_incompatible_config_is_refused_before_any_worker(copied, capsys, monkeypatch, overrides, named):
    config, run_dir = copied
    stderr = _refused_without_starting(config, run_dir, overrides, capsys, monkeypatch)
    assert f"cannot resume {run_dir} from checkpoint step00000006 with this config" in stderr
    for change in named:
        assert change in stderr


def test_safe_change_resumes_and_is_logged(copied):
    config, run_dir = copied
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


def test_truncated_latest_falls_back_to_the_previous_checkpoint(trained, copied):
    config, run_dir = copied
    rd = RunDir(run_dir)
    bad = rd.checkpoint("step00000006") / "mp_rank_00_model_states.pt"
    _truncate(bad)
    logged = len(records(run_dir))
    out = run(config, run_dir, LAYOUT, nproc=NPROC)
    assert f"warning: checkpoint step00000006 is damaged ({bad} has" in out.stderr
    assert "resumed at step 3" in out.stderr
    expected = {r.step: r.loss for r in records(trained)}
    resumed = records(run_dir)[logged:]
    assert [r.step for r in resumed] == [4, 5, 6]
    for r in resumed:  # bitwise what the uninterrupted run logged (fp32, CPU)
        assert r.loss == expected[r.step], f"step {r.step}"
    assert rd.latest_checkpoint() == "step00000006" and rd.verify_checkpoint("step00000006") == []
    (entry,) = rd.read_resume_log()
    assert entry["checkpoint"] == "step00000003" and entry["latest_was"] == "step00000006"
    assert str(bad) in entry["skipped"]["step00000006"][0]


def test_no_intact_checkpoint_is_refused(copied, capsys, monkeypatch):
    config, run_dir = copied
    rd = RunDir(run_dir)
    truncated = rd.checkpoint("step00000006") / "mp_rank_00_model_states.pt"
    _truncate(truncated)
    flipped = rd.checkpoint("step00000003") / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    content = bytearray(flipped.read_bytes())
    content[len(content) // 2] ^= 0xFF  # same size, other content
    flipped.write_bytes(bytes(content))
    stderr = _refused_without_starting(config, run_dir, [], capsys, monkeypatch)
    assert f"no intact checkpoint to resume {run_dir} from" in stderr
    assert f"step00000006: {truncated} has" in stderr
    assert f"step00000003: {flipped} does not match its recorded sha256" in stderr


def test_missing_record_is_damage(copied, capsys, monkeypatch):
    """--check-only reports the decision and writes nothing."""
    config, run_dir = copied
    rd = RunDir(run_dir)
    rd.integrity_record_file("step00000006").unlink()
    before = _snapshot(run_dir)
    code, stdout, stderr = _check_only(config, run_dir, capsys, monkeypatch)
    assert code == 0, stderr[-3000:]
    assert f"step00000006 is damaged ({rd.integrity_record_file('step00000006')} is missing)" in stderr
    assert "resumes from step00000003" in stdout
    assert _snapshot(run_dir) == before

    rd.integrity_record_file("step00000003").unlink()  # no record anywhere: nothing is intact
    stderr = _refused_without_starting(config, run_dir, [], capsys, monkeypatch)
    assert f"no intact checkpoint to resume {run_dir} from" in stderr
    assert f"step00000003: {rd.integrity_record_file('step00000003')} is missing" in stderr


def test_every_config_key_has_an_explicit_policy():
    keys = [key for key, _ in flatten(to_dict(RunConfig()))]
    assert [k for k in keys if policy_of(k) is UNCLASSIFIED] == []
    assert all(POLICIES[k] is TOPOLOGY for k in TOPOLOGY_KEYS)  # one place decides topology changes
    assert {k for k in keys if k.startswith("model.")} and all(not policy_of(k).allowed for k in keys
                                                                   if k.startswith("model."))
    assert policy_of("train.steps").allowed and not policy_of("train.global_batch_size").allowed
