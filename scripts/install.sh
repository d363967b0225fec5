#!/usr/bin/env bash
# Installs the project into a virtual environment with the CPU build of torch.
#
#   scripts/install.sh [VENV_DIR]        (default .venv)
#   scripts/install.sh --print-torch     print the torch pip arguments it would use, and exit
#
# Which torch. On Linux x86_64, PyPI's torch is the CUDA build (several GB), so the pin carries
# PyTorch's local version label, torch==2.13.0+cpu: only PyTorch's CPU index (or a local wheel)
# has it, so pip cannot substitute the CUDA build. That index is passed as an *extra* index, for the
# torch step only, and only after a probe (5 s at most) reached it: pip retries an unreachable index
# for ~9 s for every package it looks up there. Unreachable, pip still finds a +cpu wheel in its own
# configured sources (find-links, a mirror); if none has one, a warning, then the plain pin (which
# there is PyPI's CUDA build). On macOS, Windows and Linux aarch64, PyPI's torch is the CPU build and
# has no +cpu label: a plain pin, no extra index.
#
# Environment:
#   TORCH_VERSION  torch release to pin (default 2.13.0); with a local label ("2.13.0+cu126") it is
#                  used as given
#   TORCH_INDEX    an index serving torch wheels, instead of PyTorch's CPU index (a mirror, a local
#                  PEP 503 index, or https://download.pytorch.org/whl/cu126 for CUDA); it must answer
#   PIP_OPTIONS    extra options for every pip install here (e.g. "--trusted-host 127.0.0.1")
#   EXTRAS         pip extras of the project to install (default: test)
#   SKIP_MODEL=1   do not fetch the default chat model (SmolLM2-135M-Instruct GGUF)
#   EDITABLE=0     install the project as a regular package (the Docker image does this)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
print_torch=0
if [ "${1:-}" = "--print-torch" ]; then
    print_torch=1
    shift
fi
venv="${1:-$here/.venv}"
python="${PYTHON:-python3}"
torch_version="${TORCH_VERSION:-2.13.0}"
extras="${EXTRAS-test}"
cpu_index="https://download.pytorch.org/whl/cpu"
# Word-split on purpose: several options in one variable.
read -r -a pip_options <<< "${PIP_OPTIONS:-}"

warn() { echo "install.sh: $*" >&2; }

# 0 if the index's torch page answers within 5 s (PEP 503: INDEX/torch/).
reachable() {
    "$python" - "$1" <<'EOF'
import os, ssl, sys, urllib.request

url = sys.argv[1].rstrip("/") + "/torch/"
if url.startswith("file:"):  # a local index: a folder
    sys.exit(0 if os.path.isdir(urllib.request.url2pathname(url[5:])) else 1)
context = ssl.create_default_context(cafile=os.environ.get("PIP_CERT") or None)
try:
    urllib.request.urlopen(url, timeout=5, context=context).close()
except Exception as e:
    print(f"install.sh: {url}: {e}", file=sys.stderr)
    sys.exit(1)
EOF
}

# The torch requirement and the options for pip to find it: torch_args, plus fallback (the plain
# pin to try when the +cpu one cannot be found) or empty.
torch_spec="torch==$torch_version"
fallback=""
if [[ "$torch_version" != *+* && "$(uname -s)" = Linux && "$(uname -m)" = x86_64 ]]; then
    torch_spec="torch==$torch_version+cpu"
fi
torch_args=("$torch_spec")
if [ -n "${TORCH_INDEX:-}" ]; then
    if ! reachable "$TORCH_INDEX"; then
        warn "TORCH_INDEX=$TORCH_INDEX does not answer"
        exit 1
    fi
    torch_args+=(--extra-index-url "$TORCH_INDEX")
elif [ "$torch_spec" != "torch==$torch_version" ]; then
    fallback="torch==$torch_version"
    if reachable "$cpu_index"; then
        torch_args+=(--extra-index-url "$cpu_index")
    else
        warn "PyTorch's CPU index is unreachable; looking for $torch_spec in pip's own sources"
    fi
fi
if [ "$print_torch" = 1 ]; then
    echo "${torch_args[*]}"
    exit 0
fi

if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip install --quiet ${pip_options[@]+"${pip_options[@]}"})
# torch first and pinned: the project's own range then accepts it and never pulls another build.
if ! "${pip[@]}" "${torch_args[@]}"; then
    [ -n "$fallback" ] || exit 1
    warn "no $torch_spec wheel found; installing $fallback from PyPI, which on Linux x86_64 is"
    warn "the CUDA build (GBs). For the CPU build: TORCH_INDEX=<a mirror of $cpu_index>."
    "${pip[@]}" "$fallback"
fi
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
# The CPU kernels (models/csrc), compiled once per machine and torch version (~1 min). Without a
# C++ compiler or on a CPU without AVX2 the server runs its pure-torch path: not an error.
"$venv/bin/python" -m models.kernels || echo "install.sh: CPU kernels not built; the pure-torch path will be used" >&2
