# Two commands: `make run` and `make test`. Both create .venv and install the project first;
# `make test` adds the extras the tests need (Ray among them), `make run` stays light.
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
TESTED  := $(VENV)/.installed-test
TORCH   ?= torch==2.13.0

.PHONY: run demo test bench install clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e .
	touch $(STAMP)

$(TESTED): $(STAMP)
	$(BIN)/pip install -q -e ".[test,bench,ray]"
	touch $(TESTED)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/pdserve up

demo: $(STAMP)
	$(BIN)/python scripts/demo.py

test: $(TESTED)
	$(BIN)/python -m pytest

bench: $(TESTED)
	$(BIN)/python bench/engine_throughput.py --vllm

clean:
	rm -rf $(VENV) .pytest_cache
