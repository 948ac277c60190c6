#!/usr/bin/env bash
# Entrypoint of the GPU image (docker/Dockerfile): a little setup, then the command.
#   docker run ... IMAGE launch/pretrain_ora.sh small --set data.manifest=/data/shards/manifest.json
# Without a command, or with --help / -h, it prints how to run the image: the header of docker/Dockerfile,
# so the usage and the build file cannot drift apart.
set -euo pipefail

here=$(dirname "$(readlink -f "$0")")

if [[ $# -eq 0 || $1 == --help || $1 == -h ]]; then
  # The Dockerfile's first comment block, after the `# syntax=` directive, without the comment marks.
  awk 'NR == 1 { next } !/^#/ { exit } { sub(/^# ?/, ""); print }' "$here/Dockerfile"
  exit 0
fi

# `docker run --user UID:GID` (to write host mounts as oneself) starts a user without a home directory;
# Triton, DeepSpeed's op builder, matplotlib and wandb keep their caches under HOME.
if [[ ! -w "${HOME:-/nonexistent}" ]]; then
  export HOME="${TMPDIR:-/tmp}/ora-home"
  mkdir -p "$HOME"
fi

# NVIDIA's own entrypoint runs its entrypoint.d checks (driver and CUDA compatibility, the /dev/shm size
# warning) and ends with exec "$@"; images without it (or runs outside Docker) exec the command directly.
if [[ -x /opt/nvidia/nvidia_entrypoint.sh ]]; then
  exec /opt/nvidia/nvidia_entrypoint.sh "$@"
fi
exec "$@"
