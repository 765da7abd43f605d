# Two commands for a fresh machine: `make demo` and `make test`. Both create .venv and install.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DATA ?= ../shared/data
DB ?= commlens.duckdb
PORT ?= 8050
# torch: a user's existing torch is kept; with none and no GPU, the CPU build 2.13.0 (on local disk
# on the team's machines) is installed before the project so no multi-GB CUDA build is pulled.
TORCH_PIN ?= torch==2.13.0

.PHONY: venv install install-test system-test-deps demo test lint typecheck layout clean

# A torch already installed for $(PYTHON) (a CUDA build, conda's) is kept: the venv then sees the system's
# site packages, so the project's torch range is satisfied without a download.
$(BIN)/python:
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
	  echo "keeping the torch of $(PYTHON): virtualenv with system site packages"; $(PYTHON) -m venv --system-site-packages $(VENV); \
	else $(PYTHON) -m venv $(VENV); fi
	$(BIN)/pip install -q --upgrade pip

venv: $(BIN)/python

install: venv
	@if ! $(BIN)/python -c "import torch" 2>/dev/null; then \
	  if command -v nvidia-smi >/dev/null 2>&1; then echo "GPU found: installing torch from the index"; $(BIN)/pip install -q "torch>=2.4,<3"; \
	  else echo "no GPU: installing $(TORCH_PIN) (CPU build)"; $(BIN)/pip install -q "$(TORCH_PIN)"; fi; \
	fi
	$(BIN)/pip install -q -e ".[harness]"

# Browser tests drive Debian's Chromium; compose validation uses Debian's docker-compose.
system-test-deps:
	@if [ ! -x /usr/bin/chromium ] || ! command -v docker-compose >/dev/null 2>&1; then \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    echo "installing chromium and docker-compose (Debian packages)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium docker-compose >/dev/null; \
	  else echo "note: install chromium and docker-compose (Debian packages) for the browser and compose tests"; fi; \
	fi

install-test: install system-test-deps
	$(BIN)/pip install -q -e ".[harness,test]"

# The demo: fresh harness runs of four schemes and two context-parallel styles on CPU (gloo), each ingested as a run named after its
# directory, then the real jobs of the shared data (one run per job: the NCCL log excerpts are 19), then a report. It rebuilds $(DB) and $(DEMO_OUT) from scratch.
DEMO_OUT ?= demo-runs
DEMO_MODEL ?= --layers 4 --hidden 128 --heads 4 --vocab 256 --seq-len 64 --micro-batch-size 2 --steps 4 --device cpu
HARNESS = $(BIN)/commlens harness $(DEMO_MODEL) --ingest --db $(DB) --overwrite

# A store that a running `commlens serve` holds is never deleted: the demo stops first and says what to do.
demo: install
	@$(BIN)/python -m commlens.cli_server $(DB) $(PORT)
	rm -rf $(DEMO_OUT) $(DB) $(DB).wal $(DB).server.json
	$(HARNESS) --out $(DEMO_OUT)/ddp --dp 2
	$(HARNESS) --out $(DEMO_OUT)/zero3 --dp 2 --zero 3
	$(HARNESS) --out $(DEMO_OUT)/tp --tp 2 --sp
	$(HARNESS) --out $(DEMO_OUT)/pp --pp 2 --micro-batches 4
	$(HARNESS) --out $(DEMO_OUT)/cp-ring --cp 2
	$(HARNESS) --out $(DEMO_OUT)/cp-attention2d --cp 4 --cp-style attention2d --cp-rq 2
	@if [ -d "$(DATA)" ]; then \
	  $(BIN)/commlens ingest $(DATA)/kineto-hta/nccl_parser_config --db $(DB) --run resnet50-ddp && \
	  $(BIN)/commlens ingest $(DATA)/kineto-param/dlrm_kineto.tar.gz --db $(DB) --run dlrm && \
	  $(BIN)/commlens ingest $(DATA)/nccl-logs --db $(DB) --run nccl-logs; \
	else echo "no $(DATA): skipping the shared real traces"; fi
	$(BIN)/commlens report --db $(DB) --run zero3
	@echo "store: $(DB) (runs: ddp zero3 tp pp cp-ring cp-attention2d resnet50-ddp dlrm, and one run per job of the NCCL logs: nccl-logs*); the dashboard follows (Ctrl-C stops it)"
	$(BIN)/commlens serve --db $(DB) --host 127.0.0.1 --port $(PORT)

# Lint: ruff's rule set and format check (pyproject.toml), and the import contracts (.importlinter: the dashboard
# imports nothing of the server, the layers go one way, no cycles).
lint: install-test layout
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	cd .layout && ../$(BIN)/lint-imports --config ../.importlinter

# mypy sees the installed layout (commlens.backend is backend/ ...) through a tree of links made here.
typecheck: install-test layout
	cd .layout && ../$(BIN)/mypy --config-file ../pyproject.toml -p commlens

# The installed package's layout (commlens.backend is backend/ ...) as a tree of links, for the tools that follow
# module names to files (mypy, import-linter).
layout:
	rm -rf .layout && mkdir -p .layout/commlens
	for f in commlens/*; do ln -s ../../$$f .layout/commlens/; done
	for d in backend ingest frontend harness; do ln -s ../../$$d .layout/commlens/$$d; done

# Two workers on the two cores CI has (TEST_WORKERS=0: one process); see tests/machine.py for what runs alone.
TEST_WORKERS ?= 2
test: lint typecheck
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .layout
