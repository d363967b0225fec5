"""A short request's time to first token behind a hog, under each scheduling policy.

    python -m tools.hog_ttft [--policies fcfs,fair] [--hog-choices 64] [--hog-tokens 1000]
                             [--probes 5] [--threads 1] [--think-ms 50]

For each policy: start a real server (`python -m server --model tinygpt --max-batch-size 32`:
32 slots, so the hog's 64 choices fill them; otherwise the CLI's defaults) on a free loopback port; take the unloaded TTFT of a short streamed request (4 tokens)
as the median of `--probes`; then start the hog (client "hog": 4 prompts x n=16 = 64 choices of
`--hog-tokens` tokens, read as it streams) and, once it is generating, the same short request
`--probes` times from client "short" (X-Client-Id; once under fcfs, where the first probe outlives
the hog). Prints the medians and their ratio. Timings on
a shared machine are noisy: read them as orders of magnitude.

Each probe (unloaded and behind the hog alike) is sent after a random pause of 0..`--think-ms`
(seeded), so it arrives at a random point of the engine's step, as an independent client's
request does. Without it (`--think-ms 0`) every probe behind the hog is sent the moment the
previous one ends, which is right after a step boundary (its last token ended a step), so it
always waits out an almost whole step of the hog: a lockstep no real client keeps.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx


@contextlib.contextmanager
def serve(policy: str, threads: int) -> Iterator[str]:
    """`python -m server` in a child process (so this process's client threads do not compete
    with it for the GIL), with the CLI's serving defaults on TinyGPT."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "server", "--model", "tinygpt", "--port", str(port)]
    cmd += ["--max-batch-size", "32"]  # fewer slots than hog choices: the policy decides who runs
    cmd += ["--scheduling", policy, "--num-threads", str(threads), "--log-level", "warning"]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


# Server-side histograms (their _sum and _count) that split a probe's TTFT into parts.
_PARTS = {
    "queue": "cbserve_request_queue_time_seconds",  # arrival -> its first step starts
    "server_ttft": "cbserve_time_to_first_token_seconds",  # arrival -> first token out
    "step": "cbserve_engine_step_seconds",  # every engine step
}


def histograms(client: httpx.Client, url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of each of `_PARTS` from /metrics."""
    values: dict[str, float] = {}
    for line in client.get(url + "/metrics").text.splitlines():
        name, _, value = line.partition(" ")
        if name.endswith(("_sum", "_count")):
            values[name] = float(value)
    return {k: (values[f"{n}_sum"], values[f"{n}_count"]) for k, n in _PARTS.items()}


def means_between(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, float]:
    """Mean of each histogram over the observations made between two snapshots. While the
    probes run behind the hog, the only requests that get a first token are the probes (the
    hog's running choices got theirs before, its waiting ones do not start), so queue and
    server_ttft are the probes' own."""
    out = {}
    for k in _PARTS:
        total, count = after[k][0] - before[k][0], after[k][1] - before[k][1]
        out[k] = total / count if count else float("nan")
    return out


def ttft(client: httpx.Client, url: str, body: dict, client_id: str) -> float:
    """Seconds from sending a streamed request to its first SSE event; reads it to the end."""
    t0 = time.perf_counter()
    first = None
    headers = {"X-Client-Id": client_id}
    with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and first is None:
                first = time.perf_counter() - t0
    assert first is not None
    return first


def measure(policy: str, args: argparse.Namespace) -> dict[str, float]:
    short = {"prompt": "Hello there", "max_tokens": 4, "stream": True, "ignore_eos": True}
    rng = random.Random(args.seed)

    def probe(client: httpx.Client, url: str) -> float:
        time.sleep(rng.uniform(0, args.think_ms / 1000))
        return ttft(client, url, short, "short")

    with serve(policy, args.threads) as url, httpx.Client(timeout=600) as client:
        ttft(client, url, short, "warmup")
        before = histograms(client, url)
        unloaded = [probe(client, url) for _ in range(args.probes)]
        parts_unloaded = means_between(before, histograms(client, url))
        hog_body = {
            "prompt": [f"hog prompt number {i}" for i in range(4)],
            "n": args.hog_choices // 4,
            "max_tokens": args.hog_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        generating = threading.Event()
        stop = threading.Event()

        def hog() -> None:
            with (
                httpx.Client(timeout=600) as c,
                c.stream(
                    "POST", url + "/v1/completions", json=hog_body, headers={"X-Client-Id": "hog"}
                ) as r,
            ):
                for i, _ in enumerate(r.iter_lines()):
                    if i > 64:
                        generating.set()
                    if stop.is_set():
                        return  # closing the connection aborts the hog's choices

        t = threading.Thread(target=hog, daemon=True)
        t.start()
        assert generating.wait(300), "the hog never started"
        # Under fcfs the first probe waits for the hog's choices to finish, and the next ones
        # would find an idle server: one probe is the figure.
        probes = 1 if policy == "fcfs" else args.probes
        before = histograms(client, url)
        loaded = [probe(client, url) for _ in range(probes)]
        parts_loaded = means_between(before, histograms(client, url))
        stop.set()
        t.join(timeout=120)
    u, lo = statistics.median(unloaded), statistics.median(loaded)
    return {
        "unloaded_s": u,
        "behind_hog_s": lo,
        "ratio": lo / u,
        "parts_unloaded": parts_unloaded,
        "parts_loaded": parts_loaded,
        "mean_unloaded_s": statistics.mean(unloaded),
        "mean_behind_hog_s": statistics.mean(loaded),
    }


def breakdown(client_mean: float, parts: dict[str, float]) -> str:
    """Where a probe's time went (means): before the server saw it, waiting for a step to
    start (the step already running), from then to its first token (its own step, delivery)."""
    queue, server = parts["queue"], parts["server_ttft"]
    return (
        f"mean TTFT {client_mean * 1000:.1f} ms = HTTP in/out {(client_mean - server) * 1000:.1f}"
        f" + wait for a step {queue * 1000:.1f} + own step and delivery "
        f"{(server - queue) * 1000:.1f}; mean engine step {parts['step'] * 1000:.1f} ms"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.hog_ttft", description=__doc__)
    p.add_argument("--policies", default="fcfs,fair")
    p.add_argument("--hog-choices", type=int, default=64)
    p.add_argument("--hog-tokens", type=int, default=1000)
    p.add_argument("--probes", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--think-ms",
        type=float,
        default=50.0,
        help="random pause before each probe, 0..this (default: %(default)s; 0: back to back)",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(
        f"TinyGPT, the CLI's serving defaults, {args.threads} torch thread(s); hog: "
        f"{args.hog_choices} choices x {args.hog_tokens} tokens; short: 4 tokens; median of "
        f"{args.probes}, each after a random 0-{args.think_ms:g} ms pause"
    )
    for policy in args.policies.split(","):
        r = measure(policy, args)
        print(
            f"{policy:>8}: unloaded TTFT {r['unloaded_s'] * 1000:8.1f} ms, behind the hog "
            f"{r['behind_hog_s'] * 1000:8.1f} ms, ratio {r['ratio']:.2f}",
            flush=True,
        )
        print(f"          unloaded:      {breakdown(r['mean_unloaded_s'], r['parts_unloaded'])}")
        print(f"          behind the hog: {breakdown(r['mean_behind_hog_s'], r['parts_loaded'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
