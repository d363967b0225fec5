"""Shutdown at the drain deadline and socket timeouts, on a real `python -m server` process.

SIGTERM with a stream and a non-streamed request still generating and a drain deadline shorter
than they need: the stream ends with an OpenAI-shaped error event and `data: [DONE]`, the
non-streamed request gets a JSON 503, the log has no traceback, and the process exits 0.
Also: a connection that never sends a whole request is closed after --request-read-timeout.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers.servers import free_port

ROOT = Path(__file__).resolve().parents[1]
# Longer than the drain deadline by far: TinyGPT cannot finish these before it passes.
LONG = {"model": "tinygpt", "prompt": "Hi", "max_tokens": 2000, "ignore_eos": True}


class ServerProcess:
    def __init__(self, *flags: str) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "server", "--model", "tinygpt", "--port", str(self.port)]
            + ["--num-threads", "1", *flags],
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def read_until(self, marker: str) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:  # blocks on the server's own log, not on a timer
            self.lines.append(line)
            if marker in line:
                return
        raise AssertionError(f"server exited before logging {marker!r}:\n{''.join(self.lines)}")

    def log(self) -> str:
        assert self.proc.stderr is not None
        return "".join(self.lines) + self.proc.stderr.read()


@pytest.fixture
def start_server() -> Iterator:
    procs: list[ServerProcess] = []

    def start(*flags: str) -> ServerProcess:
        p = ServerProcess(*flags)
        procs.append(p)
        p.read_until("Application startup complete")
        # uvicorn logs that line after the lifespan starts but before it binds the socket.
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", p.port), timeout=5).close()
                return p
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    yield start
    for p in procs:
        if p.proc.poll() is None:
            p.proc.kill()
        p.proc.wait(10)


def _running(server: ServerProcess) -> float:
    for line in httpx.get(server.url("/metrics"), timeout=10).text.splitlines():
        if line.startswith("cbserve_num_requests_running "):
            return float(line.split()[1])
    raise AssertionError("no cbserve_num_requests_running in /metrics")


@pytest.mark.slow
def test_drain_deadline_ends_streams_with_an_error_event_and_done(start_server):
    server = start_server("--shutdown-timeout", "1")
    full: dict = {}

    def non_streamed() -> None:
        r = httpx.post(server.url("/v1/completions"), json=LONG, timeout=60)
        full["status"], full["body"] = r.status_code, r.json()

    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", server.url("/v1/completions"), json={**LONG, "stream": True}) as r,
    ):
        events = r.iter_lines()
        assert next(e for e in events if e.startswith("data: {"))  # generating
        other = threading.Thread(target=non_streamed)
        other.start()
        # The second request is generating too once its tokens show in /metrics.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _running(server) < 2:
            time.sleep(0.05)
        sent = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        rest = [e for e in events if e.startswith("data: ")]
        ended = time.monotonic() - sent
        other.join(30)
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2].removeprefix("data: "))["error"]
    assert error["type"] == "server_error" and error["code"] == "engine_unavailable"
    assert "shutting down" in error["message"]
    assert ended < 5, f"the stream outlived the 1 s drain deadline by {ended - 1:.1f}s"
    assert full["status"] == 503
    assert full["body"]["error"]["code"] == "engine_unavailable"
    assert server.proc.wait(30) == 0
    log = server.log()
    assert "Traceback" not in log and "Exception in ASGI" not in log
    assert "timeout graceful shutdown exceeded" not in log  # uvicorn's backstop never fired
    assert "drain deadline of 1s passed" in log


@pytest.mark.slow
def test_a_silent_or_half_sent_request_is_closed_after_the_read_timeout(start_server):
    server = start_server("--request-read-timeout", "0.5")
    # Connects and sends nothing; sends half a header block; sends headers but half a body.
    partials = [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"]
    body = json.dumps({"prompt": "Hi"}).encode()
    partials.append(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body) + 10}\r\n\r\n".encode()
        + body
    )
    socks = []
    for data in partials:
        s = socket.create_connection(("127.0.0.1", server.port), timeout=20)
        s.sendall(data)
        socks.append(s)
    for s, data in zip(socks, partials, strict=True):
        start = time.monotonic()
        assert s.recv(1024) == b"", f"{data!r} got a response"  # closed by the server
        assert time.monotonic() - start < 15
        s.close()
    # A whole request on a fresh connection is still served.
    r = httpx.post(server.url("/v1/completions"), json={"prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 200
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(30) == 0
    assert "Traceback" not in server.log()
