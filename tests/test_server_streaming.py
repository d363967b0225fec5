"""Streaming over a real socket: SSE framing, interleaving of concurrent streams, and clients that
disconnect (streamed or not) leaving no running request and no used KV block behind."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest

from tests.helpers.servers import (
    AbortRecorder,
    FirstOutputSignal,
    LiveServer,
    run_server,
    sse_events,
)

BODY = {"model": "tinygpt", "prompt": "Hello world", "temperature": 0, "ignore_eos": True}


def test_sse_frames_are_data_lines_with_finish_last_then_usage_then_done(server: LiveServer):
    body = {
        **BODY,
        "max_tokens": 6,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = httpx.post(server.url("/v1/completions"), json=body, timeout=30)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    payloads = sse_events(r.text)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == index]
        assert [c["finish_reason"] for c in mine] == [None] * (len(mine) - 1) + ["length"]


def test_every_generated_token_gets_a_chunk_even_without_text(server: LiveServer):
    # EOS decodes to no text; with ignore_eos the model is forced to emit it 5 times. Clients
    # (and the load generator's ITL) must still see one chunk per token, as vLLM streams them.
    eos = 257
    body = {**BODY, "max_tokens": 5, "stream": True, "logit_bias": {str(eos): 100}}
    r = httpx.post(server.url("/v1/completions"), json=body, timeout=30)
    chunks = [json.loads(p) for p in sse_events(r.text)[:-1]]
    assert len(chunks) == 5
    assert all(c["choices"][0]["text"] == "" for c in chunks)


def test_chat_stream_chunks_carry_only_new_text(server: LiveServer):
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 10,
        "temperature": 0,
        "ignore_eos": True,
    }
    full = httpx.post(server.url("/v1/chat/completions"), json=body, timeout=30).json()
    r = httpx.post(server.url("/v1/chat/completions"), json={**body, "stream": True}, timeout=30)
    chunks = [json.loads(p) for p in sse_events(r.text)[:-1]]
    deltas = [c["choices"][0]["delta"].get("content") or "" for c in chunks]
    assert "".join(deltas) == full["choices"][0]["message"]["content"]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


async def test_concurrent_streams_interleave(server: LiveServer):
    """Every stream has its first token before any stream has its last: they share steps."""
    n_streams, n_tokens = 6, 48
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    counts = dict.fromkeys(range(n_streams), 0)

    async def one(client: httpx.AsyncClient, i: int) -> None:
        body = {**BODY, "prompt": f"stream {i}", "max_tokens": n_tokens, "stream": True}
        async with client.stream("POST", server.url("/v1/completions"), json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    now = time.monotonic()
                    first.setdefault(i, now)
                    last[i] = now
                    counts[i] += 1

    async with httpx.AsyncClient(timeout=60) as client:
        await asyncio.gather(*(one(client, i) for i in range(n_streams)))
    assert max(first.values()) < min(last.values())
    assert all(c >= n_tokens // 2 for c in counts.values())  # byte tokens: a chunk per whole char


def _wait(event, timeout: float = 30) -> None:
    assert event.wait(timeout), "timed out"


def _assert_engine_idle(server: LiveServer) -> None:
    assert server.metric("cbserve_num_requests_running") == 0
    assert server.metric("cbserve_num_requests_waiting") == 0
    assert server.metric("cbserve_kv_cache_blocks_used") == 0


def test_client_dropping_a_stream_aborts_it_and_frees_its_blocks(
    server: LiveServer, abort_recorder: AbortRecorder
):
    body = {**BODY, "max_tokens": 1900, "stream": True}
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", server.url("/v1/completions"), json=body) as r,
    ):
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        assert server.metric("cbserve_kv_cache_blocks_used") > 0  # it is running now
    # Leaving the block closed the connection mid-stream.
    _wait(abort_recorder.event)
    assert abort_recorder.ids[0].startswith("cmpl-")
    _assert_engine_idle(server)


def test_client_dropping_a_non_streamed_request_aborts_it(
    server: LiveServer, abort_recorder: AbortRecorder
):
    started = FirstOutputSignal(server.engine)
    try:
        payload = json.dumps({**BODY, "max_tokens": 1900}).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n"
        ).encode()
        host, port = server.base_url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(head + payload)
            _wait(started.event)  # the engine is generating it
        _wait(abort_recorder.event)
    finally:
        started.remove()
    _assert_engine_idle(server)


def test_request_metrics_count_tokens_and_latencies(server: LiveServer):
    before = server.metric("cbserve_generation_tokens_total")
    r = httpx.post(server.url("/v1/completions"), json={**BODY, "max_tokens": 5}, timeout=30)
    assert r.status_code == 200
    assert server.metric("cbserve_generation_tokens_total") == before + 5
    text = httpx.get(server.url("/metrics"), timeout=10).text
    for name in (
        "cbserve_time_to_first_token_seconds_count",
        "cbserve_inter_token_latency_seconds_count",
        "cbserve_e2e_request_latency_seconds_count",
        "cbserve_request_queue_time_seconds_count",
        'cbserve_requests_total{endpoint="/v1/completions",status="200"}',
        "cbserve_num_preemptions_total",
        "cbserve_prompt_tokens_total",
    ):
        assert name in text, name


@pytest.mark.slow
def test_real_tokenizer_streams_the_same_text_and_stops_like_the_full_response(smollm2_lm):
    """SmolLM2's tokenizer (leading-space pieces, multi-byte characters, a real chat template):
    streamed deltas add up to the whole text, and EOS ends a chat turn without showing up."""
    body = {
        "messages": [{"role": "user", "content": "Say hello in French, then in Japanese."}],
        "max_tokens": 40,
        "temperature": 0,
    }
    with run_server(smollm2_lm, engine_options={"kv_cache_memory_gib": 0.1}) as live:
        full = httpx.post(live.url("/v1/chat/completions"), json=body, timeout=120).json()
        r = httpx.post(live.url("/v1/chat/completions"), json={**body, "stream": True}, timeout=120)
    text = full["choices"][0]["message"]["content"]
    chunks = [json.loads(p) for p in sse_events(r.text)[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == text
    assert text.strip() and "\ufffd" not in text and "<|im_end|>" not in text
    assert full["choices"][0]["finish_reason"] == chunks[-1]["choices"][0]["finish_reason"]


async def test_events_ready_together_are_one_write_and_nothing_waits_for_the_engine():
    """server.responses.per_step: events whose outputs were buffered together (a step's n
    choices) go out joined, in order; an event whose stream has nothing more buffered goes at
    once, and the tail after the end marker is flushed."""
    from types import SimpleNamespace

    from server.generation.sse import per_step

    stream = SimpleNamespace(num_buffered=0)
    gen = SimpleNamespace(stream=stream)
    # (event, outputs still buffered once it is produced)
    script = [("prologue ", 0), ("a0 ", 2), ("a1 ", 1), ("a2 ", 0), ("b0 ", 0), ("end ", 1)]

    async def events():
        for event, left in script:
            stream.num_buffered = left
            yield event
        yield "[DONE]"  # after the end the stream keeps its end marker buffered

    writes = [w async for w in per_step(gen, events())]
    assert writes == ["prologue ", "a0 a1 a2 ", "b0 ", "end [DONE]"]
