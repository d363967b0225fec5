"""`python -m tools.bench_tenants`: a multi-tenant trace against a running server.

Each of `--tenants` tenants has its own system prompt of `--system-len` token ids; every request
is that prompt plus a short random question, sent open-loop (Poisson, `--rate`) through the
project's load generator (`loadtest.runner.run_trace`). Prints TTFT p50/p99 and output tok/s
from the load generator and the prefix-cache hit rate over the run from the server's `/metrics`
(`cbserve_prefix_cache_*`, which the Ray ingress sums over its replicas), plus the router's
decisions when the server reports them. Works against `python -m server` too (the reference).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx
import numpy as np

from loadtest.metrics import summarize
from loadtest.runner import run_trace, scrape_metrics
from loadtest.trace import TraceRequest, arrival_times


def tenant_trace(
    tenants: int,
    system_len: int,
    question_len: int,
    output_len: int,
    num: int,
    rate: float,
    seed: int,
) -> tuple[TraceRequest, ...]:
    rng = np.random.default_rng(seed)
    # Token ids 32..126: printable bytes for TinyGPT, ordinary tokens for SmolLM2.
    systems = [tuple(int(t) for t in rng.integers(32, 127, system_len)) for _ in range(tenants)]
    arrivals = arrival_times(num, rate, 1.0, rng)
    out = []
    for i, arrival in enumerate(arrivals):
        tenant = int(rng.integers(tenants))
        prompt = systems[tenant] + tuple(int(t) for t in rng.integers(32, 127, question_len))
        out.append(TraceRequest(i, arrival, prompt, len(prompt), output_len))
    return tuple(out)


def scrape(base_url: str) -> dict[str, float]:
    return scrape_metrics(base_url, ("cbserve_prefix_cache_", "cbserve_router_decisions_total"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench_tenants", description=__doc__)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--label", default="run")
    p.add_argument("--model", default=None, help="default: the first of /v1/models")
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--system-len", type=int, default=300)
    p.add_argument("--question-len", type=int, default=20)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--rate", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", default=None, help="append a JSON line with the figures")
    args = p.parse_args(argv)
    model = (
        args.model or httpx.get(args.base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
    )
    trace = tenant_trace(
        args.tenants,
        args.system_len,
        args.question_len,
        args.output_len,
        args.num_requests,
        args.rate,
        args.seed,
    )
    before = scrape(args.base_url)
    t0 = time.monotonic()
    result = asyncio.run(run_trace(trace, base_url=args.base_url, model=model, progress=False))
    wall = time.monotonic() - t0
    time.sleep(1.0)
    after = scrape(args.base_url)
    s = summarize(result.records, result.duration, result.peak_concurrency)
    queries = (
        after["cbserve_prefix_cache_queries_total"] - before["cbserve_prefix_cache_queries_total"]
    )
    hits = after["cbserve_prefix_cache_hits_total"] - before["cbserve_prefix_cache_hits_total"]
    decisions = {
        k.split('"')[1]: after[k] - before.get(k, 0.0)
        for k in after
        if k.startswith("cbserve_router_decisions_total")
    }
    figures = {
        "label": args.label,
        "requests": s.total,
        "failed": s.failed,
        "prefix_hit_rate": hits / queries if queries else 0.0,
        "ttft_p50_ms": s.ttft.p50 * 1e3 if s.ttft else None,
        "ttft_p99_ms": s.ttft.p99 * 1e3 if s.ttft else None,
        "output_tok_s": s.output_throughput,
        "wall_s": wall,
        "router": decisions,
        "conditions": f"{args.tenants} tenants, system prompt {args.system_len} tokens, "
        f"question {args.question_len}, output {args.output_len}, {args.num_requests} requests, "
        f"poisson {args.rate:g}/s, seed {args.seed}",
    }
    print(json.dumps(figures))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(figures) + "\n")
    return 0 if s.failed == 0 else 1


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
