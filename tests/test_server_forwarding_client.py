"""A second `EngineClient`, written only against the public seam, serves the whole API.

`ForwardingClient` stands in for a client that talks to a remote replica: requests leave through
the inner client's public `submit`/`abort`, every output crosses a "wire" (a pickle round trip,
so nothing is shared by reference), and its own `OutputStream` is fed through the stream's
public producer methods. It is served by a real uvicorn server, streamed and not.
"""

from __future__ import annotations

import asyncio
import json
import pickle
from collections.abc import Iterator, Sequence

import httpx
import pytest

from engine import EngineDeadError, EngineStats, Request
from server.engine_client.interface import EngineClient, EngineObserver, Health, OutputStream
from tests.helpers.servers import LiveServer, run_server, sse_events


def over_the_wire(obj):
    return pickle.loads(pickle.dumps(obj))


class ForwardingClient(EngineClient):
    def __init__(self, inner: EngineClient) -> None:
        self.inner = inner
        self.streams: dict[str, OutputStream] = {}
        self.pumps: set[asyncio.Task] = set()
        self.forwarded_outputs = 0
        self.aborts: list[str] = []

    @property
    def max_model_len(self) -> int:
        return self.inner.max_model_len

    @property
    def engine_name(self) -> str:
        return self.inner.engine_name

    async def start(self) -> None:
        await self.inner.start()

    async def stop(self, timeout: float = 30.0) -> None:
        for task in self.pumps:
            task.cancel()
        await self.inner.stop(timeout)

    async def submit(self, requests: Sequence[Request]) -> OutputStream:
        remote = await self.inner.submit([over_the_wire(r) for r in requests])
        mine = OutputStream([r.request_id for r in requests])
        for r in requests:
            self.streams[r.request_id] = mine
        task = asyncio.create_task(self._pump(remote, mine))
        self.pumps.add(task)
        task.add_done_callback(self.pumps.discard)
        return mine

    async def _pump(self, remote: OutputStream, mine: OutputStream) -> None:
        try:
            async for out in remote:
                self.forwarded_outputs += 1
                if out.finished:
                    self.streams.pop(out.request_id, None)
                mine.deliver(over_the_wire(out))
        except EngineDeadError as e:
            mine.fail(EngineDeadError(str(e)))

    def abort(self, request_id: str) -> None:
        self.aborts.append(request_id)
        stream = self.streams.pop(request_id, None)
        if stream is not None:
            stream.close(request_id)
        self.inner.abort(request_id)

    def health(self) -> Health:
        return self.inner.health()

    def stats(self) -> EngineStats:
        return self.inner.stats()

    def set_observer(self, observer: EngineObserver) -> None:
        self.inner.set_observer(observer)


BODY = {"model": "tinygpt", "prompt": "Forward me", "temperature": 0, "ignore_eos": True}
CHAT = {"model": "tinygpt", "messages": [{"role": "user", "content": "Hi"}], "temperature": 0}


@pytest.fixture(scope="module")
def forwarded(tiny_lm) -> Iterator[LiveServer]:
    with run_server(tiny_lm, wrap_client=ForwardingClient) as live:
        yield live


def post(live: LiveServer, path: str, body: dict) -> httpx.Response:
    r = httpx.post(live.url(path), json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r


def test_non_streamed_responses_match_the_in_process_driver(forwarded, server):
    assert isinstance(forwarded.client, ForwardingClient)
    before = forwarded.client.forwarded_outputs
    for path, body in (("/v1/completions", BODY), ("/v1/chat/completions", CHAT)):
        body = {**body, "max_tokens": 12, "n": 2}
        via_forwarder = post(forwarded, path, body).json()
        direct = post(server, path, body).json()
        assert via_forwarder["choices"] == direct["choices"]
        assert via_forwarder["usage"] == direct["usage"]
    assert forwarded.client.forwarded_outputs - before == 4 * 12


def test_streamed_completion_and_chat_concatenate_to_the_full_text(forwarded):
    full = post(forwarded, "/v1/completions", {**BODY, "max_tokens": 10}).json()
    body = {**BODY, "max_tokens": 10, "stream": True, "stream_options": {"include_usage": True}}
    payloads = sse_events(post(forwarded, "/v1/completions", body).text)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == full["choices"][0]["text"]
    assert chunks[-1]["usage"]["completion_tokens"] == 10

    full_chat = post(forwarded, "/v1/chat/completions", {**CHAT, "max_tokens": 10}).json()
    body = {**CHAT, "max_tokens": 10, "stream": True}
    chunks = [
        json.loads(p) for p in sse_events(post(forwarded, "/v1/chat/completions", body).text)[:-1]
    ]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == full_chat["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == full_chat["choices"][0]["finish_reason"]


def test_a_stop_string_aborts_through_the_forwarding_client(forwarded):
    full = post(forwarded, "/v1/completions", {**BODY, "max_tokens": 30}).json()
    text = full["choices"][0]["text"]
    stop = next(text[i : i + 2] for i in range(4, len(text) - 2) if text[i : i + 2].strip())
    body = {**BODY, "max_tokens": 30, "stop": [stop], "stream": True}
    chunks = [json.loads(p) for p in sse_events(post(forwarded, "/v1/completions", body).text)[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == text[: text.index(stop)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    # The stop string ended the request in the engine, through the forwarder's abort.
    assert forwarded.client.aborts[-1] == f"{chunks[0]['id']}-0"
