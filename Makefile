# The two README commands: `make demo` (set up + main job on the embedded default) and `make test`.
# .ci/run and docker/Dockerfile install through the same `install` target.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install test test-fast lint demo

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and by exact version: on these machines this picks the local CPU wheel.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

install: $(VENV)/.installed

# What CI runs (.ci/run): the linter, then every test.
test: lint
	$(PY) -m pytest -q

lint: install
	$(PY) -m ruff check .

# The in-process subset (no worker processes, nothing slow): a developer's quick loop.
test-fast: install
	$(PY) -m pytest -q -m "not distributed and not slow"

# Embedded default: this Python's stdlib as a SlimPajama-format corpus (no download) → sentencepiece
# → megatron-core shards → 2-process tiny ORA pretraining. Rerunning resumes every stage.
DEMO := runs/demo
demo: install
	$(PY) -m data_tools.sample_corpus --output-dir $(DEMO)/corpus
	$(PY) -m data_tools.train_tokenizer --input $(DEMO)/corpus --model-prefix $(DEMO)/tokenizer/sp \
		--vocab-size 2048
	$(PY) -m data_tools.build_shards --input $(DEMO)/corpus --tokenizer $(DEMO)/tokenizer/sp.model \
		--output-dir $(DEMO)/shards --split train=0.98,valid=0.01,test=0.01 --workers 2
	$(PY) pretrain/pretrain_ora.py --config pretrain/configs/tiny.yaml --nproc-per-node 2 \
		--run-dir $(DEMO)/run
