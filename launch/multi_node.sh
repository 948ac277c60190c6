#!/usr/bin/env bash
# Several nodes from a DeepSpeed hostfile ("host slots=8" per line). Run on the first host; the
# DeepSpeed launcher reaches the others over pdsh/ssh. Set --run-dir on a filesystem all nodes share.
#   launch/multi_node.sh hostfile --config pretrain/configs/large.yaml --run-dir /shared/runs/large
# Without ssh (e.g. each node started by a scheduler), run on every node instead:
#   NODE_RANK=<i> MASTER_ADDR=<host0> launch/multi_node.sh hostfile --config ... --run-dir ...
set -euo pipefail
cd "$(dirname "$0")/.."
hostfile=$1; shift
world=$(awk '/slots=/{split($2, kv, "="); n += kv[2]} END {print n}' "$hostfile")
python pretrain/pretrain_ora.py --check-only --world-size "$world" "$@"
if [[ -n "${NODE_RANK:-}" ]]; then
  exec deepspeed --hostfile "$hostfile" --no_ssh --node_rank "$NODE_RANK" \
    --master_addr "${MASTER_ADDR:?set MASTER_ADDR to the first host}" --master_port "${MASTER_PORT:-29500}" \
    pretrain/pretrain_ora.py "$@"
fi
exec deepspeed --hostfile "$hostfile" --master_port "${MASTER_PORT:-29500}" pretrain/pretrain_ora.py "$@"
