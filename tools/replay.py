"""In-process, open-loop replay of a timed trace against an engine: the engine's view, no HTTP.

    python -m tools.replay --model tinygpt --engine continuous --rate 8 --num-requests 100 \\
        --prompt-len 64:256 --output-len 16:48 --seed 7 [--system-prompt-len 300] \\
        [--no-prefix-caching] [--threads N]

Owns the real-time loop and nothing else: traces, metrics and the conditions line are `loadtest`'s
(`TraceSpec`, `build_trace`, `RequestRecord`, `summarize`, `Conditions`), so TTFT, ITL, goodput
and throughput mean exactly what they mean over HTTP. A chat-like trace is a `TraceSpec` with a shared prefix: a system prompt
of N tokens before each distinct question.

The loop: add every request whose arrival time has passed, run one `engine.step()`, stamp each
emitted token with the time the step returned. A request counts as sent at its arrival time, so a
request that arrives during a step waits for it, as it would in a server. When the engine is idle
the loop sleeps until the next arrival. `--rate` takes a list (`1,4,8`): one fresh engine and one
table row per rate, same requests, only their timing changes.
"""

from __future__ import annotations

import argparse
import math
import time
from collections import deque
from dataclasses import dataclass, replace

import torch

from engine import Engine, EngineConfig, Request, SamplingParams, engine_class, engine_names
from engine.disaggregated import DisaggregatedStats
from loadtest.metrics import SLO, RequestRecord, Summary, summarize
from loadtest.report import format_rate, local_conditions
from loadtest.trace import Trace, TraceSpec, build_trace
from tools.model_args import add_model_args, load_from_args


@dataclass(frozen=True, slots=True)
class ReplayResult:
    summary: Summary
    records: tuple[RequestRecord, ...]
    prefix_cache_hit_rate: float | None  # None: the engine looked nothing up
    transfers: int | None  # None: the engine does not hand requests off
    bytes_per_transfer: float | None


def replay(engine: Engine, trace: Trace, slo: SLO | None = None) -> ReplayResult:
    """Run `trace` against `engine` in real time; every request asks for exactly its output_len."""
    arrivals = deque(sorted(trace, key=lambda r: r.arrival))
    index_of: dict[str, int] = {}
    token_times: dict[int, list[float]] = {r.index: [] for r in trace}
    end_times: dict[int, float] = {}
    errors: dict[int, str] = {}
    live = peak = 0
    start = time.perf_counter()
    while arrivals or engine.has_work():
        now = time.perf_counter() - start
        while arrivals and arrivals[0].arrival <= now:
            item = arrivals.popleft()
            request = Request(
                list(item.prompt),
                SamplingParams(max_tokens=item.output_len, ignore_eos=True),
            )
            index_of[request.request_id] = item.index
            engine.add_request(request)
            live += 1
        if not engine.has_work():
            time.sleep(max(arrivals[0].arrival - now, 0.0))  # idle until the next arrival
            continue
        peak = max(peak, live)
        outputs = engine.step()
        done = time.perf_counter() - start
        for out in outputs:
            i = index_of[out.request_id]
            token_times[i].extend([done] * len(out.token_ids))
            if out.finished:
                end_times[i] = done
                live -= 1
                if out.finish_reason not in ("length", "stop"):
                    errors[i] = out.finish_reason or "unknown"
    duration = time.perf_counter() - start

    records = tuple(
        RequestRecord(
            index=r.index,
            arrival=r.arrival,
            prompt_len=r.prompt_len,
            output_len=r.output_len,
            send_time=r.arrival,
            chunk_times=tuple(token_times[r.index]),
            end_time=end_times.get(r.index),
            completion_tokens=len(token_times[r.index]),
            prompt_tokens=r.prompt_len,
            error=errors.get(r.index),
        )
        for r in trace
    )
    stats = engine.stats()
    transfers = stats.transfers if isinstance(stats, DisaggregatedStats) else None
    return ReplayResult(
        summary=summarize(records, duration, peak, slo),
        records=records,
        prefix_cache_hit_rate=stats.prefix_cache_hit_rate if stats.prefix_cache_queries else None,
        transfers=transfers,
        bytes_per_transfer=stats.transferred_bytes / transfers if transfers else None,
    )


# -- command line --------------------------------------------------------------------------------

COLUMNS = (
    f"{'engine':<14} {'rate':>5} {'done':>5} {'out tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} "
    f"{'ITL p50':>8} {'ITL p99':>8} {'goodput':>8} {'hit rate':>8} {'transfers':>9} "
    f"{'MB/xfer':>8}"
)


def format_row(name: str, rate: float, result: ReplayResult) -> str:
    """One table row; latencies in ms, goodput in req/s, MB = 10^6 bytes."""
    s = result.summary

    def ms(dist, stat: str) -> str:
        return "n/a" if dist is None else f"{getattr(dist, stat) * 1000:.1f}"

    hit = "-" if result.prefix_cache_hit_rate is None else f"{result.prefix_cache_hit_rate:.1%}"
    transfers = "-" if result.transfers is None else str(result.transfers)
    per = "-" if result.bytes_per_transfer is None else f"{result.bytes_per_transfer / 1e6:.3f}"
    return (
        f"{name:<14} {format_rate(rate):>5} {s.completed:>5} {s.output_throughput:>9.1f} "
        f"{ms(s.ttft, 'p50'):>9} {ms(s.ttft, 'p99'):>9} {ms(s.itl, 'p50'):>8} "
        f"{ms(s.itl, 'p99'):>8} {s.goodput:>8.2f} {hit:>8} {transfers:>9} {per:>8}"
    )


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="tinygpt")
    ap.add_argument("--engine", choices=engine_names(), default="continuous")
    ap.add_argument("--rate", default="8", help="req/s, 'inf' for all at once; a list: 1,4,8")
    ap.add_argument("--num-requests", type=int, default=100)
    ap.add_argument("--prompt-len", type=_range, default=(64, 256), metavar="LO:HI")
    ap.add_argument("--output-len", type=_range, default=(16, 48), metavar="LO:HI")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--system-prompt-len", type=int, default=0, metavar="N")
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--max-batch-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="token budget of a step"
    )
    add_model_args(ap)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    lm = load_from_args(args)
    cls = engine_class(args.engine)
    config = EngineConfig(
        max_batch_size=args.max_batch_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False if args.no_prefix_caching else None,
    )
    rates = [float(r) for r in args.rate.split(",")]
    spec = TraceSpec(
        num_requests=args.num_requests,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        seed=args.seed,
        shared_prefix=args.system_prompt_len,
    )
    # Torch's first calls are slow (thread pools, allocator): pay them on a throwaway engine.
    warm = build_trace(TraceSpec(num_requests=2, rate=math.inf, output_len=(2, 2), seed=0))
    replay(cls(lm.model, config), warm)

    print(COLUMNS)
    for rate in rates:
        result = replay(cls(lm.model, config), build_trace(replace(spec, rate=rate)))
        print(format_row(cls.name, rate, result), flush=True)
    caching = "off" if args.no_prefix_caching else "default"
    conditions = local_conditions(
        lm.name, lm.num_parameters(), torch.__version__, spec.describe(), rates
    )
    print(
        f"{conditions.line()} In process (no HTTP), {torch.get_num_threads()} intra-op "
        f"threads, max batch {args.max_batch_size}, prefix caching {caching}; "
        f"goodput SLO {SLO().describe()}."
    )


if __name__ == "__main__":
    main()
