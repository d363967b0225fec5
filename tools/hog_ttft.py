"""A short request's time to first token behind a hog, under each scheduling policy.

    python -m tools.hog_ttft [--policies fcfs,fair] [--hog-choices 64] [--hog-tokens 1000]
                             [--probes 5] [--threads 1]

For each policy: start a real server (`python -m server --model tinygpt`: 32 slots, a 96-token
step budget, the CLI's defaults) on a free loopback port; take the unloaded TTFT of a short streamed request (4 tokens)
as the median of `--probes`; then start the hog (client "hog": 4 prompts x n=16 = 64 choices of
`--hog-tokens` tokens, read as it streams) and, once it is generating, the same short request
`--probes` times from client "short" (X-Client-Id; once under fcfs, where the first probe outlives
the hog). Prints the medians and their ratio. Timings on
a shared machine are noisy: read them as orders of magnitude.
"""

from __future__ import annotations

import argparse
import contextlib
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
    with serve(policy, args.threads) as url, httpx.Client(timeout=600) as client:
        ttft(client, url, short, "warmup")
        unloaded = [ttft(client, url, short, "short") for _ in range(args.probes)]
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
        loaded = [ttft(client, url, short, "short") for _ in range(probes)]
        stop.set()
        t.join(timeout=120)
    u, lo = statistics.median(unloaded), statistics.median(loaded)
    return {"unloaded_s": u, "behind_hog_s": lo, "ratio": lo / u}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.hog_ttft", description=__doc__)
    p.add_argument("--policies", default="fcfs,fair")
    p.add_argument("--hog-choices", type=int, default=64)
    p.add_argument("--hog-tokens", type=int, default=1000)
    p.add_argument("--probes", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    print(
        f"TinyGPT, 32 slots, 96-token step budget, {args.threads} torch thread(s); hog: "
        f"{args.hog_choices} choices x {args.hog_tokens} tokens; short: 4 tokens; median of "
        f"{args.probes}"
    )
    for policy in args.policies.split(","):
        r = measure(policy, args)
        print(
            f"{policy:>8}: unloaded TTFT {r['unloaded_s'] * 1000:8.1f} ms, behind the hog "
            f"{r['behind_hog_s'] * 1000:8.1f} ms, ratio {r['ratio']:.2f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
