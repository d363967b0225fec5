"""Side-by-side serving benchmark: the same open-loop traces against running servers, one at a time.

    python -m tools.bench_serving --target ours=http://127.0.0.1:8000 \\
        --target llama-server=http://127.0.0.1:18080 --pid llama-server=12345 \\
        [--rates 1,2,3,4,6] [--num-requests 120] [--long] [--out results/serving.json] \\
        [--plots results/serving]

For each target: ITL p50 and E2E p50 at 1 req/s (60 requests), a
rate sweep (the highest rate at which every request met the SLO is what the server "holds"), and
the peak (64 requests at once: output tokens/s). With `--long`, the long-prompt trace instead
(1,024-1,536 tokens in, 64-128 out; 30 requests a rate; 32 at once for the peak). Peak RSS is read
from /proc for targets given a `--pid` (several pids summed: `--pid ours=1,2`).

Start each server yourself (ours: `python -m server --model smollm2-135m-instruct`; the peers: see
../shared/peers.md) and run targets one at a time on a quiet machine: each server competes for the
same cores. Each target gets one warm-up run that is discarded.

Seeds: by default every run draws its own prompts (seeds 7, 8, ... in the same order for every
server), so no run is served from an earlier run's prefix cache: what a server does with prompts it
has never seen. `--seeds same` replays seed 7 in every run, the protocol `../shared/peers.md`
describes for the peers' figures (`python -m loadtest run ... seed 7` per rate): after the first run
a server with a prefix cache (vLLM's is on by default, so is ours) computes only each prompt's last
partial block. The two protocols answer different questions; quote which one a figure used. For our
server each run also prints the prefix-cache hit rate it saw (from /metrics).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from loadtest.metrics import SLO, Summary
from loadtest.report import SweepPoint, plot_sweep, to_json
from loadtest.runner import GREEDY, add_sampling_argument, describe_sampling, scrape_metrics
from loadtest.sweep import MeasureOptions, measure
from loadtest.trace import TraceSpec

SERVING_SLO = SLO(
    ttft=1.0, itl_mean=0.2, itl_p99=0.2
)  # TTFT <= 1 s, each request's p99 gap <= 200 ms


@dataclass
class Result:
    name: str
    low: Summary | None = None
    sweep: dict[float, Summary] = field(default_factory=dict)
    peak: Summary | None = None
    peak_rss_mb: float | None = None

    def holds(self) -> float | None:
        ok = [r for r, s in self.sweep.items() if s.failed == 0 and s.goodput_fraction >= 1.0]
        return max(ok) if ok else None


class RSSWatcher(threading.Thread):
    """Samples the summed resident set of some pids every 0.2 s."""

    def __init__(self, pids: list[int]) -> None:
        super().__init__(daemon=True)
        self.pids, self.peak, self.stop = pids, 0.0, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            total = 0
            for pid in self.pids:
                try:
                    with open(f"/proc/{pid}/status") as f:
                        total += next(int(x.split()[1]) for x in f if x.startswith("VmRSS"))
                except (OSError, StopIteration):
                    pass
            self.peak = max(self.peak, total / 1024)
            time.sleep(0.2)


_RUN = [0]
_SAME_SEED = [False]
_SAMPLING = [GREEDY]  # the sampling fields every request sends (--sampling)
_TOKEN_IDS: list[dict] = [{}]  # the prompts' id range, when --token-ids sets one


def _spec(long: bool, rate: float, n: int) -> TraceSpec:
    # Every run its own seed (7, 8, ... in the same order for every server): a run that replayed
    # an earlier run's prompts would be served from the prefix cache. `--seeds same` does exactly
    # that on purpose (the peers' protocol).
    _RUN[0] += 1
    seed = 7 if _SAME_SEED[0] else 6 + _RUN[0]
    prompt_len, output_len = ((1024, 1536), (64, 128)) if long else ((32, 96), (16, 48))
    return TraceSpec(
        num_requests=n,
        rate=rate,
        prompt_len=prompt_len,
        output_len=output_len,
        seed=seed,
        **_TOKEN_IDS[0],
    )


_HITS, _QUERIES = "cbserve_prefix_cache_hits_total", "cbserve_prefix_cache_queries_total"


def _prefix_counters(url: str) -> tuple[float, float] | None:
    """(hits, queries) of our server's prefix cache in tokens, or None for a server without them."""
    try:
        found = scrape_metrics(url, (_HITS, _QUERIES), timeout=5)
    except (httpx.HTTPError, ValueError):
        return None
    if _HITS not in found or _QUERIES not in found:
        return None
    return found[_HITS], found[_QUERIES]


def _run(url: str, spec: TraceSpec, model: str | None) -> Summary:
    opts = MeasureOptions(
        model=model, slo=SERVING_SLO, progress=False, time_limit=900.0, sampling=_SAMPLING[0]
    )
    before = _prefix_counters(url)
    summary = measure(url, spec, opts).summary
    after = _prefix_counters(url)
    hit = ""
    if before and after and after[1] > before[1]:
        hit = f", prefix hits {(after[0] - before[0]) / (after[1] - before[1]):.0%}"
    itl = summary.itl.p50 * 1e3 if summary.itl else float("nan")
    ttft = summary.ttft.p50 * 1e3 if summary.ttft else float("nan")
    print(
        f"  rate {spec.rate:g} x{spec.num_requests}: ok {summary.completed}/{summary.total}, "
        f"in SLO {summary.goodput_fraction:.0%}, TTFT p50 {ttft:.0f} ms, ITL p50 {itl:.1f} ms, "
        f"output {summary.output_throughput:.0f} tok/s{hit}",
        flush=True,
    )
    return summary


