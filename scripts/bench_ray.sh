#!/bin/sh
# The Ray Serve benchmark of docs/benchmarks.md ("Scale-out on Ray Serve"): one uvicorn process
# vs two Ray Serve engine replicas (1 thread each) under the load generator, and an 8-tenant trace
# with prefix-aware routing vs Serve's default power-of-two router. Runs inside a loopback-only
# network namespace (Ray binds the host's address otherwise): as root,
#   unshare -n scripts/bench_ray.sh [OUT_DIR]
# Figures go to OUT_DIR (default /tmp/cbserve-bench-ray): loadtest JSON and tenants.jsonl.
set -eu
ip link set lo up
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${1:-/tmp/cbserve-bench-ray}
MODEL=${MODEL:-smollm2-135m-instruct}
KV=${KV:-0.1}                # GiB per engine (process or replica): ~2,300 SmolLM2 tokens
RATE=${RATE:-0.5}
N=${N:-20}
TENANT_N=${TENANT_N:-32}
TENANT_RATE=${TENANT_RATE:-0.5}
TENANT_OUT=${TENANT_OUT:-8}
TENANTS=${TENANTS:-8}
REPLICAS=${REPLICAS:-2}
NUM_CPUS=${NUM_CPUS:-}       # Ray CPUs of the local cluster (more replicas than cores need more)
ONLY_TENANTS=${ONLY_TENANTS:-0}  # 1: skip the one-process run and the load runs (routing only)
mkdir -p "$OUT" "$OUT/home"
# Ray writes into HOME (~/.ray): give it a private one, but keep the model cache where it is.
export CBSERVE_MODEL_DIR="${CBSERVE_MODEL_DIR:-$HOME/.cache/cbserve/models}"
export HOME="$OUT/home" RAY_USAGE_STATS_ENABLED=0
PORT=8790

wait_up() {
    for _ in $(seq 1 300); do
        kill -0 "$1" 2>/dev/null || { echo "server exited"; return 1; }
        curl -sf -m 2 "127.0.0.1:$PORT/health" >/dev/null && return 0
        sleep 1
    done
    return 1
}

load() {  # label
    $PY -m loadtest run --base-url "http://127.0.0.1:$PORT" --rate "$RATE" --num-requests "$N" \
        --label "$1" --out "$OUT/load-$1.json" --no-progress --warmup 2 | tail -25
}

tenants() {  # label
    $PY -m server.ray.bench_tenants --base-url "http://127.0.0.1:$PORT" --label "$1" \
        --tenants "$TENANTS" --num-requests "$TENANT_N" --rate "$TENANT_RATE" --output-len "$TENANT_OUT" --out "$OUT/tenants.jsonl"
}

if [ "$ONLY_TENANTS" != 1 ]; then
    echo "== one process (uvicorn), 1 thread"
    $PY -m server --model "$MODEL" --port $PORT --num-threads 1 --kv-cache-memory "$KV" \
        --log-level warning > "$OUT/server-1proc.log" 2>&1 &
    pid=$!
    wait_up $pid
    load one-process
    tenants one-process
    kill -TERM $pid; wait $pid || true
fi

for routing in prefix default; do
    echo "== Ray Serve, $REPLICAS replicas x 1 thread, routing=$routing"
    $PY -m server.ray --model "$MODEL" --replicas "$REPLICAS" --threads-per-replica 1 --port $PORT \
        --kv-cache-memory "$KV" --routing $routing --ray-temp-dir "$OUT/ray" ${NUM_CPUS:+--num-cpus $NUM_CPUS} \
        --log-level warning > "$OUT/server-ray-$routing.log" 2>&1 &
    pid=$!
    t0=$(date +%s)
    wait_up $pid
    echo "ready after $(( $(date +%s) - t0 )) s"
    [ $routing = prefix ] && [ "$ONLY_TENANTS" != 1 ] && load ray-2-replicas
    tenants "ray-$routing-r$REPLICAS-kv$KV"
    kill -TERM $pid; wait $pid || true
done
rm -rf "$OUT/ray" "$OUT/home"
