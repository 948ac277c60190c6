"""The launch entry behind launch/pretrain_ora.sh: launch variables → checks → DeepSpeed's launcher.

    launch/pretrain_ora.sh PRESET|CONFIG [--set key=value ...]     (python -m pretrain.launch.launcher ...)

PRESET names a file in pretrain/configs/ (tiny, small, base, large); anything else is a YAML path.
Further arguments go to the training entry (pretrain.pretrain_ora) unchanged; relative paths in
them are relative to the repository root. Environment:

    NNODES         nodes (default 1); more than one needs HOSTFILE
    GPUS_PER_NODE  processes per node (default: the hostfile's slots, else this node's GPUs, else 1)
    HOSTFILE       DeepSpeed hostfile, one "host slots=N" line per node (launch/hostfile.example)
    MASTER_ADDR    node 0's address        MASTER_PORT  its port (default 29500)
    NODE_RANK      this node's rank: run the script on every node, DeepSpeed's --no_ssh mode
    LAUNCHER       how DeepSpeed reaches the hosts of HOSTFILE: pdsh (default), openmpi, slurm
    TP, PP, ZERO_STAGE, PRECISION, DATA_MANIFEST
                   --set parallel.tensor, parallel.pipeline, deepspeed.zero_stage,
                   deepspeed.precision, data.manifest
    RUN_DIR        --run-dir               DRY_RUN=1    validate, print the command, start nothing

Before anything starts, the variables, the hostfile and the config (for NNODES × GPUS_PER_NODE
processes) are checked; a problem ends the launch with status 2 and a message naming it. The
deepspeed command is printed on stdout, quoted so that it can be pasted, then exec'd. Relative
paths in CONFIG, RUN_DIR, HOSTFILE and DATA_MANIFEST are relative to where the user ran the
script (ORA_CALLER_DIR, set by the script; else the current directory).

The launch then supervises DeepSpeed's launcher (pretrain/launch/supervisor.py), on every node that runs
this script: when a rank fails (a crash, a kill, a hang its watchdog reports, a collective timeout),
the node's processes are killed and DeepSpeed's launcher starts again, resuming from the latest intact
checkpoint, as supervision.max_restarts allows; SIGTERM, SIGINT or SIGUSR1 make the workers save and stop.
In NODE_RANK mode each node restarts its own ranks; a failed rank makes the others fail (a collective
error, or their watchdogs), so every node restarts, and the ranks meet again at MASTER_ADDR.

Started by DeepSpeed's launcher as its worker (`deepspeed --no_python [options]
launch/pretrain_ora.sh PRESET ...`: LOCAL_RANK and WORLD_SIZE are set), it runs the training
entry itself with the same arguments.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

from ora_megatron.config_io import ConfigError
from pretrain.job.environment import device_environment
from pretrain.job.supervision import ATTEMPT_VARIABLE, JOB_START_VARIABLE, SUPERVISOR_VARIABLE
from pretrain.launch.hostfile import HostfileError, parse_hostfile, slots_per_node
from pretrain.launch.start import Start, check_start, launched_worker, parse_args
from pretrain.launch.supervisor import Attempt, supervise
from pretrain.paths import ENTRY_MODULE, REPO, preset_names, preset_path
from pretrain.run_files.run_dir import RunDir

ENTRY = ["--module", ENTRY_MODULE]  # run from the repository root
# DeepSpeed's SLURM backend runs `python -u SCRIPT` and has no --module (multinode_runner.py,
# SlurmRunner): it gets the entry's file, which puts the repository first on sys.path itself.
ENTRY_FILE = ["pretrain/pretrain_ora.py"]
USAGE = "usage: launch/pretrain_ora.sh PRESET|CONFIG [--set key=value ...] (see the top of the script)"

# --set overrides that stand in for an environment variable.
SET_BY_VARIABLE = {"TP": "parallel.tensor", "PP": "parallel.pipeline", "ZERO_STAGE": "deepspeed.zero_stage",
                   "PRECISION": "deepspeed.precision"}
# Variables the other nodes' ranks get through DeepSpeed's environment file: PATH so that they run
# the same tools (DeepSpeed already assumes the same paths on every node: it starts its own Python
# there), the NCCL settings below, and the thread count.
FORWARDED = ("PATH", "NCCL_DEBUG", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS", JOB_START_VARIABLE)
LAUNCHERS = ("pdsh", "openmpi", "slurm")
# pdsh hands DeepSpeed's command to the remote shell, and DeepSpeed only wraps arguments that
# contain a space in double quotes (multinode_runner.py, PDSHRunner): anything else that shell
# would read is refused rather than run there.
PDSH_PLAIN = re.compile(r"[-A-Za-z0-9_@%+=:,./]*")
PDSH_SPACED = re.compile(r"[-A-Za-z0-9_@%+=:,./ ]*")
# pdsh puts a forwarded value in double quotes in a remote shell command line.
UNSAFE_TO_FORWARD = re.compile(r'[\n$`"\\]')
# DeepSpeed's OpenMPI and SLURM backends start every rank themselves (mpirun, srun) and leave the
# torch variables to deepspeed.init_distributed's MPI discovery, which the training entry does not use;
# the environment file names the scheduler in ORA_RANKS_FROM (with MASTER_ADDR and MASTER_PORT).
SCHEDULER_RANK_VARIABLES = {
    "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    "slurm": ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
}


class LaunchError(Exception):
    """A launch that must not start; the message names the variable, file or key."""


@dataclass(frozen=True)
class Cluster:
    """The nodes and processes the launch variables ask for, checked."""

    nnodes: int
    gpus_per_node: int
    master_port: int
    launcher: str  # how DeepSpeed reaches HOSTFILE's nodes
    launcher_named: bool  # LAUNCHER was set (passed on to DeepSpeed)
    hostfile: Optional[Path]
    node_rank: Optional[int]
    master_addr: Optional[str]

    @property
    def world_size(self) -> int:
        return self.nnodes * self.gpus_per_node

    @property
    def starts_other_nodes(self) -> bool:
        """DeepSpeed starts the other nodes itself (pdsh, mpirun or srun)."""
        return self.hostfile is not None and self.node_rank is None and self.nnodes > 1


class Environment:
    """The launch variables as the user set them; an empty value counts as unset, as in a shell."""

    def __init__(self, environ: Mapping[str, str], caller_dir: Path):
        self.environ, self.caller_dir = environ, caller_dir

    def get(self, name: str) -> Optional[str]:
        return self.environ.get(name) or None

    def path(self, name: str) -> Optional[Path]:
        """A path variable as the user meant it: relative to where they ran the script."""
        value = self.get(name)
        return None if value is None else self.absolute(value)

    def absolute(self, value: str) -> Path:
        return Path(value) if value.startswith("/") else self.caller_dir / value

    def count(self, name: str, default: Optional[int], minimum: int) -> Optional[int]:
        """A decimal integer ≥ minimum (08 is eight, not octal)."""
        value = self.get(name)
        if value is None:
            return default
        if not re.fullmatch(r"[0-9]+", value) or int(value) < minimum:
            raise LaunchError(f"{name} must be an integer >= {minimum}, got '{value}'")
        return int(value)


# ------------------------------------------------------------------ checks
def config_path(name: str, env: Environment) -> str:
    """A preset's file (relative to the repository root, where the printed command runs), or the
    YAML file the user named."""
    preset = preset_path(name)
    if preset is not None:
        return str(preset.relative_to(REPO))
    if env.absolute(name).is_file():
        return str(env.absolute(name))
    raise LaunchError(f"'{name}' is neither a preset ({' '.join(preset_names())}) nor a YAML file")


def read_cluster(env: Environment) -> Cluster:
    nnodes = env.count("NNODES", 1, 1)
    master_port = env.count("MASTER_PORT", 29500, 1)
    launcher = env.get("LAUNCHER") or "pdsh"
    if launcher not in LAUNCHERS:
        raise LaunchError(f"LAUNCHER must be pdsh, openmpi or slurm, got '{launcher}'")
    hostfile, master_addr = env.path("HOSTFILE"), env.get("MASTER_ADDR")
    if nnodes > 1 and hostfile is None:
        raise LaunchError(f"NNODES={nnodes} needs HOSTFILE: one 'host slots=N' line per node (launch/hostfile.example)")
    node_rank = env.count("NODE_RANK", None, 0)
    if node_rank is not None:
        if node_rank >= nnodes:
            raise LaunchError(f"NODE_RANK={node_rank} must be below NNODES={nnodes}")
        if master_addr is None:
            raise LaunchError("NODE_RANK needs MASTER_ADDR: node 0's address, the same on every node")
    launcher_named = env.get("LAUNCHER") is not None
    if launcher_named and hostfile is None:
        raise LaunchError("LAUNCHER chooses how DeepSpeed reaches the hosts of HOSTFILE, and HOSTFILE is not set")
    if launcher_named and node_rank is not None:
        raise LaunchError("LAUNCHER chooses how DeepSpeed starts the other nodes; with NODE_RANK you start each node")
    if launcher != "pdsh" and master_addr is None:
        raise LaunchError(f"LAUNCHER={launcher} needs MASTER_ADDR: the first host's address (rank 0 runs there)")
    requested = env.count("GPUS_PER_NODE", None, 1)
    return Cluster(nnodes, processes_per_node(env, hostfile, nnodes, requested, launcher), master_port, launcher,
                    launcher_named, hostfile, node_rank, master_addr)


def processes_per_node(env: Environment, hostfile: Optional[Path], nnodes: int, requested: Optional[int],
                       launcher: str) -> int:
    """GPUS_PER_NODE (checked against the hostfile), else the hostfile's slots, else this node's GPUs."""
    if hostfile is not None:
        try:
            # DeepSpeed's OpenMPI backend refuses --num_nodes/--num_gpus: it runs on every host of the file.
            return slots_per_node(parse_hostfile(hostfile), hostfile, nnodes, requested, launcher == "openmpi")
        except HostfileError as e:
            raise LaunchError(str(e)) from e
    return requested if requested is not None else local_device_count(env)


def visible_devices(env: Environment) -> list[str]:
    """CUDA_VISIBLE_DEVICES' entries (a trailing comma adds none)."""
    devices = (env.get("CUDA_VISIBLE_DEVICES") or "").split(",")
    while devices and not devices[-1]:
        devices.pop()
    return devices


