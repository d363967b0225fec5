"""`Client` and `AsyncClient`: small OpenAI-compatible HTTP clients, sync and async.

Owns the calls a user makes against any OpenAI-compatible server (ours, vLLM, llama-server):
listing models, completions and chat completions, whole or streamed as text deltas. Request bodies
and response parsing are shared module functions; the two classes differ only in how they do I/O.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx

from clients.protocol import (
    DEFAULT_BASE_URL,
    DONE,
    ClientError,
    SSEDecoder,
    auth_headers,
    chunk_text,
    error_from_body,
    normalize_base_url,
    parse_chunk,
)

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MODELS = "/v1/models"

Messages = list[dict[str, Any]]
Prompt = str | list[int]


def _model_ids(body: dict[str, Any]) -> list[str]:
    return [str(entry["id"]) for entry in body.get("data") or ()]


def _body(params: dict[str, Any], stream: bool, model: str) -> dict[str, Any]:
    body = {k: v for k, v in params.items() if v is not None}
    body.setdefault("model", model)
    body["stream"] = stream
    return body


def _raise_for_status(response: httpx.Response) -> None:
    # The body must already be read (it is for non-streamed responses; streamed ones call read()).
    if response.status_code >= 400:
        raise error_from_body(response.status_code, response.content, response.reason_phrase)


class Client:
    """Synchronous client. Use as a context manager, or call `close()`."""

    def __init__(
        self,
        base_url: str = DEFAULT_BASE_URL,
        api_key: str | None = None,
        timeout: float | None = 60.0,
    ) -> None:
        self._http = httpx.Client(
            base_url=normalize_base_url(base_url), headers=auth_headers(api_key), timeout=timeout
        )
        self._default_model: str | None = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def models(self) -> list[str]:
        """Ids of the models the server serves, in its order."""
        response = self._http.get(MODELS)
        _raise_for_status(response)
        return _model_ids(response.json())

    def complete(self, prompt: Prompt, **params: Any) -> dict[str, Any]:
        """POST /v1/completions and return the response body."""
        return self._post(COMPLETIONS, {"prompt": prompt, **params})

    def chat(self, messages: Messages, **params: Any) -> dict[str, Any]:
        """POST /v1/chat/completions and return the response body."""
        return self._post(CHAT, {"messages": messages, **params})

    def stream_complete(self, prompt: Prompt, **params: Any) -> Iterator[str]:
        """Stream a completion, yielding text deltas as they arrive."""
        return self._stream(COMPLETIONS, {"prompt": prompt, **params})

    def stream_chat(self, messages: Messages, **params: Any) -> Iterator[str]:
        """Stream a chat completion, yielding content deltas as they arrive."""
        return self._stream(CHAT, {"messages": messages, **params})

    def _model(self, params: dict[str, Any]) -> str:
        if params.get("model"):
            return str(params["model"])
        if self._default_model is None:
            ids = self.models()
            if not ids:
                raise ValueError("the server lists no models; pass model=...")
            self._default_model = ids[0]
        return self._default_model

    def _post(self, path: str, params: dict[str, Any]) -> dict[str, Any]:
        response = self._http.post(path, json=_body(params, False, self._model(params)))
        _raise_for_status(response)
        return response.json()

    def _stream(self, path: str, params: dict[str, Any]) -> Iterator[str]:
        body = _body(params, True, self._model(params))
        with self._http.stream("POST", path, json=body) as response:
            if response.status_code >= 400:
                response.read()
                _raise_for_status(response)
            decoder = SSEDecoder()
            for line in response.iter_lines():
                data = decoder.feed(line)
                if data is None:
                    continue
                if data == DONE:
                    return
                if text := chunk_text(parse_chunk(data)):
                    yield text
            # A stream cut short (server crash, proxy timeout) must not pass for a finished answer.
            if decoder.flush() != DONE:
                raise ClientError("stream ended before [DONE]")


class AsyncClient:
    """Asynchronous client. Use as an async context manager, or await `aclose()`."""

    def __init__(
        self,
        base_url: str = DEFAULT_BASE_URL,
        api_key: str | None = None,
        timeout: float | None = 60.0,
    ) -> None:
        self._http = httpx.AsyncClient(
            base_url=normalize_base_url(base_url), headers=auth_headers(api_key), timeout=timeout
        )
        self._default_model: str | None = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def models(self) -> list[str]:
        """Ids of the models the server serves, in its order."""
        response = await self._http.get(MODELS)
        _raise_for_status(response)
        return _model_ids(response.json())

    async def complete(self, prompt: Prompt, **params: Any) -> dict[str, Any]:
        """POST /v1/completions and return the response body."""
        return await self._post(COMPLETIONS, {"prompt": prompt, **params})

    async def chat(self, messages: Messages, **params: Any) -> dict[str, Any]:
        """POST /v1/chat/completions and return the response body."""
        return await self._post(CHAT, {"messages": messages, **params})

    def stream_complete(self, prompt: Prompt, **params: Any) -> AsyncIterator[str]:
        """Stream a completion, yielding text deltas as they arrive."""
        return self._stream(COMPLETIONS, {"prompt": prompt, **params})

    def stream_chat(self, messages: Messages, **params: Any) -> AsyncIterator[str]:
        """Stream a chat completion, yielding content deltas as they arrive."""
        return self._stream(CHAT, {"messages": messages, **params})

    async def _model(self, params: dict[str, Any]) -> str:
        if params.get("model"):
            return str(params["model"])
        if self._default_model is None:
            ids = await self.models()
            if not ids:
                raise ValueError("the server lists no models; pass model=...")
            self._default_model = ids[0]
        return self._default_model

    async def _post(self, path: str, params: dict[str, Any]) -> dict[str, Any]:
        body = _body(params, False, await self._model(params))
        response = await self._http.post(path, json=body)
        _raise_for_status(response)
        return response.json()

    async def _stream(self, path: str, params: dict[str, Any]) -> AsyncIterator[str]:
        body = _body(params, True, await self._model(params))
        async with self._http.stream("POST", path, json=body) as response:
            if response.status_code >= 400:
                await response.aread()
                _raise_for_status(response)
            decoder = SSEDecoder()
            async for line in response.aiter_lines():
                data = decoder.feed(line)
                if data is None:
                    continue
                if data == DONE:
                    return
                if text := chunk_text(parse_chunk(data)):
                    yield text
            if decoder.flush() != DONE:
                raise ClientError("stream ended before [DONE]")
