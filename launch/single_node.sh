#!/usr/bin/env bash
# One node, N processes (GPUs, or CPU processes with gloo) through the DeepSpeed launcher.
#   launch/single_node.sh 8 --config pretrain/configs/base.yaml [--set key=value ...] [--run-dir DIR]
# The config is validated for N processes before any worker starts.
set -euo pipefail
cd "$(dirname "$0")/.."
nproc=$1; shift
python pretrain/pretrain_ora.py --check-only --world-size "$nproc" "$@"
exec deepspeed --num_gpus "$nproc" pretrain/pretrain_ora.py "$@"
