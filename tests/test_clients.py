"""clients/: the sync and async clients and the CLI against a fake OpenAI-like HTTP server.

The fake server below is a minimal Starlette app served by a real uvicorn on a loopback port (it
stands in for any external OpenAI-compatible server; httpx's ASGITransport would buffer streams).
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from clients import AsyncClient, Client, ClientError
from clients.__main__ import main as cli_main
from clients.protocol import SSEDecoder, chunk_text, error_from_body

MODEL = "fake-model"
PIECES = ["Hel", "lo", " world"]

# --- the fake server --------------------------------------------------------------------------


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    body = {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": param,
            "code": None,
        }
    }
    return JSONResponse(body, status_code=status)


def _sse(obj: object) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})


async def _handle(request: Request, chat: bool) -> Response:
    body = await request.json()
    request.app.state.seen.append({"body": body, "auth": request.headers.get("authorization")})
    if body.get("model") != MODEL:
        return _error(404, f"model {body.get('model')!r} not found", "model")
    if body.get("max_tokens", 1) < 1:
        return _error(400, "max_tokens must be at least 1", "max_tokens")
    prompt = body["messages"][-1]["content"] if chat else body["prompt"]

    def choice(piece: str) -> dict[str, object]:
        if chat:
            return {"index": 0, "delta": {"content": piece}, "finish_reason": None}
        return {"index": 0, "text": piece, "finish_reason": None}

    if not body.get("stream"):
        text = "".join(PIECES)
        answer = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
        return JSONResponse({"model": MODEL, "choices": [{"index": 0, **answer}]})

    async def events() -> AsyncIterator[str]:
        if chat:  # chat streams announce the role first, with no content
            yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        for i, piece in enumerate(PIECES):
            yield _sse({"choices": [choice(piece)]})
            if prompt == "fail midway" and i == 0:
                yield _sse({"error": {"message": "engine step failed", "type": "server_error"}})
                return
            if prompt == "cut short" and i == 0:
                return
        yield _sse({"choices": [], "usage": {"completion_tokens": len(PIECES)}})
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def _completions(request: Request) -> Response:
    return await _handle(request, chat=False)


async def _chat(request: Request) -> Response:
    return await _handle(request, chat=True)


def _app() -> Starlette:
    app = Starlette(
        routes=[
            Route("/v1/models", _models),
            Route("/v1/completions", _completions, methods=["POST"]),
            Route("/v1/chat/completions", _chat, methods=["POST"]),
        ]
    )
    app.state.seen = []
    return app


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, Starlette]]:
    app = _app()
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and
    # without it every response waits ~40 ms for a delayed ACK (Nagle), skewing all timings.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    # Listening before uvicorn starts means early connections wait in the backlog: no readiness poll.
    sock.listen(64)
    config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=1)
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", app
    uv.should_exit = True
    thread.join(timeout=5)
    sock.close()


@pytest.fixture
def url(server: tuple[str, Starlette]) -> str:
    server[1].state.seen.clear()
    return server[0]


@pytest.fixture
def seen(server: tuple[str, Starlette]) -> list[dict[str, object]]:
    return server[1].state.seen


# --- sync client ------------------------------------------------------------------------------


def test_models_lists_ids(url: str) -> None:
    with Client(url) as client:
        assert client.models() == [MODEL]


def test_complete_defaults_to_first_listed_model(url: str, seen: list) -> None:
    with Client(url) as client:
        body = client.complete("hi", max_tokens=3)
    assert body["choices"][0]["text"] == "Hello world"
    assert seen[-1]["body"]["model"] == MODEL
    assert seen[-1]["body"]["stream"] is False


def test_base_url_with_v1_suffix_is_accepted(url: str) -> None:
    with Client(url + "/v1/") as client:
        assert client.models() == [MODEL]


def test_api_key_is_sent_as_bearer_token(url: str, seen: list) -> None:
    with Client(url, api_key="sk-test") as client:
        client.complete("hi", model=MODEL)
    assert seen[-1]["auth"] == "Bearer sk-test"


def test_stream_complete_yields_text_deltas_in_order(url: str, seen: list) -> None:
    with Client(url) as client:
        assert list(client.stream_complete("hi", max_tokens=3)) == PIECES
    assert seen[-1]["body"]["stream"] is True


def test_stream_chat_yields_content_and_skips_role_chunk(url: str) -> None:
    with Client(url) as client:
        deltas = list(client.stream_chat([{"role": "user", "content": "hi"}]))
    assert deltas == PIECES


def test_chat_returns_message(url: str) -> None:
    with Client(url) as client:
        body = client.chat([{"role": "user", "content": "hi"}])
    assert body["choices"][0]["message"]["content"] == "Hello world"


def test_http_error_raises_client_error_with_server_message(url: str) -> None:
    with Client(url) as client, pytest.raises(ClientError) as info:
        client.complete("hi", max_tokens=0)
    err = info.value
    assert err.status == 400
    assert err.message == "max_tokens must be at least 1"
    assert err.type == "invalid_request_error"
    assert err.param == "max_tokens"
    assert "HTTP 400" in str(err)


def test_stream_http_error_raises_before_any_delta(url: str) -> None:
    with Client(url) as client, pytest.raises(ClientError) as info:
        list(client.stream_complete("hi", model="nope"))
    assert info.value.status == 404
    assert "'nope' not found" in info.value.message


def test_error_event_mid_stream_raises_after_first_delta(url: str) -> None:
    received: list[str] = []
    with Client(url) as client, pytest.raises(ClientError) as info:
        for delta in client.stream_complete("fail midway"):
            received.append(delta)
    assert received == ["Hel"]
    assert info.value.status is None
    assert info.value.message == "engine step failed"


def test_stream_cut_short_raises(url: str) -> None:
    with Client(url) as client, pytest.raises(ClientError, match=r"\[DONE\]"):
        list(client.stream_complete("cut short"))


# --- async client -----------------------------------------------------------------------------


async def test_async_client_streams_chat(url: str) -> None:
    async with AsyncClient(url) as client:
        assert await client.models() == [MODEL]
        deltas = [d async for d in client.stream_chat([{"role": "user", "content": "hi"}])]
    assert deltas == PIECES


async def test_async_client_complete_and_error_mapping(url: str) -> None:
    async with AsyncClient(url) as client:
        body = await client.complete("hi")
        assert body["choices"][0]["text"] == "Hello world"
        with pytest.raises(ClientError) as info:
            await client.chat([{"role": "user", "content": "hi"}], max_tokens=0)
    assert info.value.status == 400
    assert info.value.message == "max_tokens must be at least 1"


async def test_async_stream_error_event_raises(url: str) -> None:
    async with AsyncClient(url) as client:
        with pytest.raises(ClientError, match="engine step failed"):
            async for _ in client.stream_complete("fail midway"):
                pass


# --- CLI --------------------------------------------------------------------------------------


def test_cli_streams_chat_answer(url: str, seen: list, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["--base-url", url, "--max-tokens", "5", "hi"]) == 0
    assert capsys.readouterr().out == "Hello world\n"
    body = seen[-1]["body"]
    assert body["messages"] == [{"role": "user", "content": "hi"}]
    assert body["stream"] is True and body["max_tokens"] == 5


def test_cli_no_chat_no_stream_uses_completions(
    url: str, seen: list, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["--base-url", url, "--no-chat", "--no-stream", "hi"]) == 0
    assert capsys.readouterr().out == "Hello world\n"
    assert seen[-1]["body"]["prompt"] == "hi"
    assert seen[-1]["body"]["stream"] is False


def test_cli_reports_server_error_and_exits_1(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["--base-url", url, "--max-tokens", "0", "hi"]) == 1
    assert "max_tokens must be at least 1" in capsys.readouterr().err


# --- wire format ------------------------------------------------------------------------------


def test_sse_decoder_joins_data_lines_and_skips_comments() -> None:
    decoder = SSEDecoder()
    lines = [": ping", "event: message", 'data: {"a":', "data: 1}", "", "", "data:[DONE]"]
    events = [e for line in lines if (e := decoder.feed(line)) is not None]
    assert events == ['{"a":\n1}']
    assert decoder.flush() == "[DONE]"
    assert decoder.flush() is None


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('{"object": "error", "message": "old vllm", "type": "BadRequestError"}', "old vllm"),
        ('{"detail": "Not Found"}', "Not Found"),
        ("<html>bad gateway</html>", "<html>bad gateway</html>"),
        ('{"error": "plain"}', "plain"),
    ],
)
def test_error_bodies_of_other_shapes_keep_their_message(body: str, message: str) -> None:
    err = error_from_body(502, body)
    assert err.status == 502
    assert err.message == message


def test_chunk_text_reads_completion_and_chat_chunks() -> None:
    assert chunk_text({"choices": [{"text": "a"}]}) == "a"
    assert chunk_text({"choices": [{"delta": {"content": "b"}}]}) == "b"
    assert chunk_text({"choices": [{"delta": {"role": "assistant"}}]}) == ""
    assert chunk_text({"choices": [], "usage": {"completion_tokens": 3}}) == ""


def test_transport_error_is_not_swallowed() -> None:
    with socket.socket() as sock:  # a loopback port that was just free, so nothing listens on it
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with (
        Client(f"http://127.0.0.1:{port}", timeout=2) as client,
        pytest.raises(httpx.TransportError),
    ):
        client.models()


def test_carries_tokens_counts_token_chunks_not_role_finish_or_usage_chunks():
    from clients.protocol import carries_tokens

    assert carries_tokens({"choices": [{"text": "a", "finish_reason": None}]})
    assert carries_tokens({"choices": [{"text": "", "finish_reason": None}]})  # a special token
    assert carries_tokens({"choices": [{"text": "b", "finish_reason": "stop"}]})
    assert not carries_tokens({"choices": [{"text": "", "finish_reason": "length"}]})
    assert not carries_tokens({"choices": [{"delta": {"role": "assistant", "content": ""}}]})
    assert carries_tokens({"choices": [{"delta": {"content": ""}, "finish_reason": None}]})
    assert not carries_tokens({"choices": [], "usage": {"completion_tokens": 3}})
