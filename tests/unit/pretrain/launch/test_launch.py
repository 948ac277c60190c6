"""launch/: the one entry (launch/pretrain_ora.sh) and the SLURM job around it.

Validation before anything starts and the printed deepspeed command, through the launcher's main in
this process (a few through the script too, for what the script itself does), and runs through the
scripts: one node with two processes; two localhost "nodes" under stand-in SLURM commands, once as
the sbatch job (one launcher per node, no ssh) and once through DeepSpeed's SLURM backend; and the
script as DeepSpeed's own worker (`deepspeed --no_python`).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from distributed import free_port
from pretrain_runs import REPO, env, losses_by_step, write_config
from slurm_stand_ins import one_node_job

from ora_megatron.config_io import ConfigError
from pretrain.launch import launcher
from pretrain.launch.launcher import main
from pretrain.pretrain_ora import adopt_scheduler_ranks
from pretrain.run_files.run_dir import RunDir

LAUNCH = REPO / "launch" / "pretrain_ora.sh"
SBATCH = REPO / "launch" / "slurm" / "pretrain_ora.sbatch"
# A value any shell that reads it would run: it must arrive everywhere exactly as typed.
HOSTILE = """it's "q" $(touch PWNED)"""
# What the scripts read, cleared so that the environment of whoever runs the tests cannot leak in.
LAUNCH_VARIABLES = ("NNODES", "GPUS_PER_NODE", "HOSTFILE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LAUNCHER",
                    "TP", "PP", "ZERO_STAGE", "PRECISION", "DATA_MANIFEST", "RUN_DIR", "DRY_RUN", "DS_ENV_FILE",
                    "NCCL_DEBUG", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "CUDA_VISIBLE_DEVICES", "LOCAL_RANK",
                    "WORLD_SIZE", "RANK")
HINT = "launch/pretrain_ora.sh is a bash script: run it directly"


def launch_env(bin_dir: Path | None = None, **variables: str) -> dict:
    """The test environment without launch variables, plus `variables`; `bin_dir` first on PATH."""
    base = {k: v for k, v in env().items() if k not in LAUNCH_VARIABLES}
    if bin_dir is not None:
        base["PATH"] = f"{bin_dir}:{base['PATH']}"
    return {**base, **variables}


def stand_in(bin_dir: Path, name: str, script: str) -> None:
    """An executable `name` in `bin_dir` running the bash `script`."""
    bin_dir.mkdir(exist_ok=True)
    path = bin_dir / name
    path.write_text("#!/usr/bin/env bash\nset -euo pipefail\n" + script)
    path.chmod(0o755)


def recording_deepspeed(tmp_path: Path) -> tuple[Path, Path]:
    """A stand-in `deepspeed` that only leaves a mark; returns (its directory, the mark)."""
    bin_dir, mark = tmp_path / "bin", tmp_path / "deepspeed-was-started"
    stand_in(bin_dir, "deepspeed", f"touch {shlex.quote(str(mark))}\n")
    return bin_dir, mark


def run_script(argv: list, variables: dict, cwd: Path = REPO, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], cwd=cwd, env=variables, capture_output=True, text=True,
                          timeout=timeout)


def assert_no_shell_read_hostile(*directories: Path) -> None:
    """HOSTILE's `touch PWNED` ran nowhere: not in the repository, here, or under `directories`."""
    assert not (REPO / "PWNED").exists() and not (Path.cwd() / "PWNED").exists()
    for directory in directories:
        assert not list(directory.rglob("PWNED"))


def printed_command(stdout: str) -> list[str]:
    """The command line the script printed (`cd REPO && ... deepspeed ...`), split as a shell would."""
    return shlex.split([line for line in stdout.splitlines() if line.startswith("cd ")][-1])


def contains(tokens: list[str], *expected: str) -> bool:
    return any(tokens[i:i + len(expected)] == list(expected) for i in range(len(tokens)))


# --- validation: each problem is named, status 2, no run dir, no deepspeed -------------------------

