# The two commands of the README: `make train` and `make test`.
# Each creates the virtual environment on first use (torch pinned by constraints.txt) and
# installs what it needs: train the package and matplotlib, test the development tools too.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TRAIN_STAMP := $(VENV)/.installed-train
DEV_STAMP := $(VENV)/.installed-dev
NPROC ?= 2
TRAIN_ARGS ?=
EXTRAS ?= hf

.PHONY: train extras test lint typecheck unit clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# pip compiles each installed module to bytecode one after another (about half of the
# first install's time); installed with --no-compile, then compiled by compileall on every
# core. Its exit status is not checked: a few packages ship files that are not Python 3
# (pip skips them the same way).
COMPILE := $(BIN)/python -m compileall -q -j 0 $(VENV)/lib > /dev/null || true

$(TRAIN_STAMP): pyproject.toml constraints.txt | $(BIN)/python
	$(BIN)/python -m pip install --quiet --no-compile -c constraints.txt -e '.[bench]'
	$(COMPILE)
	touch $@

# torchtitan's models for tests/test_torchtitan.py: without its dependencies (they pull
# datasets, tokenizers, wandb...), with only what importing its models needs.
TORCHTITAN := torchtitan einops tyro docstring_parser typeguard spmd_types torch_checkpointing triton

$(DEV_STAMP): pyproject.toml constraints.txt | $(BIN)/python
	$(BIN)/python -m pip install --quiet --no-compile -c constraints.txt -e '.[dev]'
	$(BIN)/python -m pip install --quiet --no-compile --no-deps -c constraints.txt $(TORCHTITAN)
	$(COMPILE)
	touch $@

train: $(TRAIN_STAMP)
	$(BIN)/flatshard train --nproc $(NPROC) $(TRAIN_ARGS)

# `make extras EXTRAS=hf,trl`: optional dependencies into the same environment. flatshard
# stays editable (a plain `pip install '.[hf]'` replaces it with a copy, so edits to src/
# stop taking effect) and torch stays the pinned build.
extras: $(TRAIN_STAMP)
	$(BIN)/python -m pip install --quiet --no-compile -c constraints.txt -e '.[$(EXTRAS)]'
	$(COMPILE)

lint: $(DEV_STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

typecheck: $(DEV_STAMP)
	$(BIN)/mypy

# The suite in TEST_WORKERS processes (pytest-xdist), each test file in one of them (its
# module fixtures built once), the longest files first (tests/conftest.py). Many tests
# wait on peers, timeouts and process starts; two workers keep both of a 2-core machine's
# cores busy. TEST_WORKERS=0: one process.
TEST_WORKERS ?= auto
unit: $(DEV_STAMP)
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: lint typecheck unit

clean:
	rm -rf $(VENV) build dist src/*.egg-info .mypy_cache .ruff_cache .pytest_cache
