#!/usr/bin/env bash
# The Docker image's install steps, in a script so that tests can run them outside Docker.
#
#   scripts/docker-install.sh [VENV_DIR]        (default /opt/venv)
#
# Installs the project (not editable, no test extras) and CPU torch into VENV_DIR with
# scripts/install.sh, bakes SmolLM2-135M-Instruct and its converted tokenizer into
# $CBSERVE_MODEL_DIR, removes from the venv what a server never uses, then starts the installed
# engine once from / (not the source tree), which also byte-compiles just the modules a server
# imports.
#
# What goes (about 0.5 GB of 1.24 GB; nothing the server, the clients or the loadtest use):
#   - every __pycache__ pip wrote (260 MB, most for modules never imported); the smoke run below
#     writes back the ~30 MB a start imports
#   - torch's C++ test binaries (torch/test, torch/bin/*Test, test_*, protoc) and C++ headers
#     (torch/include: only for compiling extensions or torch.compile's C++ backend, and the image
#     has no compiler)
#   - pip and setuptools (installers; torch imports setuptools only to build C++ extensions)
#   - with STRIP=1 and binutils' strip on PATH: the static symbol tables of torch's shared libraries
#     (--strip-unneeded keeps the dynamic symbols the loader uses; ~90 MB off libtorch_cpu.so,
#     only native crash backtraces lose function names)
#
# Environment:
#   TORCH_INDEX        torch wheel index (default https://download.pytorch.org/whl/cpu; set it empty
#                      to let scripts/install.sh choose, e.g. a local wheel in pip's find-links)
#   TORCH_VERSION, PIP_OPTIONS   passed on to scripts/install.sh
#   CBSERVE_MODEL_DIR  where the model goes (default /opt/models)
#   SKIP_MODEL=1       do not fetch the model (tests)
#   PRUNE=0            keep the venv as pip left it
#   STRIP=1            strip torch's shared libraries (the Dockerfile's default)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-/opt/venv}"

export CBSERVE_MODEL_DIR="${CBSERVE_MODEL_DIR:-/opt/models}"
export TORCH_INDEX="${TORCH_INDEX-https://download.pytorch.org/whl/cpu}"
export EXTRAS="" EDITABLE=0
export PIP_NO_CACHE_DIR=1  # keep the image layer small
export HF_HUB_OFFLINE=1    # nothing here may reach a model hub

"$here/scripts/install.sh" "$venv"

py="$venv/bin/python"
if [ "${PRUNE:-1}" = "1" ]; then
    site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    torch_dir="$site/torch"
    rm -rf "$torch_dir/test" "$torch_dir/include"
    find "$torch_dir/bin" -mindepth 1 ! -name torch_shm_manager -exec rm -rf {} +
    "$py" -m pip uninstall --quiet --yes setuptools pip
    find "$venv" -name __pycache__ -type d -prune -exec rm -rf {} +
fi
if [ "${STRIP:-0}" = "1" ]; then
    if command -v strip > /dev/null; then
        find "$venv" -path '*/torch/lib/*.so*' -type f -exec strip --strip-unneeded {} +
    else
        echo "docker-install.sh: STRIP=1 but no strip on PATH (binutils); not stripping" >&2
    fi
fi

# From / so that the imports cannot come from the source tree. Byte-code is written on purpose:
# for the modules a start imports, so the image's non-root user never compiles them at start.
cd /
unset PYTHONDONTWRITEBYTECODE
"$py" -c "import engine, models, server.http.app, server.cli, uvicorn, fastapi"
"$py" -m server --help > /dev/null
# The CPU kernels were built into $CBSERVE_KERNEL_DIR by install.sh: fail the build if they don't load.
"$py" -c "from models import kernels; assert kernels.available(), kernels.unavailable_reason()"
"$py" - <<'EOF'
from engine import ContinuousBatchEngine, Request, SamplingParams
from models import load_model

lm = load_model("tinygpt")
engine = ContinuousBatchEngine(lm.model, max_batch_size=2)
ids = lm.tokenizer.encode("Hi")
engine.add_request(Request(prompt_token_ids=ids, params=SamplingParams(max_tokens=2)))
while engine.has_work():
    engine.step()
EOF
if [ "${SKIP_MODEL:-0}" != "1" ]; then
    # Loads the baked model and its tokenizer cache (written by models.fetch in install.sh).
    "$py" -c "from models import load_model; print('model:', load_model('smollm2-135m-instruct').model.__class__.__name__)"
fi
