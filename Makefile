# The two README commands: `make demo` (set up + main job on the embedded default) and `make test`.
# .ci/run installs through the `install` target: the project with every extra (EXTRAS), which the suite
# exercises. docker/Dockerfile installs the same pins, read from pyproject.toml, into NVIDIA's PyTorch image
# but keeps that image's CUDA torch instead of torch==<pin>.
# PYTHON and VENV pick the interpreter and its environment: `make test PYTHON=python3.12 VENV=runs/venv-py312`
# runs the suite under Python 3.12 (megatron-core 0.19) beside the default .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# pyproject.toml's extras, all of them: the tests and linters, the research tools, downstream evaluation.
EXTRAS := test,research,eval
# DeepSpeed compiles its CPU communication op on first use. Building it beside this environment's torch
# keeps it apart from other environments' builds, and from a lock a killed build left in ~/.cache.
export TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/torch_extensions

.PHONY: install test test-fast lint demo gpu-report wheels gpu-bringup

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and by exact version: on these machines this picks the local CPU wheel.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	# DeepSpeed's CPU communication op (shared-memory collectives), built now rather than by the first
	# run on CPU, which would wait about 35 s for it (a no-op where the accelerator is CUDA).
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
	touch $@

install: $(VENV)/.installed

# What CI runs (.ci/run): the linter, then every test, naming the 15 slowest. Two pytest-xdist workers:
# most of a test's time is its worker processes starting (imports), which leaves a second core idle
# half the time. A test file stays on one worker (--dist loadfile), so its module fixtures train once.
TEST_WORKERS ?= 2
test: lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15

lint: install
	$(PY) -m ruff check .

# The in-process subset (no worker processes, nothing slow): a developer's quick loop.
test-fast: install
	$(PY) -m pytest -q -m "not distributed and not slow"

# Embedded default, the whole flow (pretrain/quickstart.py): this Python's stdlib as a SlimPajama-format
# corpus (no download) → sentencepiece → megatron-core shards → the tiny ORA run on 2 processes through
# launch/pretrain_ora.sh → test evaluation → verified Hugging Face export → a sample. Reruns skip or resume.
demo: install
	$(PY) -m pretrain.quickstart --out runs/demo

# The GPU report (pretrain/research/gpu_report.py) on a machine with a CUDA GPU: GPU tests, the arms side by side,
# the training loop, a profile; runs/gpu-report/gpu_report.{md,json}. Without a GPU it says so and fails (status 2).
# No `install` first: a GPU machine without network gets its environment from wheels (gpu-bringup below).
gpu-report:
	$(PY) -m pretrain.research.gpu_report --out runs/gpu-report

# The GPU set's wheels for the GPU machine (docs/launching.md): pyproject.toml's [tool.ora.gpu] and what it needs,
# for CPython 3.12 on x86_64, less torch and what that machine has (docker/gpu_machine.txt), into runs/wheels;
# prints their size with the repository's and fails over the 64 MiB that may go there (docker/gpu_wheels.py).
wheels: install
	$(PY) docker/gpu_wheels.py --out runs/wheels --have docker/gpu_machine.txt

# On the GPU machine, with the repository and runs/wheels copied there, the one command: a virtualenv over its
# torch, the wheels installed offline, the imports checked, the GPU report into runs/gpu-report; the report's
# exit status (docker/gpu_bringup.sh). No `install`: that machine has no network.
gpu-bringup:
	docker/gpu_bringup.sh runs/wheels runs/gpu-report
