"""Server RSS with many clients that open a stream and never read it (backpressure).

    python -m tools.silent_clients [--clients 100] [--n 4] [--max-tokens 500] [--duration 60]
                                   [--max-buffered-tokens 16] [--sndbuf 16384]

Starts a TinyGPT server in a child process (32 slots, the CLI's serving defaults; its listening
socket gets a fixed `--sndbuf` kernel send buffer, which accepted connections inherit, so the
kernel does not absorb megabytes per connection before the server feels the push back; 0 keeps
Linux's autotuning), warms it up with a full batch of reading clients, reads its idle RSS, then opens `--clients` raw sockets with a
4 kB receive buffer, each POSTing a streamed request (`--n` choices of `--max-tokens` tokens,
logprobs 20, ~1 kB per SSE chunk) and never reading. Prints the server's RSS every few seconds
for `--duration` seconds, then closes them. `--max-buffered-tokens 0` shows the unbounded
behaviour for comparison. The stall timeout is set beyond the run so the clients stay connected.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def serve(args: argparse.Namespace) -> None:
    """The child: an in-process server on a socket with a fixed send buffer."""
    import uvicorn

    from engine import make_engine
    from models import load_model
    from server.engine_client.driver import AsyncEngineDriver
    from server.http.app import ServerSettings, create_app
    from server.openai.protocol import ModelCard

    lm = load_model("tinygpt")
    engine = make_engine(
        "continuous",
        lm.model,
        max_batch_size=32,
        max_num_batched_tokens=96,
        kv_cache_memory_gib=0.25,
    )
    driver = AsyncEngineDriver(
        engine, num_threads=1, max_buffered_outputs=args.max_buffered_tokens or None
    )
    card = ModelCard((lm.name,), driver.max_model_len, lm.num_parameters(), driver.engine_name)
    app = create_app(lm.tokenizer, card, driver, ServerSettings(stall_timeout=3600))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    if args.sndbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, args.sndbuf)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    print(sock.getsockname()[1], flush=True)
    config = uvicorn.Config(app, log_level="warning", access_log=False)
    uvicorn.Server(config).run(sockets=[sock])


def silent_stream(port: int, body: dict) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    payload = json.dumps(body).encode()
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    return sock


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.silent_clients", description=__doc__)
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=500)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--max-buffered-tokens", type=int, default=16)
    p.add_argument("--sndbuf", type=int, default=16384)
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        serve(args)
        return 0
    cmd = [sys.executable, "-m", "tools.silent_clients", "--serve"]
    cmd += ["--max-buffered-tokens", str(args.max_buffered_tokens), "--sndbuf", str(args.sndbuf)]
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        url = f"http://127.0.0.1:{port}"
        # Warm up with a full batch of reading clients: the first large steps allocate what every
        # later step reuses (torch workspaces, malloc arenas), which is not the silent clients' cost.
        warm = {"prompt": "warm", "max_tokens": 48, "logprobs": 20, "stream": True, "n": 4}

        def read_one(_: int) -> None:
            with httpx.stream("POST", url + "/v1/completions", json=warm, timeout=600) as r:
                for _ in r.iter_lines():
                    pass

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(read_one, range(8)))
        time.sleep(1)
        idle = rss_mib(child.pid)
        print(
            f"TinyGPT server, 32 slots; {args.clients} silent clients x n={args.n} x "
            f"{args.max_tokens} tokens, logprobs 20; max-buffered-tokens "
            f"{args.max_buffered_tokens or 'unbounded'}; server SO_SNDBUF {args.sndbuf or 'auto'}"
        )
        print(f"idle RSS {idle:.1f} MiB", flush=True)
        body = {
            "prompt": "silent",
            "n": args.n,
            "max_tokens": args.max_tokens,
            "ignore_eos": True,
            "logprobs": 20,
            "stream": True,
        }
        socks = [silent_stream(port, body) for _ in range(args.clients)]
        t0 = time.monotonic()
        peak = idle
        while time.monotonic() - t0 < args.duration:
            time.sleep(5)
            rss = rss_mib(child.pid)
            peak = max(peak, rss)
            m = httpx.get(url + "/metrics", timeout=30).text
            gauges = {
                line.split()[0]: line.split()[1]
                for line in m.splitlines()
                if line.startswith("cbserve_num_requests_")
            }
            print(
                f"t={time.monotonic() - t0:5.0f}s RSS {rss:7.1f} MiB "
                f"({(rss / idle - 1) * 100:+.1f}% of idle) {gauges}",
                flush=True,
            )
        for s in socks:
            s.close()
        time.sleep(5)
        end = rss_mib(child.pid)
        print(
            f"peak RSS {peak:.1f} MiB ({(peak / idle - 1) * 100:+.1f}% of idle); "
            f"5 s after closing: {end:.1f} MiB"
        )
    finally:
        child.terminate()
        child.wait(timeout=60)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
