#!/usr/bin/env bash
# The GPU report on a GPU machine without network, in one command, from a copy of the repository:
#
#     docker/gpu_bringup.sh WHEELS OUT [gpu_report options]
#
# WHEELS: the folder `make wheels` fills (docker/gpu_wheels.py: the GPU set, its requirements.txt); OUT: the
# report's folder. The machine's Python ($PYTHON, default python3), the one that holds its CUDA torch, makes a
# virtualenv ($ORA_GPU_VENV, default runs/gpu-venv) that sees that Python's packages; the wheels are installed
# there with --no-index; what the report runs is imported (gpu_report --check-imports); then
# `python -m pretrain.research.gpu_report --out OUT [options]` runs: the gpu-marked tests, the arms side by
# side, the training loop, the profiles. Its exit status is this script's: 0 all ok, 1 something failed (the
# report says what), 2 no CUDA device; 3 the install or the imports failed (before any GPU time is spent).
# Logs of the install and the imports: OUT/logs/bringup-*.log. Running it again reuses the virtualenv and
# writes the report anew. A copy of the repository without .git records the revision ORA_GIT_REVISION names:
# `ORA_GIT_REVISION=<git rev-parse HEAD here> docker/gpu_bringup.sh WHEELS OUT`.
set -euo pipefail

if (($# < 2)); then
    echo "usage: $0 WHEELS OUT [gpu_report options]" >&2
    exit 64
fi
wheels=$(cd "$1" && pwd)
mkdir -p "$2/logs"
out=$(cd "$2" && pwd)
shift 2
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
venv=${ORA_GPU_VENV:-runs/gpu-venv}

step() {  # step NAME COMMAND...: COMMAND's output in OUT/logs/bringup-NAME.log; on failure its end, and stop
    local log="$out/logs/bringup-$1.log"
    shift
    echo "bringup: $* > $log" >&2
    if ! "$@" >"$log" 2>&1; then
        tail -n 25 "$log" >&2
        echo "bringup: failed (the whole log: $log)" >&2
        exit 3
    fi
}

# The virtualenv holds the wheels and nothing else of its own: the machine's packages (torch first of all,
# and pip, setuptools) are behind them, every entry of its Python's path added as a site directory (its .pth
# files read), whether that Python is the system's or a virtualenv's (--system-site-packages would miss the
# latter's).
[[ -x $venv/bin/python ]] || "$python" -m venv --without-pip "$venv"
venv=$(cd "$venv" && pwd)
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$python" -E -c 'import sys; print("".join(f"import site; site.addsitedir({p!r})\n" for p in sys.path if p))' \
    >"$site/machine-packages.pth"
"$venv/bin/python" -m pip --version >/dev/null 2>&1 || "$venv/bin/python" -m ensurepip >/dev/null  # no pip there
export PATH="$venv/bin:$PATH" TORCH_EXTENSIONS_DIR="$venv/torch_extensions"

# requirements.txt is the whole set (what the machine has left out): --no-deps installs it as it is, whatever
# the machine's own packages declare; the imports are checked next. PIP_CONSTRAINT empty: a machine-wide
# constraint file (NGC images have one) must not veto the pins.
step install env PIP_CONSTRAINT= "$venv/bin/python" -m pip install --no-index --find-links "$wheels" --no-deps \
    --disable-pip-version-check -r "$wheels/requirements.txt"
step imports "$venv/bin/python" -m pretrain.research.gpu_report --check-imports
tail -n 1 "$out/logs/bringup-imports.log" >&2

status=0
"$venv/bin/python" -m pretrain.research.gpu_report --out "$out" "$@" || status=$?
echo "bringup: the GPU report exited with $status" >&2
if [[ -f $out/gpu_report.md ]]; then
    echo "bringup: $out/gpu_report.md, $out/gpu_report.json; logs in $out/logs" >&2
fi
exit "$status"