def local_device_count(env: Environment) -> int:
    count = len(visible_devices(env))
    if env.get("CUDA_VISIBLE_DEVICES") is None and shutil.which("nvidia-smi"):
        listed = subprocess.run(["nvidia-smi", "--list-gpus"], capture_output=True, text=True).stdout
        count = sum(line.startswith("GPU ") for line in listed.splitlines())
    return max(count, 1)


def refuse_shell_syntax_for_pdsh(entry_args: list[str], env: Environment) -> None:
    if not PDSH_PLAIN.fullmatch(str(REPO)):
        raise LaunchError(f"LAUNCHER=pdsh: the repository path '{REPO}' has characters the remote shell would read")
    master_addr = env.get("MASTER_ADDR") or ""
    if not PDSH_PLAIN.fullmatch(master_addr):
        raise LaunchError(f"LAUNCHER=pdsh: MASTER_ADDR '{master_addr}' has characters the remote shell would read")
    for arg in entry_args:
        if not PDSH_SPACED.fullmatch(arg):
            raise LaunchError(f"LAUNCHER=pdsh runs arguments through the remote shell and '{arg}' has characters it "
                              "would read: move the value into the YAML config, or use NODE_RANK")


# ------------------------------------------------------------------ the command
def entry_arguments(config: str, run_dir: Optional[Path], args: list[str], env: Environment) -> list[str]:
    """The training entry's arguments: config, run dir (when known), the variables, the user's."""
    entry = ["--config", config]
    if run_dir is not None:
        entry += ["--run-dir", str(run_dir)]
    for variable, key in SET_BY_VARIABLE.items():
        if env.get(variable) is not None:
            entry += ["--set", f"{key}={env.get(variable)}"]
    manifest = env.path("DATA_MANIFEST")
    if manifest is not None:
        # --set values are YAML: a single-quoted scalar keeps the path literal.
        quoted = str(manifest).replace("'", "''")
        entry += ["--set", f"data.manifest='{quoted}'"]
    return entry + args


