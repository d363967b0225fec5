"""Backpressure and fair admission on a real server (issue 12).

A client that opens a stream and never reads (a raw socket with a small receive buffer) gets its
requests paused in the engine once its unread output reaches the bound, not buffered, and
aborted with their blocks freed after the stall timeout. A burst on an idle server is never
refused while batch slots are free.
"""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from server.app import ServerSettings
from tests.conftest import StepGate, run_server


def open_silent_stream(base_url: str, body: dict, rcvbuf: int = 4096) -> socket.socket:
    """POST a streamed request on a socket that will never be read."""
    host, port = base_url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect: the window
    sock.connect((host, int(port)))
    payload = json.dumps(body).encode()
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    return sock


def wait_for(predicate, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.slow
def test_a_client_that_does_not_read_is_paused_then_aborted_with_its_blocks_freed(tiny_lm):
    body = {
        "prompt": "never read me",
        "n": 4,
        "max_tokens": 1900,
        "ignore_eos": True,
        "logprobs": 20,  # ~1 kB per chunk: the socket buffers fill within a few dozen tokens
        "stream": True,
    }
    with run_server(
        tiny_lm,
        driver_options={"max_buffered_outputs": 4},
        settings=ServerSettings(stall_timeout=3.0),
        sndbuf=8192,
    ) as live:
        engine = live.engine
        sock = open_silent_stream(live.base_url, body)
        try:
            wait_for(lambda: len(engine.requests) == 4, what="the requests to start")
            states = list(engine.requests.values())
            wait_for(lambda: all(s.paused for s in states), what="the requests to be paused")
            generated = [s.num_output_tokens for s in states]
            assert max(generated) < body["max_tokens"]  # paused well before the end
            # Paused means not scheduled: nothing more is generated while it stays unread.
            time.sleep(1.0)
            assert [s.num_output_tokens for s in states] == generated or not engine.requests
            # After the stall timeout the requests are aborted and every block is free.
            wait_for(lambda: not engine.requests, timeout=30, what="the stall abort")
            bm = engine.block_manager
            wait_for(lambda: bm.num_free_blocks == bm.num_usable_blocks, what="blocks freed")
            # The server closed the connection: once the unread bytes are drained, EOF.
            sock.settimeout(10)
            while sock.recv(65536):
                pass
        finally:
            sock.close()
        # And it serves others meanwhile and after.
        r = httpx.post(
            live.url("/v1/completions"), json={"prompt": "hi", "max_tokens": 3}, timeout=30
        )
        assert r.status_code == 200


@pytest.mark.slow
def test_a_burst_on_an_idle_server_is_not_refused_while_slots_are_free(tiny_lm):
    # 32 slots, at most 16 requests waiting for one. The first step is held at a gate, so the
    # whole burst of 48 is queued at once: 32 can start at the next step, 16 wait, none refused.
    gate: list[StepGate] = []
    body = {"prompt": "burst", "max_tokens": 4, "ignore_eos": True}
    with (
        run_server(
            tiny_lm,
            engine_options={"max_batch_size": 32},
            driver_options={"max_waiting": 16},
            before_start=lambda e: gate.append(StepGate(e)),
        ) as live,
        ThreadPoolExecutor(48) as pool,
    ):
        url = live.url("/v1/completions")
        burst = [pool.submit(httpx.post, url, json=body, timeout=120) for _ in range(48)]
        wait_for(lambda: live.driver.stats().num_waiting == 48, what="the burst to queue")
        assert gate[0].entered.is_set()
        # One more is over the limit: 17 would wait for a slot.
        r = httpx.post(url, json=body, timeout=30)
        assert r.status_code == 429 and r.headers["retry-after"]
        assert r.json()["error"]["type"] == "rate_limit_error"
        gate[0].open()
        assert [f.result().status_code for f in burst] == [200] * 48
