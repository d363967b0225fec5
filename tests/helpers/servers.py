"""Real servers for end-to-end tests, and the hooks tests put into a live server's engine.

Servers run in-process (`uvicorn.Server` in a thread) on a socket bound to 127.0.0.1:0 before the
thread starts, so a client can connect at once: the kernel queues the connection until uvicorn
accepts it, and no test waits for startup by sleeping. httpx's ASGITransport is not used: it
buffers whole responses, which hides SSE timing, interleaving and disconnects.

The hooks (`StepGate`, `FirstOutputSignal`, `AbortRecorder`, `FailingStep`) wrap the real
engine's methods to make an instant deterministic ("a step is running", "a token was produced")
or to inject a fault; the engine itself is never replaced.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn

from engine import make_engine
from models import LoadedModel
from models.generation_config import model_generation_defaults
from server.engine_client.driver import AsyncEngineDriver
from server.engine_client.interface import EngineClient
from server.http.app import ServerSettings, create_app
from server.openai.protocol import ModelCard


def free_port() -> int:
    """A loopback port free at the moment of asking (for a server started in another process)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    base_url: str
    app: Any
    engine: Any
    driver: AsyncEngineDriver
    client: EngineClient  # what the app talks to: the driver, or a client wrapping it
    uvicorn_server: uvicorn.Server

    def url(self, path: str) -> str:
        return self.base_url + path

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"

    def metric(self, name: str) -> float:
        """One unlabelled sample from /metrics."""
        text = httpx.get(self.url("/metrics"), timeout=10).text
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{}"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)


@contextmanager
def run_server(
    lm: LoadedModel,
    *,
    engine_kind: str = "continuous",
    engine_options: dict | None = None,
    driver_options: dict | None = None,
    settings: ServerSettings | None = None,
    served_model_names: tuple[str, ...] | None = None,
    before_start: Callable[[Any], None] | None = None,
    wrap_client: Callable[[AsyncEngineDriver], EngineClient] | None = None,
    sndbuf: int | None = None,
    default_sampling_params: dict | None = None,
) -> Iterator[LiveServer]:
    """A real server on a free port. `default_sampling_params`: None takes the model's own, as
    `python -m server --generation-config auto` does (SmolLM2's preset, nothing for TinyGPT)."""
    options = {"max_batch_size": 8, "kv_cache_memory_gib": 0.05, **(engine_options or {})}
    engine = make_engine(engine_kind, lm.model, **options)
    if before_start is not None:
        before_start(engine)
    # One intra-op thread: the tests' client, the event loop and the step share two cores, and
    # oversubscribed OpenMP threads make steps 20x slower under load.
    driver = AsyncEngineDriver(engine, **{"num_threads": 1, **(driver_options or {})})
    client = driver if wrap_client is None else wrap_client(driver)
    card = ModelCard(
        names=served_model_names or (lm.name,),
        max_model_len=client.max_model_len,
        parameter_count=lm.num_parameters(),
        engine=client.engine_name,
        default_sampling_params=(
            model_generation_defaults(lm)
            if default_sampling_params is None
            else default_sampling_params
        ),
    )
    app = create_app(lm.tokenizer, card, client, settings)
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets whose protocol is TCP, and
    # a protocol-0 socket handed to uvicorn delays every small SSE write by ~40 ms (Nagle).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if sndbuf is not None:
        # Accepted connections inherit it: a fixed, small kernel send buffer (no autotuning to
        # megabytes), so a client that does not read pushes back on the server at once.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    live = LiveServer(f"http://127.0.0.1:{port}", app, engine, driver, client, server)
    try:
        # Blocks until uvicorn has run the lifespan and accepted the queued connection.
        assert httpx.get(live.url("/health"), timeout=30).status_code == 200
        yield live
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


class StepGate:
    """Holds engine steps at a gate the test opens: makes 'a step is running' deterministic."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.opened = threading.Event()
        self.entered = threading.Event()
        self._step = engine.step

        def gated_step():
            self.entered.set()
            if not self.opened.wait(timeout=30):
                raise TimeoutError("StepGate was never opened")
            return self._step()

        engine.step = gated_step

    def open(self) -> None:
        self.opened.set()

    def remove(self) -> None:
        self.engine.step = self._step
        self.opened.set()


class FirstOutputSignal:
    """Wraps engine.step to signal once a step has produced a token (a request is generating)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.event = threading.Event()
        self._step = engine.step

        def step():
            outs = self._step()
            if any(o.token_ids for o in outs):
                self.event.set()
            return outs

        engine.step = step

    def remove(self) -> None:
        self.engine.step = self._step


class AbortRecorder:
    """Wraps engine.abort to signal when a request id (or any id with a prefix) is aborted."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.ids: list[str] = []
        self.event = threading.Event()
        self._abort = engine.abort

        def abort(request_id: str) -> bool:
            live = self._abort(request_id)
            if live:
                self.ids.append(request_id)
                self.event.set()
            return live

        engine.abort = abort

    def remove(self) -> None:
        self.engine.abort = self._abort


class FailingStep:
    """Fault injection into the real engine: step() raises from its `fail_at`-th call on."""

    def __init__(self, engine, fail_at: int) -> None:
        self.calls = 0
        self.fail_at = fail_at
        self._step = engine.step
        engine.step = self

    def __call__(self):
        self.calls += 1
        if self.calls >= self.fail_at:
            raise RuntimeError("injected engine fault")
        return self._step()


def error_of(response: httpx.Response) -> dict:
    """The OpenAI error object of a response, checking its exact shape."""
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


def sse_events(raw: str) -> list[str]:
    """The data payloads of an SSE body, checking that every event is exactly `data: ...\\n\\n`."""
    assert raw.endswith("\n\n"), raw[-50:]
    events = raw.split("\n\n")[:-1]
    payloads = []
    for event in events:
        assert event.startswith("data: "), event
        assert "\n" not in event, event
        payloads.append(event[len("data: ") :])
    return payloads