def hostfile(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "hostfile"
    path.write_text(text)
    return path


TWO_HOSTS = "a slots=1\nb slots=1\n"
# name: (variables, hostfile text or None, arguments, expected message)
REFUSED = {
    "more nodes than one without a hostfile": ({"NNODES": "2"}, None, [], "NNODES=2 needs HOSTFILE"),
    "malformed hostfile line": ({"NNODES": "2"}, "# nodes\nnode0 slots=1\n\nnode1 slots=one\n", [],
                                "hostfile:4: expected 'host slots=N', got 'node1 slots=one'"),
    "duplicate host": ({"NNODES": "2"}, "node0 slots=1\nnode0 slots=1\n", [],
                       "hostfile:2: host node0 is already listed on line 1"),
    "fewer hosts than nodes": ({"NNODES": "3"}, TWO_HOSTS, [], "NNODES=3 needs at least 3 hosts, the file lists 2"),
    "slots differ from GPUS_PER_NODE": ({"NNODES": "2", "GPUS_PER_NODE": "2"}, "a slots=2\nb slots=4\n", [],
                                        "hostfile:2: host b has slots=4, expected 2 (GPUS_PER_NODE"),
    "OpenMPI uses every host of the file": ({"NNODES": "2", "LAUNCHER": "openmpi", "MASTER_ADDR": "a"},
                                            TWO_HOSTS + "c slots=1\n", [], "NNODES=2 needs exactly 2 hosts"),
    "NODE_RANK without MASTER_ADDR": ({"NNODES": "2", "NODE_RANK": "1"}, TWO_HOSTS, [], "NODE_RANK needs MASTER_ADDR"),
    "a count that is shell syntax": ({"NNODES": "a[$(touch PWNED)]"}, None, [], "NNODES must be an integer"),
    "pdsh would hand an argument to the remote shell": (
        {"NNODES": "2"}, TWO_HOSTS, ["--set", f"logging.wandb_project={HOSTILE}"],
        "LAUNCHER=pdsh runs arguments through the remote shell"),
    # pretrain_ora.py --check-only, for NNODES × GPUS_PER_NODE processes:
    "global batch": ({"GPUS_PER_NODE": "2"}, None, ["--set", "train.global_batch_size=6"], "train.global_batch_size"),
    "TP x PP must divide the world size": ({"GPUS_PER_NODE": "3", "TP": "2"}, None, [],
                                           "not divisible by tensor × pipeline"),
    "ZeRO-3 with PP=2": ({"GPUS_PER_NODE": "2", "PP": "2", "ZERO_STAGE": "3"}, None, [],
                         "deepspeed.zero_stage': DeepSpeed's pipeline engine supports ZeRO-0/1 only"),
}


@pytest.fixture
def in_process(monkeypatch, tmp_path, capsys):
    """launch(args, variables) -> (status, stdout, stderr): launcher.main in this process, as the script
    starts it from tmp_path (ORA_CALLER_DIR), with no launch variables but `variables`. What main
    changes is undone afterwards (the directory; the environment: its NCCL defaults, the config
    check's offline variables); starting deepspeed fails the test."""
    saved = dict(os.environ)
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ORA_CALLER_DIR", str(tmp_path))
    monkeypatch.chdir(tmp_path)

    def start_deepspeed(command, *args):
        raise AssertionError(f"deepspeed was started: {command}")

    monkeypatch.setattr(launcher, "supervise", start_deepspeed)

    def launch(args: list, variables: dict) -> tuple[int, str, str]:
        for name, value in variables.items():
            monkeypatch.setenv(name, value)
        status = main([str(a) for a in args])
        captured = capsys.readouterr()
        return status, captured.out, captured.err

    yield launch
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def script(tmp_path):
    """launch(args, variables) -> (status, stdout, stderr): launch/pretrain_ora.sh run from tmp_path with
    no launch variables but `variables`, and a stand-in deepspeed whose start fails the test."""
    bin_dir, mark = recording_deepspeed(tmp_path)

    def launch(args: list, variables: dict) -> tuple[int, str, str]:
        out = run_script([LAUNCH, *args], launch_env(bin_dir, **variables), cwd=tmp_path)
        assert not mark.exists(), "deepspeed was started"
        return out.returncode, out.stdout, out.stderr

    return launch


def assert_refused(launch, tmp_path: Path, variables: dict, args: list, message: str) -> None:
    """Status 2, `message` on stderr, no run dir (and no deepspeed started: `launch` checks that)."""
    run_dir = tmp_path / "run"
    status, _, stderr = launch([write_config(tmp_path), *args], {"RUN_DIR": str(run_dir), **variables})
    assert status == 2, stderr[-2000:]
    assert message in stderr
    assert not run_dir.exists()
    assert_no_shell_read_hostile(tmp_path)


def refused_case(tmp_path: Path, case: str) -> tuple[dict, list, str]:
    """REFUSED[case] as (variables, arguments, message), its hostfile written to tmp_path."""
    variables, hostfile_text, args, message = REFUSED[case]
    if hostfile_text is not None:
        variables = {**variables, "HOSTFILE": str(hostfile(tmp_path, hostfile_text))}
    return variables, args, message


@pytest.mark.parametrize("case", REFUSED)
def test_launcher_refuses_before_launching(in_process, tmp_path, case):
    assert_refused(in_process, tmp_path, *refused_case(tmp_path, case))


# The script's own part: a variable and an argument that any shell would run reach the launcher as typed.
@pytest.mark.parametrize("case", ["a count that is shell syntax", "pdsh would hand an argument to the remote shell"])
def test_script_refuses_before_launching(script, tmp_path, case):
    assert_refused(script, tmp_path, *refused_case(tmp_path, case))


@pytest.mark.slow
def test_data_manifest_path_reaches_the_config_as_typed(script, tmp_path):
    # A quote, a colon and a space (YAML would read `it's: m.json` as a mapping), relative to where the
    # script was started: the config check opens the manifest and names it, missing.
    assert_refused(script, tmp_path, {"DATA_MANIFEST": "it's: m.json"}, ["--set", "data.mock=false"],
                   f"{tmp_path}/it's: m.json")


# --- DRY_RUN: the resolved command, nothing started -------------------------------------------------

def dry_run(launch, tmp_path: Path, args: list = (), **variables: str) -> tuple[list[str], str]:
    """(the printed command's words, stderr) of a DRY_RUN=1 launch that must start and write nothing."""
    run_dir = tmp_path / "run"
    status, stdout, stderr = launch([write_config(tmp_path), *args],
                                    {"DRY_RUN": "1", "RUN_DIR": str(run_dir), **variables})
    assert status == 0, stderr[-2000:]
    assert not run_dir.exists()
    return printed_command(stdout), stderr


def test_dry_run_pdsh_hostfile_command_and_environment_file(in_process, tmp_path):
    hosts = hostfile(tmp_path, "node0 slots=2  # first\nnode1 slots=2\nspare slots=2\n")
    tokens, stderr = dry_run(in_process, tmp_path, ["--set", "train.micro_batch_size=2"], NNODES="2",
                             HOSTFILE=str(hosts), MASTER_PORT="29511", NCCL_DEBUG="INFO")
    run_dir = tmp_path / "run"
    assert tokens[:3] == ["cd", str(REPO), "&&"]
    assert "NCCL_DEBUG=INFO" in tokens and "TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in tokens
    assert f"DS_ENV_FILE={run_dir / 'deepspeed_env'}" in tokens
    assert contains(tokens, "deepspeed", "--hostfile", str(hosts), "--num_nodes", "2", "--num_gpus", "2",
                    "--master_port", "29511", "--module", "pretrain.pretrain_ora", "--config",
                    str(tmp_path / "run.yaml"), "--run-dir", str(run_dir), "--set", "train.micro_batch_size=2")
    assert "--launcher" not in tokens and "--no_ssh" not in tokens
    assert f"would write {run_dir / 'deepspeed_env'}" in stderr
    assert "\nNCCL_DEBUG=INFO\nTORCH_NCCL_ASYNC_ERROR_HANDLING=1\n" in stderr


def test_dry_run_per_node_command_with_variables_as_overrides(in_process, tmp_path):
    hosts = hostfile(tmp_path, TWO_HOSTS)
    tokens, stderr = dry_run(in_process, tmp_path, NNODES="2", NODE_RANK="1", MASTER_ADDR="10.1.2.3",
                             HOSTFILE=str(hosts), TP="1", PP="1", ZERO_STAGE="1", PRECISION="fp32")
    assert contains(tokens, "--hostfile", str(hosts), "--num_nodes", "2", "--num_gpus", "1", "--no_ssh",
                    "--node_rank", "1", "--master_addr", "10.1.2.3", "--master_port", "29500")
    for override in ("parallel.tensor=1", "parallel.pipeline=1", "deepspeed.zero_stage=1", "deepspeed.precision=fp32"):
        assert contains(tokens, "--set", override)
    assert not any(t.startswith("DS_ENV_FILE=") for t in tokens) and "would write" not in stderr
    assert not any(t.startswith("CUDA_DEVICE_MAX_CONNECTIONS=") for t in tokens)


def test_dry_run_with_tensor_parallelism_orders_the_device_queue(in_process, tmp_path):
    """megatron-core overlaps its TP all-reduce with compute only with one device work queue."""
    tokens, _ = dry_run(in_process, tmp_path, GPUS_PER_NODE="2", TP="2")
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in tokens
    assert contains(tokens, "--set", "parallel.tensor=2")



def test_dry_run_slurm_backend_runs_the_entry_file(in_process, tmp_path):
    """DeepSpeed's SLURM backend runs `python -u SCRIPT` on every node: it has no --module."""
    tokens, _ = dry_run(in_process, tmp_path, NNODES="2", LAUNCHER="slurm", MASTER_ADDR="127.0.0.1",
                        HOSTFILE=str(hostfile(tmp_path, TWO_HOSTS)))
    assert contains(tokens, "--launcher", "slurm", "--no_ssh_check", "pretrain/pretrain_ora.py", "--config")
    assert "--module" not in tokens

# --- runs through the scripts ---------------------------------------------------------------------

@pytest.mark.distributed
def test_one_node_two_processes_pass_arguments_and_paths_literally(tmp_path):
    write_config(tmp_path)
    run_dir_name = f"run {HOSTILE}"
    # Relative config and run dir: resolved from where the script was started (it changes directory).
    out = run_script([LAUNCH, "run.yaml", "--set", f"logging.wandb_project={HOSTILE}", "--set", "train.steps=3"],
                     launch_env(GPUS_PER_NODE="2", RUN_DIR=run_dir_name), cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run_dir = tmp_path / run_dir_name
    assert sorted(losses_by_step(run_dir)) == [1, 2, 3]
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["logging"]["wandb_project"] == HOSTILE
    # The printed command, read back as a shell would, holds the arguments as typed.
    assert contains(printed_command(out.stdout), "deepspeed", "--num_gpus", "2", "--master_port", "29500")
    assert contains(printed_command(out.stdout), "--run-dir", str(run_dir), "--set", f"logging.wandb_project={HOSTILE}")
    assert_no_shell_read_hostile(tmp_path)


# Stand-ins for SLURM's commands. The job's nodes are this machine: srun starts its -n tasks
# (default 2, one per "node") in parallel, with --export=ALL,K=V,... added to their environment.
SCONTROL = """\
[[ "$1 $2 $3" == "show hostnames $SLURM_JOB_NODELIST" ]]
printf 'localhost\\nnode-b\\n'
"""
SINFO = "exit 0\n"
SRUN = """\
tasks=2 exports=()
while [[ $1 == -* ]]; do
  case $1 in
    -n) tasks=$2; shift 2 ;;
    --nodes | --gpus-per-node) shift 2 ;;
    --export=ALL,*) IFS=, read -ra exports <<< "${1#--export=ALL,}"; shift ;;
    *) shift ;;
  esac
done
for ((task = 0; task < tasks; task++)); do
  env "${exports[@]}" SLURM_NODEID=$task SLURM_PROCID=$task SLURM_LOCALID=0 SLURM_NTASKS=$tasks "$@" &
done
worst=0
for pid in $(jobs -p); do
  status=0
  wait "$pid" || status=$?
  worst=$(( status > worst ? status : worst ))
done
exit "$worst"
"""


def slurm_stand_ins(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    for name, script in (("scontrol", SCONTROL), ("sinfo", SINFO), ("srun", SRUN)):
        stand_in(bin_dir, name, script)
    return bin_dir


def assert_matches_one_process(run_dir: Path, reference: Path) -> None:
    losses, expected = losses_by_step(run_dir), losses_by_step(reference)
    assert sorted(losses) == sorted(expected)
    assert all(abs(losses[s] - expected[s]) <= 1e-4 * expected[s] for s in expected)


@pytest.mark.distributed
def test_slurm_job_runs_two_local_nodes_without_ssh_and_matches_one_process(tmp_path, reference):
    """sbatch script under stand-in scontrol/srun: hostfile and MASTER_ADDR from the node list,
    NODE_RANK from each task's SLURM_NODEID, arguments passed through as typed. Node 1's rank is
    killed after step 4: both nodes' supervisors restart their DeepSpeed launchers, the ranks meet
    again and resume from step 3."""
    config, run_dir = write_config(tmp_path), tmp_path / "two nodes"
    variables = launch_env(slurm_stand_ins(tmp_path), SLURM_JOB_NODELIST="ora-test-[0-1]", SLURM_JOB_ID="4242",
                           SLURM_SUBMIT_DIR=str(REPO), GPUS_PER_NODE="1", RUN_DIR=str(run_dir),
                           MASTER_PORT=str(free_port()))
    out = run_script(["bash", SBATCH, config, "--set", f"logging.wandb_project={HOSTILE}",
                      "--set", "supervision.max_restarts=1", "--set", "supervision.restart_backoff_s=5",
                      "--set", "faults=[{kind: kill, step: 4, rank: 1}]"], variables)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (run_dir / "slurm-4242.hostfile").read_text() == "localhost slots=1\nnode-b slots=1\n"
    for rank in (0, 1):
        assert f"--no_ssh --node_rank {rank} --master_addr localhost" in out.stdout
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["logging"]["wandb_project"] == HOSTILE
    restarts = RunDir(run_dir).read_restarts()
    assert sorted((r.node_rank, r.action, r.resumed_from_step) for r in restarts) == [(0, "restart", 3),
                                                                                     (1, "restart", 3)]
    assert_matches_one_process(run_dir, reference)
    assert_no_shell_read_hostile(tmp_path)


@pytest.mark.distributed
def test_deepspeed_slurm_backend_ranks_take_their_ranks_from_srun(tmp_path, reference):
    """LAUNCHER=slurm: DeepSpeed's runner calls srun for all ranks (stand-in, on this machine);
    they get the rank source and rendezvous address through the environment file in the run dir."""
    config, run_dir = write_config(tmp_path), tmp_path / "slurm backend"
    port = str(free_port())
    variables = launch_env(slurm_stand_ins(tmp_path), NNODES="2", LAUNCHER="slurm", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=port, HOSTFILE=str(hostfile(tmp_path, "localhost slots=1\nnode-b slots=1\n")),
                           RUN_DIR=str(run_dir))
    out = run_script([LAUNCH, config], variables)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert contains(printed_command(out.stdout), "--launcher", "slurm", "--no_ssh_check")
    forwarded = (run_dir / "deepspeed_env").read_text()
    assert f"\nORA_RANKS_FROM=slurm\nMASTER_ADDR=127.0.0.1\nMASTER_PORT={port}\n" in forwarded
    assert_matches_one_process(run_dir, reference)


@pytest.mark.distributed
def test_deepspeed_no_python_runs_the_script_as_its_worker(tmp_path):
    config, run_dir = write_config(tmp_path), tmp_path / "worker"
    out = run_script(["deepspeed", "--no_python", "--num_gpus", "1", "launch/pretrain_ora.sh", config,
                      "--set", "train.steps=3", "--set", "deepspeed.zero_with_one_rank=true"],
                     launch_env(RUN_DIR=str(run_dir), ZERO_STAGE="1"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert sorted(losses_by_step(run_dir)) == [1, 2, 3]
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["deepspeed"]["zero_stage"] == 1


@pytest.mark.distributed
def test_deepspeed_without_no_python_prints_what_to_type(tmp_path):
    out = run_script(["deepspeed", "--num_gpus", "1", "launch/pretrain_ora.sh", "tiny"], launch_env())
    assert out.returncode != 0
    hint_lines = [line for line in (out.stdout + out.stderr).splitlines() if HINT in line]
    assert len(hint_lines) == 1 and "deepspeed --no_python" in hint_lines[0]


def test_script_read_by_python_gives_the_hint_without_warnings():
    # -W error: an invalid escape in the bash part would be a SyntaxWarning (Python 3.12+) before the hint.
    out = subprocess.run([sys.executable, "-W", "error", str(LAUNCH), "--local_rank=0", "tiny"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and out.stderr.strip().startswith(HINT) and "\n" not in out.stderr.strip()


def test_launch_scripts_are_shellcheck_clean():
    scripts = sorted(p for p in (REPO / "launch").rglob("*") if p.suffix in (".sh", ".sbatch"))
    assert LAUNCH in scripts and SBATCH in scripts
    shellcheck = Path(sys.executable).with_name("shellcheck")
    out = subprocess.run([shellcheck, "-S", "warning", *scripts], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout


def test_ranks_from_the_scheduler_that_started_them():
    """DeepSpeed's OpenMPI/SLURM backends start ranks without the torch variables; ORA_RANKS_FROM maps them."""
    slurm = {"ORA_RANKS_FROM": "slurm", "SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"}
    adopt_scheduler_ranks(slurm)
    assert (slurm["RANK"], slurm["WORLD_SIZE"], slurm["LOCAL_RANK"]) == ("3", "8", "1")
    launched = {"ORA_RANKS_FROM": "openmpi", "WORLD_SIZE": "2", "OMPI_COMM_WORLD_SIZE": "9"}
    adopt_scheduler_ranks(launched)
    assert launched["WORLD_SIZE"] == "2" and "RANK" not in launched
    with pytest.raises(ConfigError, match="OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_LOCAL_RANK"):
        adopt_scheduler_ranks({"ORA_RANKS_FROM": "openmpi", "OMPI_COMM_WORLD_SIZE": "2"})


def test_only_run_configs_are_offered_as_presets(in_process):
    """What the presets inherit (configs/shared/) is not a preset: the launcher neither offers nor takes it."""
    status, _, stderr = in_process(["paper_common"], {})
    assert status == 2
    assert "'paper_common' is neither a preset (base large small tiny) nor a YAML file" in stderr


@pytest.mark.slow
def test_the_job_requeues_itself_after_a_stop_at_max_wall_time_and_not_after_an_end(tmp_path):
    """Status 75 (stopped with a checkpoint at supervision.max_wall_time) requeues without a signal; a finished
    run (0) or a failure that ended the job does not. (The time-limit signal: tests/integration/test_unattended.py.)"""
    outcomes = {}
    for status in (75, 0, 1):
        requeued = tmp_path / f"requeued{status}"
        job = one_node_job(tmp_path, f"exit {status}\n")
        out = run_script(["bash", SBATCH, "tiny"], {**os.environ, **job, "RUN_DIR": str(tmp_path / "run"),
                                                  "REQUEUED": str(requeued)}, timeout=60)
        outcomes[status] = (out.returncode, requeued.read_text() if requeued.exists() else None)
    assert outcomes == {75: (0, "requeue 4242\n"), 0: (0, None), 1: (1, None)}
