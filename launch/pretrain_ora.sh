#!/usr/bin/env bash
""":"
# Pretrain through DeepSpeed's launcher: one node, the nodes of a hostfile, or one call per node.
#
#   launch/pretrain_ora.sh PRESET|CONFIG [--set key=value ...]
#   NNODES=2 HOSTFILE=hosts launch/pretrain_ora.sh base        DRY_RUN=1 ...: check and print only
#   deepspeed --no_python --num_gpus 8 launch/pretrain_ora.sh base
#
# The variables (NNODES, GPUS_PER_NODE, HOSTFILE, MASTER_ADDR, MASTER_PORT, NODE_RANK, LAUNCHER,
# TP, PP, ZERO_STAGE, PRECISION, DATA_MANIFEST, RUN_DIR, DRY_RUN), the checks made before anything
# starts and the printed deepspeed command are those of pretrain/launch/launcher.py (its --help).
# This script only finds the repository and passes every argument on as it is. It is also Python:
# the line above opens a string that closes on the last line, so that deepspeed without
# --no_python, which runs the script with python, prints what to type.
set -euo pipefail
# Relative paths the user gives are relative to where they ran the script.
export ORA_CALLER_DIR=$PWD
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if ! command -v python > /dev/null; then
  echo "error: python is not on PATH (activate the virtualenv: . .venv/bin/activate)" >&2
  exit 2
fi
exec python -m pretrain.launch.launcher "$@"
# shellcheck disable=SC2317
"""; import sys; sys.exit('launch/pretrain_ora.sh is a bash script: run it directly (launch/pretrain_ora.sh PRESET ...) or as deepspeed --no_python [options] launch/pretrain_ora.sh PRESET ...')  # for bash, this line is one quoted word"