def bench(name: str, url: str, args: argparse.Namespace, pids: list[int]) -> Result:
    res = Result(name)
    watcher = RSSWatcher(pids)
    watcher.start()
    long = args.long
    print(f"{name} ({url})", flush=True)
    _RUN[0] = 0  # the same seeds for every server
    _run(url, _spec(long, 1.0, 8), args.model)  # warm-up, discarded
    res.low = _run(url, _spec(long, 0.5 if long else 1.0, 30 if long else 60), args.model)
    for rate in (float(r) for r in args.rates.split(",")):
        n = 30 if long else args.num_requests
        res.sweep[rate] = s = _run(url, _spec(long, rate, n), args.model)
        if s.goodput_fraction < 0.5 and not args.keep_going:
            break  # far past the knee: higher rates only take longer
    res.peak = _run(url, _spec(long, float("inf"), 32 if long else 64), args.model)
    watcher.stop.set()
    res.peak_rss_mb = watcher.peak if pids else None
    return res


def table(results: list[Result], long: bool) -> str:
    low_rate = "0.5" if long else "1"
    head = (
        f"| server | ITL p50 at {low_rate} req/s | E2E p50 at {low_rate} req/s | holds (all in SLO) "
        "| sweep: rate -> in SLO, output tok/s | peak out tok/s | peak RSS |"
    )
    lines = [head, "|---|---|---|---|---|---|---|"]
    for r in results:
        low = r.low
        itl = f"{low.itl.p50 * 1e3:.0f} ms" if low and low.itl else "-"
        e2e = f"{low.e2e.p50 * 1e3:.0f} ms" if low and low.e2e else "-"
        holds = r.holds()
        sweep = "; ".join(
            f"{rate:g}: {s.goodput_fraction:.0%}, {s.output_throughput:.0f}"
            for rate, s in r.sweep.items()
        )
        peak = f"{r.peak.output_throughput:.0f}" if r.peak else "-"
        rss = f"{r.peak_rss_mb / 1024:.2f} GB" if r.peak_rss_mb else "-"
        held = f"{holds:g} req/s" if holds else "none of the rates"
        lines.append(f"| {r.name} | {itl} | {e2e} | {held} | {sweep} | {peak} | {rss} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", action="append", required=True, metavar="NAME=URL")
    ap.add_argument("--pid", action="append", default=[], metavar="NAME=PID[,PID]")
    ap.add_argument("--rates", default="1,2,3,4,6,8")
    ap.add_argument("--num-requests", type=int, default=120, help="per sweep rate (short trace)")
    ap.add_argument("--long", action="store_true", help="the long-prompt trace")
    ap.add_argument("--model", default=None, help="model name to send (default: the server's)")
    ap.add_argument(
        "--seeds",
        choices=("fresh", "same"),
        default="fresh",
        help="fresh: each run its own prompts (default); same: seed 7 every run (peers.md)",
    )
    ap.add_argument(
        "--token-ids",
        default=None,
        metavar="LO:HI",
        help="range of random prompt token ids (default: the trace's, which suits GPT-2-style "
        "vocabularies; Gemma's ids below ~110 are control tokens: use e.g. 1000:20000)",
    )
    add_sampling_argument(ap)
    ap.add_argument("--keep-going", action="store_true", help="do not stop a sweep past the knee")
    ap.add_argument("--out", type=Path, default=None, help="write the summaries as JSON")
    ap.add_argument(
        "--plots",
        type=Path,
        default=None,
        metavar="DIR",
        help="write the sweep's plots (TTFT, ITL, goodput against rate; one line a server) and "
        "table.md there",
    )
    args = ap.parse_args(argv)
    _SAME_SEED[0] = args.seeds == "same"
    _SAMPLING[0] = args.sampling
    if args.token_ids:
        lo, _, hi = args.token_ids.partition(":")
        _TOKEN_IDS[0] = {"token_ids": (int(lo), int(hi))}
    pids = {}
    for item in args.pid:
        name, _, value = item.partition("=")
        pids[name] = [int(p) for p in value.split(",") if p]
    results = []
    for item in args.target:
        name, _, url = item.partition("=")
        results.append(bench(name, url, args, pids.get(name, [])))
    print()
    trace = _spec(args.long, 1.0, 1).describe()
    if not _SAME_SEED[0]:
        trace = trace.replace(f"seed {6 + _RUN[0]}", "seeds 7, 8, ...")
    else:
        trace += " in every run (prompts repeat across runs)"
    title = f"SLO: {SERVING_SLO.describe()}; trace: {trace}; sampling: {describe_sampling(_SAMPLING[0])}"
    print(title)
    print(table(results, args.long))
    if args.plots:
        points = [SweepPoint(r.name, rate, s) for r in results for rate, s in r.sweep.items()]
        paths = plot_sweep(points, args.plots, title=title)
        md = f"{title}\n\n{table(results, args.long)}\n\n" + "\n".join(
            f"![{p.stem}]({p.name})" for p in paths
        )
        (args.plots / "table.md").write_text(md + "\n")
        print(f"plots and table: {args.plots}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)

        def js(summary: Summary | None) -> object:
            return None if summary is None else to_json(dataclasses.asdict(summary))

        payload = {
            r.name: {
                "low": js(r.low),
                "sweep": {str(k): js(v) for k, v in r.sweep.items()},
                "peak": js(r.peak),
                "peak_rss_mb": r.peak_rss_mb,
                "holds": r.holds(),
            }
            for r in results
        }
        args.out.write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
