#!/usr/bin/env bash
# Fuzz a TinyGPT server from its own /openapi.json with schemathesis (all checks), niced.
# Not part of CI: schemathesis is installed into its own venv (it pins its own hypothesis).
#
#   tools/fuzz_openapi.sh [SECONDS] [extra `st run` options...]
#
# SECONDS (default 300) is schemathesis' --max-time. The server runs from .venv on a free
# loopback port with a small engine (max_tokens are capped by --max-model-len) and is stopped at
# the end; its log is in $OUT/server.log and schemathesis' report in $OUT (default
# /tmp/cbserve-fuzz).
#
# positive_data_acceptance is replaced by the same check from tools/fuzz_openapi_hooks.py, which
# also accepts a 400 whose error code the document lists as a rule JSON Schema cannot state
# (the context length; min_tokens <= max_tokens): see that file.
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_BUDGET="${1:-300}"
shift || true
OUT="${OUT:-/tmp/cbserve-fuzz}"
ST_VENV="${ST_VENV:-/tmp/cbserve-schemathesis}"
mkdir -p "$OUT"
if [ ! -x "$ST_VENV/bin/st" ]; then
    python3 -m venv "$ST_VENV"
    "$ST_VENV/bin/pip" install -q schemathesis
fi
PORT="$(.venv/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
# A short context keeps each generated request cheap; the schema states it (max_tokens maximum).
nice -n 19 .venv/bin/python -m server --model tinygpt --port "$PORT" --num-threads 1 \
    --max-model-len 128 --max-batch-size 8 --kv-cache-memory 0.05 --log-level warning \
    >"$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 120); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
    sleep 1
done
HOOKS="$PWD/tools/fuzz_openapi_hooks.py"
cd "$OUT"  # schemathesis keeps its crash cache (.schemathesis/) in the working directory
SCHEMATHESIS_HOOKS="$HOOKS" nice -n 19 "$ST_VENV/bin/st" run "http://127.0.0.1:$PORT/openapi.json" \
    --checks all --exclude-checks positive_data_acceptance \
    --max-time "$SECONDS_BUDGET" --workers 1 --request-timeout 60 \
    --report junit --report-dir "$OUT" "$@"
