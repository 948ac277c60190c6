"""pretrain/research/sweep/: expansion and validation of specs (the shipped ones included), the dry run and
the emitted commands and SLURM script, and real tiny sweeps: records, finished and failed runs
skipped, an interrupted sweep resumed from its checkpoint, a SLURM task through the launch script."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from pretrain_runs import REPO, env, write_config
from sweep_runs import write_run

from pretrain.config.run_config import read_run_config
from pretrain.paths import ENTRY_MODULE
from pretrain.research.sweep import slurm
from pretrain.research.sweep import spec as sweep_spec
from pretrain.research.sweep.__main__ import main
from pretrain.research.sweep.spec import DESIGN_SEEDS, LOG_NAME, Run, expand, load_spec
from pretrain.run_files.run_dir import RunDir, config_hash

EXPERIMENTS = REPO / "pretrain" / "experiments"
SHELLCHECK = Path(sys.executable).parent / "shellcheck"

# The arms each shipped spec must have (the research plan's grid), in order, and its reference arm.
SHIPPED = {
    "core": (["vanilla", "ora", "frozen_gaussian"], "vanilla"),
    "baselines": (["vanilla", "ora", "synthesizer_random", "synthesizer_random_fixed", "synthesizer_factorized",
                   "fixed_random_attention", "partial_frozen"], "vanilla"),
    "a1": (["orthogonal", "gaussian", "uniform", "gaussian_matched", "uniform_matched"], "orthogonal"),
    "a2": (["both_frozen", "q_trainable", "k_trainable", "both_trainable", "vanilla"], "both_frozen"),
    # A3-A6: every shape with ORA and its vanilla twin
    "a3": ([f"heads{n}_{m}" for n in (2, 4, 8, 16) for m in ("ora", "vanilla")], "heads8_vanilla"),
    "a4": ([f"width_{w}_{m}" for w in ("0.5x", "1x", "1.5x", "2x") for m in ("ora", "vanilla")], "width_1x_vanilla"),
    "a5": ([f"seq_{x}_{m}" for x in ("0.25x", "1x", "2x", "4x") for m in ("ora", "vanilla")], "seq_1x_vanilla"),
    "a6": ([f"layers{n}_{m}" for n in (4, 8, 12, 24) for m in ("ora", "vanilla")], "layers4_vanilla"),
    "a5_retrieval": ([f"len{n}_{m}" for n in (32, 64, 128, 256) for m in ("ora", "vanilla")], "len32_vanilla"),
    "a7": (["qr", "svd", "householder", "cayley", "hadamard", "vanilla"], "vanilla"),
    "transfer": (["vanilla_finetuned", "ora_finetuned", "vanilla_scratch", "ora_scratch"], "vanilla_finetuned"),
    "probes": (["vanilla", "ora", "ora_init_trainable", "frozen_gaussian_scaled", "synthesizer_random"], "vanilla"),
}

# The shipped specs' `gaps` (every arm of A3-A6 in a pair <shape>_ora, <shape>_vanilla) and their x.
SHIPPED_GAPS = {"a3": "head_dim", "a4": "parameters", "a5": "seq_length", "a5_retrieval": "seq_length",
                "a6": "num_layers"}

# Overrides of tests/pretrain_runs.py's tiny mock-data run for a sweep that finishes in seconds.
QUICK = {"train.steps": 4, "train.eval_interval": 2, "checkpoint.save_interval": 2}
# A run that fails at run time (exit 3): every step's loss is non-finite, two in a row stop it.
BROKEN = {"faults": [{"kind": "nan", "batch": 1}, {"kind": "nan", "batch": 2}], "stability.max_consecutive_skips": 2}


def write_spec(directory: Path, arms: dict, seeds=(1,), scale_set=None, processes: int = 1) -> Path:
    write_config(directory)
    spec = {"config": "run.yaml", "description": "test sweep", "reference": next(iter(arms)), "seeds": list(seeds),
            "scales": {"cpu": {"processes_per_node": processes, "set": scale_set or QUICK}}, "arms": arms}
    path = directory / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def arm(attention: str, **extra) -> dict:
    return {"description": f"{attention} attention", "set": {"model.attention.type": attention, **extra}}


def sweep_args(spec: Path, out: Path, *extra: str) -> list[str]:
    return ["--spec", str(spec), "--out", str(out), *extra]


# ---------------------------------------------------------------------- expansion and validation


def test_expansion_is_seeds_times_arms_with_every_override_applied(tmp_path):
    arms = {"a": arm("vanilla"),
            "b": {**arm("ora"), "scales": {"cpu": {"model.hidden_size": 32}}},
            "c": arm("ora", **{"train.steps": 5})}
    spec = load_spec(write_spec(tmp_path, arms, seeds=(7, 8)))
    runs = expand(spec, "cpu", None, ["eval.iters=3"], tmp_path / "out")

    assert [(r.arm, r.seed) for r in runs] == [("a", 7), ("b", 7), ("c", 7), ("a", 8), ("b", 8), ("c", 8)]
    assert [r.run_dir.path for r in runs[:2]] == [tmp_path / "out" / "a" / "seed7", tmp_path / "out" / "b" / "seed7"]
    assert runs[1].experiment_id == "spec/b/seed7"
    for run in runs:
        assert (run.cfg.model.seed, run.cfg.data.seed) == (run.seed, run.seed)
        assert run.cfg.eval.iters == 3  # --set reaches every run
        assert run.cfg.checkpoint.save_interval == 2  # the scale's set
    assert [r.cfg.model.attention.type for r in runs[:3]] == ["vanilla", "ora", "ora"]
    assert [r.cfg.model.hidden_size for r in runs[:3]] == [64, 32, 64]  # b's own override at this scale
    assert [r.cfg.train.steps for r in runs[:3]] == [4, 4, 5]  # the arm's set over the scale's
    assert [r.seed for r in expand(spec, "cpu", [5], [], tmp_path / "out")] == [5, 5, 5]


def test_seed_in_a_spec_value_is_the_runs_seed(tmp_path):
    arms = {"a": arm("vanilla", **{"logging.wandb_project": "from-seed{seed}"})}
    runs = expand(load_spec(write_spec(tmp_path, arms, seeds=(7, 8))), "cpu", None,
                  ["logging.tensorboard=false"], tmp_path / "out")
    assert [r.cfg.logging.wandb_project for r in runs] == ["from-seed7", "from-seed8"]


@pytest.mark.parametrize("bad_arm, processes, extra, expected", [
    ({"set": {"model.num_attention_heads": 3}}, 1, [], ["arm 'bad'", "model.num_attention_heads"]),
    ({"set": {"model.no_such_key": 1}}, 1, [], ["arm 'bad'", "model.no_such_key"]),
    ({"set": {"train.micro_batch_size": 8}}, 2, [], ["arm 'bad'", "2 processes", "train.global_batch_size"]),
    ({"set": {}}, 1, ["--set", "model.seed=3"], ["model.seed", "--seeds"]),
])
def test_invalid_run_exits_2_naming_spec_arm_and_key_and_starts_nothing(tmp_path, capsys, bad_arm, processes,
                                                                       extra, expected):
    spec = write_spec(tmp_path, {"good": arm("ora"), "bad": bad_arm}, processes=processes)
    out = tmp_path / "out"
    assert main(sweep_args(spec, out, *extra)) == 2
    err = capsys.readouterr().err
    assert all(text in err for text in expected), err
    assert "spec.yaml" in err or "--set" in err
    assert not out.exists()


@pytest.mark.parametrize("change, key", [
    ({"reference": "nope"}, "reference"),
    ({"armz": {}}, "armz"),
    ({"arms": {"a b": arm("ora")}, "reference": "a b"}, "arms.a b"),
    ({"arms": {"a": {**arm("ora"), "scales": {"gpu": {}}}}, "reference": "a"}, "arms.a.scales"),
    ({"gaps": {"arm": "ora", "reference": "vanilla", "x": "width"}}, "gaps.x"),
    ({"gaps": {"arm": "ora", "reference": "ora", "x": "head_dim"}}, "gaps.reference"),
    ({"gaps": {"arm": "", "reference": "vanilla", "x": "head_dim"}}, "gaps.arm"),
    ({"gaps": {"arm": "ora", "reference": "vanilla", "x": "head_dim"}}, "gaps"),  # no s_ora with s_vanilla
])
def test_invalid_spec_exits_2_naming_the_key(tmp_path, capsys, change, key):
    path = write_spec(tmp_path, {"a": arm("ora")})
    path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), **change}))
    assert main(sweep_args(path, tmp_path / "out")) == 2
    assert f"spec.yaml: config error at '{key}'" in capsys.readouterr().err


def test_every_shipped_spec_is_tested():
    assert {p.stem for p in EXPERIMENTS.glob("*.yaml")} == set(SHIPPED) | {"common"}


@pytest.mark.parametrize("scale", ["cpu", pytest.param("paper", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_spec_expands_and_validates(tmp_path, name, scale):
    spec = load_spec(EXPERIMENTS / f"{name}.yaml")
    runs = expand(spec, scale, None, [], tmp_path)
    arms, reference = SHIPPED[name]

    assert spec.body.reference == reference
    assert spec.body.seeds == DESIGN_SEEDS
    gaps = spec.body.gaps
    assert (gaps and gaps.x) == SHIPPED_GAPS.get(name)
    if gaps:
        pairs = gaps.pairs(spec.body.arms)
        assert sorted(a for pair in pairs for a in (pair.arm, pair.reference)) == sorted(arms)
    assert [(r.arm, r.seed) for r in runs] == [(a, s) for s in DESIGN_SEEDS for a in arms]
    first_seed = runs[:len(arms)]
    assert len({config_hash(r.cfg) for r in first_seed}) == len(arms), "two arms resolve to the same config"
    assert all(r.run_dir.read_experiment() is None for r in runs)  # expanding writes nothing
    if scale == "paper":  # the research plan's protocol: Small preset, global batch 128, 100k steps, 8 GPUs
        assert {r.scale.processes_per_node for r in runs} == {8}
        assert {(r.cfg.train.global_batch_size, r.cfg.train.steps) for r in runs} == {(128, 100_000)}
        assert {r.cfg.model.hidden_size for r in runs} == ({256, 512, 768, 1024} if name == "a4" else {512})
    elif name in ("probes", "a5_retrieval"):  # the probe tasks' examples: 32 tokens over 24 ids, llama (RoPE)
        assert {r.scale.processes_per_node for r in runs} == {1}
        assert {(r.cfg.train.global_batch_size, r.cfg.model.vocab_size, r.cfg.model.family) for r in runs} == {
            (32, 24, "llama")}
    elif name == "transfer":  # the recipe on the subword corpus, each fine-tuned run from its own seed's run
        assert {(r.cfg.train.global_batch_size, r.cfg.model.vocab_size) for r in runs} == {(12, 2048)}
        assert {r.cfg.init_from.path for r in runs if r.arm == "ora_finetuned"} == {
            f"runs/sweeps/baselines_bpe/ora/seed{seed}" for seed in DESIGN_SEEDS}
    else:  # the nanoGPT shakespeare_char recipe
        assert {r.scale.processes_per_node for r in runs} == {1}
        assert {(r.cfg.train.global_batch_size, r.cfg.model.vocab_size) for r in runs} == {(12, 68)}


def test_dry_run_and_emitted_commands(tmp_path, capsys):
    spec = write_spec(tmp_path, {"a": arm("vanilla"), "b": arm("ora")}, seeds=(7, 8))
    out = tmp_path / "out"
    assert main(sweep_args(spec, out, "--dry-run")) == 0
    assert capsys.readouterr().out.splitlines() == [f"spec/{a}/seed{s}: pending -> start"
                                                    for s in (7, 8) for a in ("a", "b")]
    assert not out.exists()

    assert main(sweep_args(spec, out, "--emit", "commands", "--set", "logging.wandb_project=it's x")) == 0
    commands = [shlex.split(line) for line in capsys.readouterr().out.splitlines()]
    assert len(commands) == 4
    first = commands[0]
    assert first[:3] == [sys.executable, "-m", ENTRY_MODULE]
    assert first[first.index("--run-dir") + 1] == str(out / "a" / "seed7")
    sets = [first[i + 1] for i, arg in enumerate(first) if arg == "--set"]
    assert sets[-4:] == ["model.attention.type=vanilla", "logging.wandb_project=it's x", "model.seed=7", "data.seed=7"]
    assert not out.exists()


def test_emitted_slurm_script_passes_shellcheck_and_keeps_every_argument(tmp_path, capsys):
    spec = write_spec(tmp_path, {"a": arm("vanilla"), "b": arm("ora")}, seeds=(7, 8))
    out = tmp_path / "out dir"
    tricky = 'logging.wandb_project=it\'s "q" $(touch PWNED)'
    assert main(sweep_args(spec, out, "--emit", "slurm", "--seeds", "7,8", "--set", tricky)) == 0
    script = out / "sweep.sbatch"
    assert str(script) in capsys.readouterr().out
    text = script.read_text()
    assert "#SBATCH --array=0-3" in text and "#SBATCH --gpus-per-node=1" in text

    lint = subprocess.run([str(SHELLCHECK), str(script)], capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout
    # The array holds exactly the arguments the task passes on: nothing re-parsed, nothing run.
    declaration = text[text.index("sweep_args=("):text.index("\n)\n") + 2]
    echoed = subprocess.run(["bash", "-c", f'{declaration}\nprintf "%s\\n" "${{sweep_args[@]}}"'], cwd=tmp_path,
                            capture_output=True, text=True, check=True).stdout.splitlines()
    assert echoed == ["--spec", str(spec), "--out", str(out), "--scale", "cpu", "--seeds", "7,8", "--set", tricky]
    assert not (tmp_path / "PWNED").exists()


# ---------------------------------------------------------------------- real tiny sweeps


@pytest.fixture
def training_environment(monkeypatch):
    """The runs an in-process sweep starts get what every training the tests start gets
    (pretrain_runs.env): one thread."""
    monkeypatch.setenv("OMP_NUM_THREADS", env()["OMP_NUM_THREADS"])


def log_sizes(out: Path) -> dict:
    return {str(p): p.stat().st_size for p in out.rglob(LOG_NAME)}


@pytest.mark.distributed
def test_sweep_records_runs_then_skips_finished_and_failed(tmp_path, capsys, training_environment):
    spec, out = write_spec(tmp_path, {"ora": arm("ora"), "broken": arm("ora", **BROKEN)}), tmp_path / "out"

    assert main(sweep_args(spec, out, "--jobs", "2")) == 1  # one run failed
    table = capsys.readouterr().out
    assert "failed (3)" in table and "finished" in table

    run_dir = RunDir(out / "ora" / "seed1")
    record, summary = run_dir.read_experiment(), run_dir.read_summary()
    resolved = yaml.safe_load(run_dir.config.read_text())
    assert (record.experiment_id, record.method, record.seed) == ("spec/ora/seed1", "ora", 1)
    assert (record.status, record.exit_code, record.notes) == ("finished", 0, "ora attention")
    assert record.results["final_val_loss"] == summary.final_valid_loss
    assert record.results["final_val_ppl"] == pytest.approx(math.exp(summary.final_valid_loss))
    assert record.results["final_train_loss"] == summary.final_train_loss
    assert record.results["training_time_hours"] == pytest.approx(summary.wall_time_s / 3600)
    assert record.model_config == resolved.pop("model") and record.training_config == resolved
    assert record.config_hash == config_hash(read_run_config(run_dir))  # the config the run used
    assert record.start_time and record.log_tail == ""
    failed = RunDir(out / "broken" / "seed1").read_experiment()
    assert (failed.status, failed.exit_code) == ("failed", 3)
    assert "consecutive steps had non-finite loss" in failed.log_tail

    # As if the sweep had been killed (SIGKILL) while ora's run went on alone and completed.
    run_dir.write_experiment(dataclasses.replace(record, status="running", results={}, exit_code=None))
    before = log_sizes(out)
    assert main(sweep_args(spec, out)) == 1
    output = capsys.readouterr().out
    assert "spec/ora/seed1: completed after its sweep was gone" in output and "nothing to start" in output
    assert log_sizes(out) == before
    assert run_dir.read_experiment() == dataclasses.replace(record, exit_code=None)  # finished, exit code unknown
    assert main(sweep_args(spec, out, "--dry-run", "--retry-failed")) == 0
    assert "spec/broken/seed1: failed -> retry" in capsys.readouterr().out.splitlines()


@pytest.mark.distributed
def test_interrupted_sweep_resumes_its_run_from_the_checkpoint(tmp_path, training_environment):
    # No checkpoint but the one the run saves when it is stopped; the signal comes at its first
    # logged step, with about a second of training left.
    steps = 40
    spec = write_spec(tmp_path, {"ora": arm("ora")}, scale_set={
        "train.steps": steps, "train.eval_interval": steps, "checkpoint.save_interval": steps})
    out = tmp_path / "out"
    run_dir = RunDir(out / "ora" / "seed1")
    process = subprocess.Popen([sys.executable, "-m", "pretrain.research.sweep", *sweep_args(spec, out)], cwd=REPO,
                               env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 240
    while not run_dir.read_records("train"):
        assert process.poll() is None and time.time() < deadline, "the run did not start training"
        time.sleep(0.02)
    process.send_signal(signal.SIGTERM)
    output = process.communicate(timeout=120)[0]
    assert process.returncode == 128 + signal.SIGTERM, output
    assert "interrupted spec/ora/seed1" in output
    stopped = run_dir.read_summary()
    assert stopped.preempted and stopped.steps < steps
    assert run_dir.read_experiment().status == "running"

    assert main(sweep_args(spec, out)) == 0
    assert [entry["step"] for entry in run_dir.read_resume_log()] == [stopped.steps]  # resumed, not restarted
    summary = run_dir.read_summary()
    assert (summary.steps, summary.preempted) == (steps, False)
    assert run_dir.read_experiment().status == "finished"


@pytest.mark.distributed
def test_slurm_task_runs_its_run_through_the_launch_script(tmp_path, monkeypatch, capsys, training_environment):
    spec, out = write_spec(tmp_path, {"a": arm("vanilla"), "b": arm("ora")}), tmp_path / "out"
    # Stands in for launch/pretrain_ora.sh: the same interface (CONFIG --set ..., RUN_DIR in the environment).
    launcher = tmp_path / "pretrain_ora.sh"
    launcher.write_text(f'#!/usr/bin/env bash\necho "nodes=$NNODES gpus=$GPUS_PER_NODE"\n'
                        f'exec {shlex.quote(sys.executable)} -m {ENTRY_MODULE} --config "$1" '
                        f'--run-dir "$RUN_DIR" "${{@:2}}"\n')
    launcher.chmod(0o755)
    monkeypatch.setattr(slurm, "LAUNCH_SCRIPT", launcher)

    assert main(sweep_args(spec, out, "--task", "1")) == 0
    run_dir = RunDir(out / "b" / "seed1")
    assert run_dir.read_experiment().status == "finished"
    assert "nodes=1 gpus=1" in (run_dir.path / LOG_NAME).read_text()
    assert not (out / "a").exists()
    assert main(sweep_args(spec, out, "--task", "1")) == 0
    assert "spec/b/seed1: finished, nothing to do" in capsys.readouterr().out


# ---------------------------------------------------------------------- post-training evaluations


def with_evaluations(path: Path, names: list) -> Path:
    path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), "evaluations": names}, sort_keys=False))
    return path


def evaluation_writes_its_file(name: str) -> list:
    """What stands in for an evaluation module (`python ... --run-dir RUN`): it writes RUN/evaluations/<name>.json."""
    return ["-c", "import json, pathlib, sys; folder = pathlib.Path(sys.argv[2]) / 'evaluations'; "
            f"folder.mkdir(exist_ok=True); (folder / '{name}.json').write_text(json.dumps("
            f"{{'name': '{name}', 'summary': {{}}, 'higher_is_better': {{}}}}))"]


EVALUATION_FAILS = ["-c", "import sys; print('the probe broke'); sys.exit(4)"]


def test_spec_evaluations_in_the_dry_run_and_the_emitted_commands(tmp_path, capsys):
    spec = with_evaluations(write_spec(tmp_path, {"a": arm("vanilla")}, seeds=(7,)), ["attention", "probe"])
    out = tmp_path / "out"
    run_dir = out / "a" / "seed7"
    attention = [sys.executable, "-m", "pretrain.research.analyze", "--run-dir", str(run_dir)]
    probe = [sys.executable, "-m", "pretrain.research.probes", "--run-dir", str(run_dir)]
    assert main(sweep_args(spec, out, "--dry-run")) == 0
    assert capsys.readouterr().out.splitlines() == [
        "spec/a/seed7: pending -> start",
        f"spec/a/seed7 evaluation attention: pending -> after the training, run {shlex.join(attention)}",
        f"spec/a/seed7 evaluation probe: pending -> after the training, run {shlex.join(probe)}"]
    assert main(sweep_args(spec, out, "--emit", "commands")) == 0
    commands = [shlex.split(line) for line in capsys.readouterr().out.splitlines()]
    assert commands[0][:3] == [sys.executable, "-m", ENTRY_MODULE] and commands[1:] == [attention, probe]
    assert not out.exists()
    for argv in sweep_spec.EVALUATIONS.values():  # the modules the sweep runs exist
        assert importlib.util.find_spec(argv[argv.index("-m") + 1]) is not None


@pytest.mark.parametrize("names, message", [
    (["attention", "downstream"], "unknown evaluation 'downstream'"),
    (["probe", "probe"], "each evaluation at most once"),
])
def test_invalid_evaluations_exit_2_naming_the_key(tmp_path, capsys, names, message):
    spec = with_evaluations(write_spec(tmp_path, {"a": arm("ora")}), names)
    assert main(sweep_args(spec, tmp_path / "out", "--dry-run")) == 2
    err = capsys.readouterr().err
    assert "spec.yaml: config error at 'evaluations'" in err and message in err


@pytest.mark.slow
def test_evaluations_of_a_finished_run_are_recorded_and_rerun_without_training(tmp_path, monkeypatch, capsys):
    spec = with_evaluations(write_spec(tmp_path, {"a": arm("ora")}), ["attention", "probe"])
    out = tmp_path / "out"
    run_dir = write_run(out, "a", 1, final_loss=3.0)  # a finished run of this sweep, as a sweep records it
    trained = run_dir.read_experiment()
    monkeypatch.setitem(sweep_spec.EVALUATIONS, "attention", evaluation_writes_its_file("attention"))
    monkeypatch.setitem(sweep_spec.EVALUATIONS, "probe", EVALUATION_FAILS)

    assert main(sweep_args(spec, out)) == 1  # the probe failed
    output = capsys.readouterr().out
    assert "starting 0 of 1 runs and 2 evaluations" in output
    assert "finished spec/a/seed1 evaluation attention" in output
    assert "FAILED spec/a/seed1 evaluation probe: exit code 4" in output
    assert "attention finished, probe failed (4)" in output  # the status table
    record = run_dir.read_experiment()
    assert (record.status, record.start_time, record.results) == ("finished", trained.start_time, trained.results)
    assert record.evaluations["attention"]["status"] == "finished"
    assert (record.evaluations["probe"]["status"], record.evaluations["probe"]["exit_code"]) == ("failed", 4)
    assert "the probe broke" in record.evaluations["probe"]["log_tail"]
    log = (run_dir.path / LOG_NAME).read_text()
    assert log.count("sweep starts:") == 2 and ENTRY_MODULE not in log  # no training started
    assert run_dir.evaluation_file("attention").exists() and not run_dir.evaluation_file("probe").exists()

    assert main(sweep_args(spec, out)) == 1  # a failed evaluation waits for --retry-failed
    assert "nothing to start" in capsys.readouterr().out
    run_dir.evaluation_file("attention").unlink()  # a missing evaluation runs again, the training does not
    monkeypatch.setitem(sweep_spec.EVALUATIONS, "probe", evaluation_writes_its_file("probe"))
    assert main(sweep_args(spec, out, "--dry-run", "--retry-failed")) == 0
    plan = capsys.readouterr().out.splitlines()
    assert plan[0] == "spec/a/seed1: finished -> skip"
    assert plan[2].startswith("spec/a/seed1 evaluation probe: failed -> run ")
    assert main(sweep_args(spec, out, "--retry-failed")) == 0
    record = run_dir.read_experiment()
    assert {name: entry["status"] for name, entry in record.evaluations.items()} == {"attention": "finished",
                                                                                     "probe": "finished"}
    assert ENTRY_MODULE not in (run_dir.path / LOG_NAME).read_text()

    assert main(sweep_args(spec, out, "--task", "0")) == 0  # a SLURM task: nothing left to do
    assert "spec/a/seed1: finished, nothing to do" in capsys.readouterr().out


# Stands in for a training (`... RUN_DIR EXIT_CODE`): exit 0 with a complete summary, or fail.
FAKE_TRAINING = ("import sys; from pretrain.run_files.run_dir import RunDir; "
                 "from pretrain.run_files.run_records import Summary; "
                 "code = int(sys.argv[2]); "
                 "code or RunDir(sys.argv[1]).write_summary(Summary(final_train_loss=3.0, final_valid_loss=3.0, "
                 "final_test_loss=None, wall_time_s=1.0, steps=4, stopped_early=False, preempted=False, "
                 "tokens_seen=0, skipped_steps=0, trainable_params=1, frozen_params=0)); sys.exit(code)")


@pytest.mark.slow
def test_evaluations_follow_a_finished_training_only(tmp_path, monkeypatch, capsys):
    spec = with_evaluations(write_spec(tmp_path, {"good": arm("ora"), "bad": arm("ora")}), ["attention"])
    out = tmp_path / "out"
    monkeypatch.setattr(Run, "local_command", lambda run: [sys.executable, "-c", FAKE_TRAINING, str(run.run_dir.path),
                                                           "3" if run.arm == "bad" else "0"])
    monkeypatch.setitem(sweep_spec.EVALUATIONS, "attention", evaluation_writes_its_file("attention"))
    assert main(sweep_args(spec, out, "--jobs", "2")) == 1  # bad failed
    output = capsys.readouterr().out
    assert "starting 2 of 2 runs and 2 evaluations" in output
    assert output.index("finished spec/good/seed1:") < output.index("finished spec/good/seed1 evaluation attention")
    good, bad = RunDir(out / "good" / "seed1"), RunDir(out / "bad" / "seed1")
    assert good.read_experiment().evaluations["attention"]["status"] == "finished"
    assert good.evaluation_file("attention").exists()
    assert bad.read_experiment().status == "failed" and bad.read_experiment().evaluations == {}
    assert "spec/bad/seed1 evaluation attention: pending -> wait for the training" in (
        main(sweep_args(spec, out, "--dry-run")) == 0 and capsys.readouterr().out)
