# Two entry points: `make serve` (install, then run the server) and `make test` (install, then
# lint and run the whole suite). Each creates .venv with the CPU build of torch: on Linux x86_64
# scripts/install.sh pins torch==2.13.0+cpu, which only PyTorch's CPU index (or a local wheel) has.
#
# To take torch from another index (a mirror, or a CUDA build with TORCH_VERSION=2.13.0+cu126):
#   make serve TORCH_INDEX=https://mirror.example/pytorch/whl/cpu

VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_INDEX ?=
MODEL ?= smollm2-135m-instruct
HOST ?= 127.0.0.1
PORT ?= 8000
SERVE_ARGS ?=
PYTEST_ARGS ?=
# pip extras: test tools, and Ray Serve (~240 MB, ~50 s) so the scale-out tests run in CI too
# (tests/test_ray_serve.py; they skip where Ray is missing). EXTRAS=test for a venv without Ray.
EXTRAS ?= test,ray

.PHONY: install browser serve demo test lint format bench clean

$(VENV)/.installed: pyproject.toml scripts/install.sh Makefile
	TORCH_INDEX="$(TORCH_INDEX)" EXTRAS="$(EXTRAS)" scripts/install.sh $(VENV)
	touch $@

install: $(VENV)/.installed

serve: install
	$(PY) -m server --model $(MODEL) --host $(HOST) --port $(PORT) $(SERVE_ARGS)

demo: install
	$(PY) -m tools.demo

# The web page's browser test drives Debian's chromium (playwright's own browser downloads are not
# reachable everywhere): installed here only where apt-get exists and we are root, as in CI;
# elsewhere the test skips.
browser:
	@if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		echo "installing chromium for the browser test"; \
		(apt-get install -y --no-install-recommends chromium >/dev/null 2>&1 || \
		 (apt-get update -qq && apt-get install -y --no-install-recommends chromium >/dev/null)) || \
		echo "make: could not install chromium; the browser test will skip"; \
	fi

# The suite over one pytest-xdist worker per logical CPU, a test module per worker at a time (so
# each module's fixtures, e.g. its server, are built once); tests/conftest.py hands out the two
# minutes-long tests first. PYTEST_WORKERS=0 runs it in one process.
PYTEST_WORKERS ?= logical
test: install browser
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

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