def deepspeed_command(cluster: Cluster, entry_args: list[str], env: Environment) -> list[str]:
    command = ["deepspeed"]
    if cluster.hostfile is not None:
        command += ["--hostfile", str(cluster.hostfile)]
        if cluster.launcher != "openmpi":
            command += ["--num_nodes", str(cluster.nnodes), "--num_gpus", str(cluster.gpus_per_node)]
    elif env.get("CUDA_VISIBLE_DEVICES") is not None:
        # DeepSpeed ignores CUDA_VISIBLE_DEVICES when given --num_gpus and uses devices 0..N-1.
        visible = visible_devices(env)
        if cluster.gpus_per_node > len(visible):
            raise LaunchError(f"GPUS_PER_NODE={cluster.gpus_per_node} but CUDA_VISIBLE_DEVICES lists "
                              f"{len(visible)} devices")
        command += ["--include", "localhost:" + ",".join(visible[:cluster.gpus_per_node])]
    else:
        command += ["--num_gpus", str(cluster.gpus_per_node)]
    if cluster.node_rank is not None:
        command += ["--no_ssh", "--node_rank", str(cluster.node_rank)]
    if cluster.master_addr is not None:
        command += ["--master_addr", cluster.master_addr]
    command += ["--master_port", str(cluster.master_port)]
    if cluster.launcher_named:
        command += ["--launcher", cluster.launcher]
    if cluster.launcher == "slurm":
        # srun reaches the nodes through SLURM; DeepSpeed's ssh check of the first host would only
        # fail where a cluster allows no ssh between nodes.
        command.append("--no_ssh_check")
    return command + [*(ENTRY_FILE if cluster.launcher == "slurm" else ENTRY), *entry_args]


