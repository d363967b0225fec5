"""Backpressure and fair admission on a real server.

A client that opens a stream and never reads (a raw socket with a small receive buffer) gets its
requests paused in the engine once its unread output reaches the bound, not buffered, and
aborted with their blocks freed after the stall timeout. A burst on an idle server is never
refused while batch slots are free.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from server.http.app import ServerSettings
from tests.helpers.servers import StepGate, run_server


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


class EngineRecorder:
    """What the test reads of the engine, recorded on the engine thread (after each step and each
    pause) under a lock, so the test thread never reads state the engine thread is changing."""

    def __init__(self, engine: Any) -> None:
        self.lock = threading.Lock()
        self.live: dict[str, tuple[int, bool]] = {}  # id -> (output tokens, paused), latest
        self.paused_at: dict[str, int] | None = None  # output tokens when all were paused
        self.tokens_while_paused = 0  # tokens a step gave a request after that
        self.finish_reasons: dict[str, str | None] = {}
        self.stats = engine.stats()
        step, pause = engine.step, engine.pause

        def recorded_step():
            outs = step()
            with self.lock:
                for out in outs:
                    if self.paused_at is not None and out.request_id in self.paused_at:
                        self.tokens_while_paused += len(out.token_ids)
                    if out.finished:
                        self.finish_reasons[out.request_id] = out.finish_reason
                self._snapshot(engine)
            return outs

        def recorded_pause(request_id: str) -> None:
            pause(request_id)
            with self.lock:
                self._snapshot(engine)

        engine.step, engine.pause = recorded_step, recorded_pause

    def _snapshot(self, engine: Any) -> None:
        self.live = {r: (s.num_output_tokens, s.paused) for r, s in engine.requests.items()}
        if self.paused_at is None and self.live and all(p for _, p in self.live.values()):
            self.paused_at = {r: n for r, (n, _) in self.live.items()}
        self.stats = engine.stats()

    def read(self, what):
        with self.lock:
            return what(self)


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
    recorder: list[EngineRecorder] = []
    with run_server(
        tiny_lm,
        driver_options={"max_buffered_outputs": 4},
        settings=ServerSettings(stall_timeout=3.0),
        sndbuf=8192,
        before_start=lambda e: recorder.append(EngineRecorder(e)),
    ) as live:
        rec = recorder[0]
        sock = open_silent_stream(live.base_url, body)
        try:
            wait_for(lambda: rec.read(lambda r: r.paused_at), what="the requests to be paused")
            paused_at = rec.read(lambda r: dict(r.paused_at))
            assert len(paused_at) == 4
            assert max(paused_at.values()) < body["max_tokens"]  # paused well before the end
            # It serves others meanwhile: their steps pass the paused requests over.
            other = {"prompt": "hi", "max_tokens": 8, "ignore_eos": True}
            r = httpx.post(live.url("/v1/completions"), json=other, timeout=30)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
            # After the stall timeout the requests are aborted and every block is free.
            wait_for(
                lambda: rec.read(lambda r: set(r.finish_reasons) >= set(paused_at)),
                timeout=30,
                what="the stall abort",
            )
            reasons = rec.read(lambda r: {r.finish_reasons[i] for i in paused_at})
            assert reasons == {"abort"}
            # Paused means not scheduled: no step gave them a token from the pause to the abort.
            assert rec.read(lambda r: r.tokens_while_paused) == 0
            stats = rec.read(lambda r: r.stats)
            assert stats.num_free_blocks == stats.num_total_blocks
            # The server closed the connection: once the unread bytes are drained, EOF.
            sock.settimeout(10)
            while sock.recv(65536):
                pass
        finally:
            sock.close()
        # And after.
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
