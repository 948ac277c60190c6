# The two README commands: `make demo` (set up + main job on the embedded default) and `make test`.
# .ci/run and docker/Dockerfile install through the same `install` target.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install test demo

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and by exact version: on these machines this picks the local CPU wheel.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest -q

demo: install
	$(PY) -m ora_megatron.summary --config pretrain/configs/base.yaml