def environment_file_lines(cluster: Cluster, env: Environment) -> list[str]:
    """What DeepSpeed forwards to the other nodes besides NCCL*, PYTHON*, UCX*, MV2* and MLFLOW*
    (runner.py, EXPORT_ENVS): the lines of its environment file, read from ~ and . under the name
    DS_ENV_FILE (default .deepspeed_env). An absolute DS_ENV_FILE is read from where it is (the
    name is os.path.join-ed to both), so ours lives in the run dir; the user's own files follow it,
    and later lines win, as in DeepSpeed."""
    assignments = [f"{name}={env.get(name)}" for name in FORWARDED if env.get(name) is not None]
    if cluster.launcher != "pdsh":
        # mpirun and srun start the ranks without DeepSpeed's per-node launcher, which would set the
        # torch variables: the training entry takes the ranks from the scheduler, the address from here.
        assignments += [f"ORA_RANKS_FROM={cluster.launcher}", f"MASTER_ADDR={cluster.master_addr}",
                        f"MASTER_PORT={cluster.master_port}"]
    for assignment in assignments:
        if UNSAFE_TO_FORWARD.search(assignment):
            raise LaunchError(f"cannot forward {assignment.split('=', 1)[0]} to the other nodes: its value has a "
                              "newline, a double quote, a dollar sign, a backquote or a backslash")
    name = env.get("DS_ENV_FILE") or ".deepspeed_env"
    user_files = [Path(name)] if name.startswith("/") else [Path.home() / name, REPO / name]
    for file in user_files:
        if file.is_file():  # DeepSpeed splits every line at '=', so a blank line would stop it
            assignments += [line for line in file.read_text().splitlines() if line.strip()]
    return assignments


def printed_command(command: list[str], variables: dict[str, str]) -> str:
    """One line a user can paste: the directory, the variables set here, the command."""
    assignments = " ".join(f"{name}={shlex.quote(value)}" for name, value in variables.items())
    return f"cd {shlex.quote(str(REPO))} && {assignments} {shlex.join(command)}"


def set_nccl_defaults(environ: dict) -> None:
    """Kept when already set. NCCL_DEBUG=WARN: NCCL says why a collective failed, without INFO's
    flood. TORCH_NCCL_ASYNC_ERROR_HANDLING=1: a failed or timed-out collective aborts the
    communicators and ends the process, so the launcher stops the other ranks; torchrun gives its
    workers 1, DeepSpeed's launcher leaves torch's default (3: end without aborting them)."""
    environ["NCCL_DEBUG"] = environ.get("NCCL_DEBUG") or "WARN"
    environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING") or "1"


# ------------------------------------------------------------------ the two roles
def split_config_argument(args: list[str], env: Environment) -> tuple[str, list[str]]:
    if not args or args[0].startswith("-"):
        raise LaunchError(USAGE)
    return config_path(args[0], env), args[1:]


