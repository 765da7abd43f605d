# Two commands for a fresh machine: `make demo` and `make test`. Both create .venv and install.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DATA ?= ../shared/data
DB ?= commlens.duckdb
# torch: a user's existing torch is kept; with none and no GPU, the CPU build 2.13.0 (on local disk
# on the team's machines) is installed before the project so no multi-GB CUDA build is pulled.
TORCH_PIN ?= torch==2.13.0

.PHONY: venv install install-test demo test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

venv: $(BIN)/python

install: venv
	@if ! $(BIN)/python -c "import torch" 2>/dev/null; then \
	  if command -v nvidia-smi >/dev/null 2>&1; then echo "GPU found: installing torch from the index"; $(BIN)/pip install -q "torch>=2.4,<3"; \
	  else echo "no GPU: installing $(TORCH_PIN) (CPU build)"; $(BIN)/pip install -q "$(TORCH_PIN)"; fi; \
	fi
	$(BIN)/pip install -q -e ".[harness]"

install-test: install
	$(BIN)/pip install -q -e ".[harness,test]"

demo: install
	$(BIN)/commlens ingest $(DATA) --db $(DB) --run shared-data || true
	@echo "store: $(DB)"

test: install-test
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
