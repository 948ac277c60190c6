#!/usr/bin/env bash
""":"
# Pretrain through DeepSpeed's launcher: one node, the nodes of a hostfile, or one call per node.
#
#   launch/pretrain_ora.sh PRESET|CONFIG [--set key=value ...]
#
# PRESET names a file in pretrain/configs/ (tiny, small, base, large); anything else is a YAML
# path. Further arguments go to pretrain/pretrain_ora.py unchanged (relative paths in them are
# relative to the repository root). Environment:
#   NNODES         nodes (default 1); more than one needs HOSTFILE
#   GPUS_PER_NODE  processes per node (default: the hostfile's slots, else this node's GPUs, else 1)
#   HOSTFILE       DeepSpeed hostfile, one "host slots=N" line per node (launch/hostfile.example)
#   MASTER_ADDR    node 0's address        MASTER_PORT  its port (default 29500)
#   NODE_RANK      this node's rank: run the script on every node, DeepSpeed's --no_ssh mode
#   LAUNCHER       how DeepSpeed reaches the hosts of HOSTFILE: pdsh (default), openmpi, slurm
#   TP, PP, ZERO_STAGE, PRECISION, DATA_MANIFEST
#                  --set parallel.tensor, parallel.pipeline, deepspeed.zero_stage,
#                  deepspeed.precision, data.manifest
#   RUN_DIR        --run-dir               DRY_RUN=1    validate, print the command, start nothing
# Before anything starts, the variables, the hostfile and the config (for NNODES × GPUS_PER_NODE
# processes) are checked; a problem ends the script with status 2 and a message naming it. The
# deepspeed command is printed on stdout, quoted so that it can be pasted.
#
# Started by DeepSpeed's launcher as its worker (deepspeed --no_python [options]
# launch/pretrain_ora.sh PRESET ...), it runs pretrain/pretrain_ora.py itself. This file is also
# Python: the line above opens a string that closes on the last line, so that deepspeed without
# --no_python, which runs the script with python, prints what to type.

set -euo pipefail

# --set overrides that stand in for an environment variable.
readonly SET_BY_VARIABLE=(TP=parallel.tensor PP=parallel.pipeline ZERO_STAGE=deepspeed.zero_stage
                          PRECISION=deepspeed.precision)
# Variables the other nodes' ranks get through DeepSpeed's environment file: PATH so that they run
# the same tools (DeepSpeed already assumes the same paths on every node: it starts its own Python
# there), the NCCL settings below, and the thread count.
readonly FORWARDED=(PATH NCCL_DEBUG TORCH_NCCL_ASYNC_ERROR_HANDLING OMP_NUM_THREADS)

die() {
  printf 'error: %s\n' "$*" >&2
  exit 2
}

usage() {
  die "usage: launch/pretrain_ora.sh PRESET|CONFIG [--set key=value ...] (see the top of the script)"
}

# A path as the user meant it: relative to where they ran the script (which changes directory).
absolute() {
  if [[ $1 == /* ]]; then printf '%s' "$1"; else printf '%s/%s' "$caller_dir" "$1"; fi
}

# VALUE as a decimal integer, checked before bash arithmetic sees it: arithmetic would evaluate
# a value such as a[$(cmd)], and read 08 as octal.
count() {  # NAME VALUE MINIMUM
  if ! [[ $2 =~ ^[0-9]+$ ]] || (( 10#$2 < $3 )); then
    die "$1 must be an integer >= $3, got '$2'"
  fi
  echo $(( 10#$2 ))
}

config_path() {
  if [[ $1 != */* && -f pretrain/configs/$1.yaml ]]; then
    printf 'pretrain/configs/%s.yaml' "$1"
  elif [[ -f $(absolute "$1") ]]; then
    absolute "$1"
  else
    local presets=(pretrain/configs/*.yaml)
    presets=("${presets[@]##*/}")
    die "'$1' is neither a preset (${presets[*]%.yaml}) nor a YAML file"
  fi
}

# NCCL defaults, kept when already set. NCCL_DEBUG=WARN: NCCL says why a collective failed,
# without INFO's flood. TORCH_NCCL_ASYNC_ERROR_HANDLING=1: a failed or timed-out collective aborts
# the communicators and ends the process, so the launcher stops the other ranks; torchrun gives
# its workers 1, DeepSpeed's launcher leaves torch's default (3: end without aborting them).
set_nccl_defaults() {
  export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
  export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
}

# pretrain/pretrain_ora.py's arguments: config, run dir (when known), the variables, the user's.
entry_arguments() {
  local pair variable
  entry_args=(--config "$config")
  if [[ -n $run_dir ]]; then entry_args+=(--run-dir "$run_dir"); fi
  for pair in "${SET_BY_VARIABLE[@]}"; do
    variable=${pair%%=*}
    if [[ -n ${!variable:-} ]]; then entry_args+=(--set "${pair#*=}=${!variable}"); fi
  done
  if [[ -n ${DATA_MANIFEST:-} ]]; then
    # --set values are YAML: a single-quoted scalar keeps the path literal.
    local quote="'" manifest
    manifest=$(absolute "$DATA_MANIFEST")
    entry_args+=(--set "data.manifest='${manifest//$quote/$quote$quote}'")
  fi
  entry_args+=("$@")
}

# Under DeepSpeed's launcher (deepspeed --no_python ... launch/pretrain_ora.sh ...): be its worker.
run_worker() {
  if [[ ${1:-} == --local_rank=* ]]; then shift; fi
  if (( $# == 0 )) || [[ $1 == -* ]]; then usage; fi
  config=$(config_path "$1") || exit
  shift
  run_dir=
  if [[ -n ${RUN_DIR:-} ]]; then run_dir=$(absolute "$RUN_DIR"); fi
  entry_arguments "$@"
  exec python pretrain/pretrain_ora.py "${entry_args[@]}"
}

read_topology() {
  nnodes=$(count NNODES "${NNODES:-1}" 1) || exit
  master_port=$(count MASTER_PORT "${MASTER_PORT:-29500}" 1) || exit
  launcher=${LAUNCHER:-pdsh}
  case $launcher in
    pdsh | openmpi | slurm) ;;
    *) die "LAUNCHER must be pdsh, openmpi or slurm, got '$launcher'" ;;
  esac
  hostfile=
  if [[ -n ${HOSTFILE:-} ]]; then hostfile=$(absolute "$HOSTFILE"); fi
  if (( nnodes > 1 )) && [[ -z $hostfile ]]; then
    die "NNODES=$nnodes needs HOSTFILE: one 'host slots=N' line per node (launch/hostfile.example)"
  fi
  node_rank=
  if [[ -n ${NODE_RANK:-} ]]; then
    node_rank=$(count NODE_RANK "$NODE_RANK" 0) || exit
    (( node_rank < nnodes )) || die "NODE_RANK=$node_rank must be below NNODES=$nnodes"
    [[ -n ${MASTER_ADDR:-} ]] || die "NODE_RANK needs MASTER_ADDR: node 0's address, the same on every node"
  fi
  if [[ -n ${LAUNCHER:-} && -z $hostfile ]]; then
    die "LAUNCHER chooses how DeepSpeed reaches the hosts of HOSTFILE, and HOSTFILE is not set"
  fi
  if [[ -n ${LAUNCHER:-} && -n $node_rank ]]; then
    die "LAUNCHER chooses how DeepSpeed starts the other nodes; with NODE_RANK you start each node"
  fi
  if [[ $launcher != pdsh && -z ${MASTER_ADDR:-} ]]; then
    die "LAUNCHER=$launcher needs MASTER_ADDR: the first host's address (rank 0 runs there)"
  fi
  requested_gpus=
  if [[ -n ${GPUS_PER_NODE:-} ]]; then requested_gpus=$(count GPUS_PER_NODE "$GPUS_PER_NODE" 1) || exit; fi
  gpus_per_node=$(processes_per_node) || exit
}

# GPUS_PER_NODE (checked against the hostfile), else the hostfile's slots, else this node's GPUs.
processes_per_node() {
  if [[ -n $hostfile ]]; then
    local check=(python -m pretrain.hostfile "$hostfile" --nodes "$nnodes")
    if [[ -n $requested_gpus ]]; then check+=(--slots "$requested_gpus"); fi
    # DeepSpeed's OpenMPI backend refuses --num_nodes/--num_gpus: it runs on every host of the file.
    if [[ $launcher == openmpi ]]; then check+=(--exact-nodes); fi
    "${check[@]}"
  elif [[ -n $requested_gpus ]]; then
    echo "$requested_gpus"
  else
    local_device_count
  fi
}

local_device_count() {
  local count=0
  if [[ -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
    local visible
    IFS=, read -ra visible <<< "$CUDA_VISIBLE_DEVICES"
    count=${#visible[@]}
  elif command -v nvidia-smi > /dev/null; then
    count=$(nvidia-smi --list-gpus 2> /dev/null | grep -c '^GPU ' || true)
  fi
  echo $(( count > 0 ? count : 1 ))
}

# The config for this many processes (TP × PP, batch, ZeRO with PP, data, resume): status 2 and the
# key on a problem; prints the run dir. WORLD_SIZE in the environment would stand for --world-size.
check_config() {
  local output
  output=$(env -u WORLD_SIZE python pretrain/pretrain_ora.py --check-only --world-size "$1" --print-run-dir \
    "${entry_args[@]}") || exit
  # The last line: DeepSpeed's logger writes to stdout too (e.g. which accelerator it picked).
  printf '%s' "${output##*$'\n'}"
}

multi_node_exec() {  # DeepSpeed starts the other nodes itself (pdsh, mpirun or srun)
  [[ -n $hostfile && -z $node_rank ]] && (( nnodes > 1 ))
}

# pdsh hands DeepSpeed's command to the remote shell, and DeepSpeed only wraps arguments that
# contain a space in double quotes (multinode_runner.py, PDSHRunner): refuse anything else that
# shell would read, rather than run it there.
refuse_shell_syntax_for_pdsh() {
  local plain='^[-A-Za-z0-9_@%+=:,./]*$' spaced='^[-A-Za-z0-9_@%+=:,./ ]*$' arg
  [[ $PWD =~ $plain ]] || die "LAUNCHER=pdsh: the repository path '$PWD' has characters the remote shell would read"
  [[ ${MASTER_ADDR:-} =~ $plain ]] || die "LAUNCHER=pdsh: MASTER_ADDR '$MASTER_ADDR' has characters the remote shell would read"
  for arg in "${entry_args[@]}"; do
    [[ $arg =~ $spaced ]] || die "LAUNCHER=pdsh runs arguments through the remote shell and '$arg'" \
      "has characters it would read: move the value into the YAML config, or use NODE_RANK"
  done
}

deepspeed_command() {
  ds=(deepspeed)
  if [[ -n $hostfile ]]; then
    ds+=(--hostfile "$hostfile")
    if [[ $launcher != openmpi ]]; then ds+=(--num_nodes "$nnodes" --num_gpus "$gpus_per_node"); fi
  elif [[ -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
    # DeepSpeed ignores CUDA_VISIBLE_DEVICES when given --num_gpus and uses devices 0..N-1.
    local visible devices
    IFS=, read -ra visible <<< "$CUDA_VISIBLE_DEVICES"
    (( gpus_per_node <= ${#visible[@]} )) \
      || die "GPUS_PER_NODE=$gpus_per_node but CUDA_VISIBLE_DEVICES lists ${#visible[@]} devices"
    devices=$(IFS=,; echo "${visible[*]:0:gpus_per_node}")
    ds+=(--include "localhost:$devices")
  else
    ds+=(--num_gpus "$gpus_per_node")
  fi
  if [[ -n $node_rank ]]; then ds+=(--no_ssh --node_rank "$node_rank"); fi
  if [[ -n ${MASTER_ADDR:-} ]]; then ds+=(--master_addr "$MASTER_ADDR"); fi
  ds+=(--master_port "$master_port")
  if [[ -n ${LAUNCHER:-} ]]; then ds+=(--launcher "$launcher"); fi
  # srun reaches the nodes through SLURM; DeepSpeed's ssh check of the first host would only fail
  # where a cluster allows no ssh between nodes.
  if [[ $launcher == slurm ]]; then ds+=(--no_ssh_check); fi
  ds+=(pretrain/pretrain_ora.py "${entry_args[@]}")
}

# What DeepSpeed forwards to the other nodes besides NCCL*, PYTHON*, UCX*, MV2* and MLFLOW*
# (runner.py, EXPORT_ENVS): the lines of its environment file, read from ~ and . under the name
# DS_ENV_FILE (default .deepspeed_env). An absolute DS_ENV_FILE is read from where it is (the
# name is os.path.join-ed to both), so ours lives in the run dir; the user's own files follow it,
# and later lines win, as in DeepSpeed.
environment_file_lines() {
  local assignments=() name
  for name in "${FORWARDED[@]}"; do
    if [[ -n ${!name:-} ]]; then assignments+=("$name=${!name}"); fi
  done
  if [[ $launcher != pdsh ]]; then
    # mpirun and srun start the ranks without DeepSpeed's per-node launcher, which would set the
    # torch variables: pretrain_ora.py takes the ranks from the scheduler, the address from here.
    assignments+=("ORA_RANKS_FROM=$launcher" "MASTER_ADDR=$MASTER_ADDR" "MASTER_PORT=$master_port")
  fi
  local assignment unsafe='[$`"\\]'
  for assignment in "${assignments[@]}"; do
    # pdsh puts the value in double quotes in a remote shell command line.
    [[ $assignment != *$'\n'* && ! $assignment =~ $unsafe ]] || die "cannot forward ${assignment%%=*} to the" \
      "other nodes: its value has a newline, a double quote, a dollar sign, a backquote or a backslash"
  done
  printf '%s\n' "${assignments[@]}"
  local user=${DS_ENV_FILE:-.deepspeed_env}
  local user_files=("$HOME/$user" "./$user") file
  if [[ $user == /* ]]; then user_files=("$user"); fi
  for file in "${user_files[@]}"; do
    # DeepSpeed splits every line at '=', so a blank line would stop it.
    if [[ -f $file ]]; then grep -v '^[[:space:]]*$' "$file" || true; fi
  done
}

# One line a user can paste: the directory, the variables set here, the command.
print_command() {
  local assignments=("NCCL_DEBUG=$NCCL_DEBUG" "TORCH_NCCL_ASYNC_ERROR_HANDLING=$TORCH_NCCL_ASYNC_ERROR_HANDLING")
  if [[ -n $env_file ]]; then assignments+=("DS_ENV_FILE=$env_file"); fi
  local line assignment
  line="cd $(printf '%q' "$PWD") &&"
  for assignment in "${assignments[@]}"; do
    line+=" ${assignment%%=*}=$(printf '%q' "${assignment#*=}")"
  done
  line+=$(printf ' %q' "${ds[@]}")
  printf '%s\n' "$line"
}

launch() {
  if (( $# == 0 )) || [[ $1 == -* ]]; then usage; fi
  config=$(config_path "$1") || exit
  shift
  read_topology
  run_dir=
  if [[ -n ${RUN_DIR:-} ]]; then run_dir=$(absolute "$RUN_DIR"); fi
  entry_arguments "$@"
  if multi_node_exec && [[ $launcher == pdsh ]]; then refuse_shell_syntax_for_pdsh; fi
  run_dir=$(check_config $(( nnodes * gpus_per_node ))) || exit
  entry_arguments "$@"
  env_file=
  if multi_node_exec; then
    env_file=$run_dir/deepspeed_env
    environment_lines=$(environment_file_lines) || exit
  fi
  deepspeed_command
  if [[ ${DRY_RUN:-0} != 0 ]]; then
    if [[ -n $env_file ]]; then printf 'would write %s:\n%s\n' "$env_file" "$environment_lines" >&2; fi
    print_command
    exit 0
  fi
  command -v deepspeed > /dev/null || die "deepspeed is not on PATH (activate the virtualenv: . .venv/bin/activate)"
  if [[ -n $env_file ]]; then
    mkdir -p "$run_dir"
    printf '%s\n' "$environment_lines" > "$env_file"
    export DS_ENV_FILE=$env_file
  fi
  print_command
  exec "${ds[@]}"
}

main() {
  caller_dir=$PWD
  cd "$(dirname "${BASH_SOURCE[0]}")/.."
  command -v python > /dev/null || die "python is not on PATH (activate the virtualenv: . .venv/bin/activate)"
  set_nccl_defaults
  # DeepSpeed's launcher (and torchrun) give every worker both.
  if [[ -n ${LOCAL_RANK:-} && -n ${WORLD_SIZE:-} ]]; then run_worker "$@"; fi
  launch "$@"
}

main "$@"
exit  # bash stops here; the next line is for Python
# shellcheck disable=SC2317
"""; import sys; sys.exit('launch/pretrain_ora.sh is a bash script: run it directly (launch/pretrain_ora.sh PRESET ...) or as deepspeed --no_python [options] launch/pretrain_ora.sh PRESET ...')  # for bash, this line is one quoted word"