def run_worker(args: list[str], env: Environment) -> int:
    """As DeepSpeed's worker (deepspeed --no_python ... launch/pretrain_ora.sh ...): train."""
    if args and args[0].startswith("--local_rank="):
        args = args[1:]
    config, rest = split_config_argument(args, env)
    return launched_worker(parse_args(entry_arguments(config, env.path("RUN_DIR"), rest, env)))


def adopt_scheduler_ranks(environ=os.environ) -> None:
    """In a rank: RANK, WORLD_SIZE, LOCAL_RANK from the scheduler ORA_RANKS_FROM names, unless already set."""
    scheduler = environ.get("ORA_RANKS_FROM")
    if scheduler is None or "WORLD_SIZE" in environ:
        return
    if scheduler not in SCHEDULER_RANK_VARIABLES:
        raise ConfigError("ORA_RANKS_FROM", f"expected one of {list(SCHEDULER_RANK_VARIABLES)}, got {scheduler!r}")
    names = SCHEDULER_RANK_VARIABLES[scheduler]
    missing = [name for name in names if name not in environ]
    if missing:
        raise ConfigError("ORA_RANKS_FROM", f"{scheduler} ranks need {', '.join(missing)} in the environment")
    rank, size, local_rank = (environ[name] for name in names)
    environ.update(RANK=rank, WORLD_SIZE=size, LOCAL_RANK=local_rank)


def launch(args: list[str], env: Environment) -> int:
    """Check everything, print the deepspeed command, exec it (DRY_RUN: print only)."""
    config, rest = split_config_argument(args, env)
    cluster = read_cluster(env)
    entry_args = entry_arguments(config, env.path("RUN_DIR"), rest, env)
    if cluster.starts_other_nodes and cluster.launcher == "pdsh":
        refuse_shell_syntax_for_pdsh(entry_args, env)
    try:  # the training entry's own check for this many processes (config, data, resume, the run dir's lock)
        start = check_start(entry_args, cluster.world_size)
    except ValueError as e:
        raise LaunchError(str(e)) from e
    run_dir = start.run_dir
    entry_args = entry_arguments(config, run_dir, rest, env)
    variables = {name: env.environ[name] for name in ("NCCL_DEBUG", "TORCH_NCCL_ASYNC_ERROR_HANDLING")}
    variables.update(device_environment(start.cfg.parallel))
    env_file = environment = None
    if cluster.starts_other_nodes:
        env_file, environment = run_dir / "deepspeed_env", environment_file_lines(cluster, env)
        variables["DS_ENV_FILE"] = str(env_file)
    command = deepspeed_command(cluster, entry_args, env)
    if (env.get("DRY_RUN") or "0") != "0":
        if env_file is not None:
            print(f"would write {env_file}:\n" + "\n".join(environment), file=sys.stderr)
        print(printed_command(command, variables))
        return 0
    if shutil.which("deepspeed") is None:
        raise LaunchError("deepspeed is not on PATH (activate the virtualenv: . .venv/bin/activate)")
    if env_file is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        env_file.write_text("\n".join(environment) + "\n")
    print(printed_command(command, variables), flush=True)
    return supervise_deepspeed(command, {**env.environ, **variables}, start, cluster)


def supervise_deepspeed(command: list[str], environment: dict[str, str], start: Start, cluster: Cluster) -> int:
    """Run DeepSpeed's launcher until the run ends, restarting it after a failure (supervision.max_restarts)."""

    def launch(attempt: int) -> Attempt:
        supervised = {name: os.environ[name] for name in (ATTEMPT_VARIABLE, JOB_START_VARIABLE, SUPERVISOR_VARIABLE)}
        process = subprocess.Popen(command, env={**environment, **supervised})
        return Attempt(process.wait())

    return supervise(RunDir(start.run_dir), start.cfg.supervision, launch, node_rank=cluster.node_rank)


def main(argv: Optional[list[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    environ = os.environ
    # For the workers of every node (supervision.max_wall_time).
    environ.setdefault(JOB_START_VARIABLE, repr(time.time()))
    env = Environment(environ, Path(environ.get("ORA_CALLER_DIR") or os.getcwd()))
    os.chdir(REPO)
    set_nccl_defaults(environ)
    try:
        # DeepSpeed's launcher (and torchrun) give every worker both.
        if env.get("LOCAL_RANK") is not None and env.get("WORLD_SIZE") is not None:
            return run_worker(args, env)
        return launch(args, env)
    except LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
