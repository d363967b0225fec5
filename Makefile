# Two entry points: `make serve` (install, then run the server) and `make test` (install, then
# lint and run the whole suite). Each creates .venv with the CPU build of torch.
#
# On a normal Linux machine pass PyTorch's CPU wheel index so pip does not fetch the CUDA build:
#   make serve TORCH_INDEX=https://download.pytorch.org/whl/cpu

VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_INDEX ?=
MODEL ?= smollm2-135m-instruct
HOST ?= 127.0.0.1
PORT ?= 8000
SERVE_ARGS ?=
PYTEST_ARGS ?=

.PHONY: install serve demo test lint format bench clean

$(VENV)/.installed: pyproject.toml scripts/install.sh
	TORCH_INDEX="$(TORCH_INDEX)" scripts/install.sh $(VENV)
	touch $@

install: $(VENV)/.installed

serve: install
	$(PY) -m server --model $(MODEL) --host $(HOST) --port $(PORT) $(SERVE_ARGS)

demo: install
	$(PY) -m tools.demo

test: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: install
	$(PY) -m tools.bench_engine

clean:
	rm -rf $(VENV)
