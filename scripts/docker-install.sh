#!/usr/bin/env bash
# The Docker image's install steps, in a script so that tests can run them outside Docker.
#
#   scripts/docker-install.sh [VENV_DIR]        (default /opt/venv)
#
# Installs the project (not editable, no test extras) and CPU torch into VENV_DIR with
# scripts/install.sh, bakes SmolLM2-135M-Instruct into $CBSERVE_MODEL_DIR, and checks that the
# installed server imports and starts its CLI without the source tree.
#
# Environment:
#   TORCH_INDEX        CPU wheel index (default https://download.pytorch.org/whl/cpu; set it empty
#                      to let pip's own configuration find torch, e.g. a local wheel)
#   TORCH_VERSION      passed on to scripts/install.sh
#   CBSERVE_MODEL_DIR  where the model goes (default /opt/models)
#   SKIP_MODEL=1       do not fetch the model (tests)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-/opt/venv}"

export CBSERVE_MODEL_DIR="${CBSERVE_MODEL_DIR:-/opt/models}"
export TORCH_INDEX="${TORCH_INDEX-https://download.pytorch.org/whl/cpu}"
export EXTRAS="" EDITABLE=0
export PIP_NO_CACHE_DIR=1  # keep the image layer small

"$here/scripts/install.sh" "$venv"

# From / so that the import cannot come from the source tree.
cd /
"$venv/bin/python" -c "import engine, models, server.app, server.cli"
"$venv/bin/python" -m server --help > /dev/null
if [ "${SKIP_MODEL:-0}" != "1" ]; then
    "$venv/bin/python" -c "from models.fetch import smollm2_path; print('model:', smollm2_path())"
fi
