# One target per habit. Every target bootstraps the virtualenv first, so a fresh
# machine with only Python needs nothing else: `make run`, `make test`.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.kvsnap-installed
# The CPU build of torch lies on the dev/CI disk; asking for it by version keeps pip
# from downloading a multi-GB CUDA build. Override on GPU machines: make TORCH=torch
TORCH   ?= torch==2.13.0
ARGS    ?=

.PHONY: install run test test-fast lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

run: $(STAMP)  ## generate over a long prompt on the embedded Gemma 3 270M
	$(BIN)/kvsnap generate $(ARGS)

test: $(STAMP)  ## the whole test suite, as CI runs it
	$(BIN)/python -m pytest -q $(ARGS)

test-fast: $(STAMP)  ## everything but the tests that load the real model
	$(BIN)/python -m pytest -q -m "not slow" $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: $(STAMP)  ## engine benchmark on the embedded model (minutes on 2 CPU cores)
	$(BIN)/python bench/engine_bench.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
