"""Response bodies: streamed SSE chunks and full JSON bodies, for completions and chat alike.

One streaming loop (`stream_body`) and one full-body builder (`full_body`) serve both endpoints;
what differs between them (object names, a choice's shape, what is sent before the first token,
logprobs in OpenAI's two shapes) is a `ResponseFormat`: `CompletionFormat` or `ChatFormat`.
Also here: SSE framing, `SSEResponse`, one write per engine step (`per_step`), a full body's
wait that a client's disconnect cancels (`until_disconnect`), and token text for logprobs
(`TokenText`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import torch
from starlette.requests import Request as HTTPRequest
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from engine import TokenLogprob
from models import Tokenizer
from server.errors import ClientDisconnected, api_error
from server.generation.text import Choice, Generation
from server.openai import echo
from server.openai.protocol import ModelCard

log = logging.getLogger("server.requests")

# JSON has no infinities; a token the sampler ruled out gets this floor, as vLLM does.
_LOGPROB_FLOOR = -9999.0

SSE_DONE = "data: [DONE]\n\n"

# (choice, text delta safe to send, that output's logprobs, how many tokens it carried)
Update = tuple[Choice, str, Sequence[TokenLogprob], int]


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def sse(obj: Any) -> str:
    return f"data: {dumps(obj)}\n\n"


def _clamp(logprob: float) -> float:
    return logprob if logprob > _LOGPROB_FLOOR else _LOGPROB_FLOOR  # also maps NaN to the floor


class TokenText:
    """A token's text and UTF-8 bytes for logprobs, cached per token id. A piece that is not whole
    UTF-8 on its own (one byte of a character) is shown as OpenAI does, `bytes:\\xNN`."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        raw = self.tokenizer.token_bytes(token_id)
        if raw is not None:
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            value = (text, list(raw))
        else:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            value = (text, list(text.encode("utf-8")))
        self._cache[token_id] = value
        return value

    def completion_logprobs(self, lps: Sequence[TokenLogprob], offset: int) -> dict[str, Any]:
        tokens, token_lps, tops, offsets = [], [], [], []
        for lp in lps:
            text = self(lp.token_id)[0]
            tokens.append(text)
            token_lps.append(_clamp(lp.logprob))
            top = {self(t)[0]: _clamp(v) for t, v in lp.top}
            top.setdefault(text, _clamp(lp.logprob))
            tops.append(top)
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def chat_logprobs(self, lps: Sequence[TokenLogprob], top_n: int | None) -> list[dict]:
        content = []
        for lp in lps:
            text, raw = self(lp.token_id)
            top = []
            for t, v in lp.top[: top_n or 0]:
                t_text, t_raw = self(t)
                top.append({"token": t_text, "logprob": _clamp(v), "bytes": t_raw})
            content.append(
                {"token": text, "logprob": _clamp(lp.logprob), "bytes": raw, "top_logprobs": top}
            )
        return content


class ResponseFormat:
    """What one endpoint's bodies look like; a fresh one per generation (it may keep state)."""

    object = ""  # of a full body
    chunk_object = ""  # of a streamed chunk
    usage_on_every_chunk = False  # chat: "usage": null on each chunk when usage is requested

    def __init__(self, gen: Generation, tokens: TokenText) -> None:
        self.gen = gen
        self.tokens = tokens

    def head(self, chunk: bool) -> dict[str, Any]:
        g = self.gen
        head: dict[str, Any] = {
            "id": g.id,
            "object": self.chunk_object if chunk else self.object,
            "created": g.created,
            "model": g.model,
        }
        if chunk and g.include_usage and self.usage_on_every_chunk:
            head["usage"] = None  # OpenAI's shape: null on every chunk but the usage chunk
        return head

    def prologue(self) -> list[dict[str, Any]]:
        """Choice entries streamed before any output."""
        return []

    def chunk_choice(self, c: Choice, delta: str, lps: Sequence[TokenLogprob]) -> dict[str, Any]:
        raise NotImplementedError

    def full_choice(self, c: Choice) -> dict[str, Any]:
        raise NotImplementedError


class CompletionFormat(ResponseFormat):
    object = chunk_object = "text_completion"

    def __init__(
        self, gen: Generation, tokens: TokenText, prompt_logprobs: int | None = None
    ) -> None:
        super().__init__(gen, tokens)
        self.offsets = {c.index: 0 for c in gen.choices}  # text_offset of each choice's next token
        self.prompt_logprobs = prompt_logprobs  # vLLM's field: top-N, None when not asked
        self.echoed: set[int] = set()  # choices whose echoed prompt logprobs were streamed

    @property
    def echo_logprobs(self) -> bool:
        """echo with logprobs: the prompt's logprobs come first (server.openai.echo)."""
        return self.gen.echo and self.gen.logprobs is not None

    def _prompt_part(self, c: Choice) -> dict[str, Any] | None:
        if not self.echo_logprobs or c.prompt_logprobs is None:
            return None
        ids = self.gen.prompts[c.prompt_index]
        return echo.prompt_part(self.tokens, ids, c.prompt_logprobs, self.gen.logprobs or 0)

    def _vllm_field(self, c: Choice) -> dict[str, Any]:
        if self.prompt_logprobs is None or c.prompt_logprobs is None:
            return {}
        plps = echo.vllm_prompt_logprobs(self.tokens, c.prompt_logprobs, self.prompt_logprobs)
        return {"prompt_logprobs": plps}

    def prologue(self) -> list[dict[str, Any]]:
        # With logprobs the echoed prompt goes with the first chunk, which has its logprobs.
        if not self.gen.echo or self.echo_logprobs:
            return []
        echoed = []
        for c in self.gen.choices:
            text = self.gen.prompt_texts[c.prompt_index]
            self.offsets[c.index] = len(text)
            echoed.append({"index": c.index, "text": text, "logprobs": None, "finish_reason": None})
        return echoed

    def chunk_choice(self, c: Choice, delta: str, lps: Sequence[TokenLogprob]) -> dict[str, Any]:
        first = c.index not in self.echoed
        self.echoed.add(c.index)
        prompt = self._prompt_part(c) if first else None
        if prompt is not None:
            delta = self.gen.prompt_texts[c.prompt_index] + delta
            self.offsets[c.index] = echo.prompt_text_length(prompt)
        lp = None
        if self.gen.logprobs is not None:
            lp = self.tokens.completion_logprobs(lps, self.offsets[c.index])
            self.offsets[c.index] += sum(len(t) for t in lp["tokens"])
            if prompt is not None:
                lp = echo.joined(prompt, lp)
        extra = self._vllm_field(c) if first else {}
        return {
            "index": c.index,
            "text": delta,
            "logprobs": lp,
            "finish_reason": c.finish_reason,
            **extra,
        }

    def full_choice(self, c: Choice) -> dict[str, Any]:
        prefix = self.gen.prompt_texts[c.prompt_index] if self.gen.echo else ""
        prompt = self._prompt_part(c)
        lp = None
        if self.gen.logprobs is not None:
            start = len(prefix) if prompt is None else echo.prompt_text_length(prompt)
            lp = self.tokens.completion_logprobs(c.logprobs, start)
            if prompt is not None:
                lp = echo.joined(prompt, lp)
        return {
            "index": c.index,
            "text": prefix + c.text,
            "logprobs": lp,
            "finish_reason": c.finish_reason,
            "stop_reason": None,
            **self._vllm_field(c),
        }


class ChatFormat(ResponseFormat):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    usage_on_every_chunk = True

    def prologue(self) -> list[dict[str, Any]]:
        # The role comes first, before any content, as OpenAI sends it.
        role = {"role": "assistant", "content": ""}
        return [
            {"index": c.index, "delta": role, "logprobs": None, "finish_reason": None}
            for c in self.gen.choices
        ]

    def _logprobs(self, lps: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        if self.gen.logprobs is None:
            return None
        return {"content": self.tokens.chat_logprobs(lps, self.gen.logprobs)}

    def chunk_choice(self, c: Choice, delta: str, lps: Sequence[TokenLogprob]) -> dict[str, Any]:
        return {
            "index": c.index,
            "delta": {"content": delta} if delta else {},
            "logprobs": self._logprobs(lps),
            "finish_reason": c.finish_reason,
        }

    def full_choice(self, c: Choice) -> dict[str, Any]:
        return {
            "index": c.index,
            "message": {"role": "assistant", "content": c.text},
            "logprobs": self._logprobs(c.logprobs),
            "finish_reason": c.finish_reason,
        }


async def stream_body(fmt: ResponseFormat, updates: AsyncIterator[Update]) -> AsyncIterator[str]:
    """The SSE events of a streamed response: prologue, a chunk per output that carried a token
    or ended a choice, the usage chunk if asked for, an error event if generation failed, then
    [DONE]."""
    gen = fmt.gen
    head = fmt.head(chunk=True)
    try:
        for choice in fmt.prologue():
            yield sse({**head, "choices": [choice]})
        async for c, delta, lps, new_tokens in updates:
            # A chunk for every step that produced a token, even when its text is empty (a
            # special token, half a character, text held for a stop string): clients see each
            # token's timing, as vLLM streams it. Only token-less outputs are skipped.
            if not delta and not c.finished and not new_tokens:
                continue
            yield sse({**head, "choices": [fmt.chunk_choice(c, delta, lps)]})
        if gen.include_usage:
            yield sse({**head, "choices": [], "usage": gen.usage()})
    except Exception as e:
        yield sse(api_error(e, gen.id).body())
    yield SSE_DONE


def full_body(fmt: ResponseFormat) -> dict[str, Any]:
    """The JSON body of a non-streamed response, once every choice has finished."""
    gen = fmt.gen
    return {
        **fmt.head(chunk=False),
        "choices": [fmt.full_choice(c) for c in gen.choices],
        "usage": gen.usage(),
    }


def models_body(card: ModelCard) -> dict[str, Any]:
    """/v1/models: one entry per name the model is served under."""
    data = [
        {
            "id": name,
            "object": "model",
            "created": card.created,
            "owned_by": "cbserve",
            "root": card.name,
            "parent": None,
            "max_model_len": card.max_model_len,
            "parameter_count": card.parameter_count,
            "torch_version": torch.__version__,
            "engine": card.engine,
            # What a request gets for the sampling fields it leaves out (vLLM logs these; we
            # show them): the model's generation config or preset, amended by the CLI.
            "default_sampling_params": dict(card.default_sampling_params),
        }
        for name in card.names
    ]
    return {"object": "list", "data": data}


class _Stalled(Exception):
    """A write to the client did not complete within the stall timeout."""


class SSEResponse(StreamingResponse):
    """`text/event-stream` whose generator is always closed, so its cleanup (aborting the
    engine requests) runs however the response ends: finished, client gone, or cancelled.

    With `stall_timeout`, a client that reads nothing for that long (one write stays blocked:
    the socket's buffers are full) has its response given up and its connection closed; the
    cleanup then aborts its engine requests and frees their blocks. Until then the engine
    has paused them (the output stream's bound), so nothing piles up meanwhile.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        content: AsyncIterator[str],
        on_close: Callable[[], None],
        stall_timeout: float | None = None,
    ) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close
        self.stall_timeout = stall_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.stall_timeout is not None:
            send = self._bounded(send, self.stall_timeout)
        try:
            await super().__call__(scope, receive, send)
        except _Stalled:
            # Returning with the response incomplete makes the server close the connection.
            log.warning("client read nothing for %gs: stream given up", self.stall_timeout)
        finally:
            # A generator cancelled between two chunks, or never started, runs no cleanup of its
            # own; closing it and calling on_close makes sure the engine requests end here.
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(RuntimeError):
                    await aclose()
            self.on_close()

    @staticmethod
    def _bounded(send: Send, timeout: float) -> Send:
        async def bounded_send(message: Any) -> None:
            try:
                async with asyncio.timeout(timeout):
                    await send(message)
            except TimeoutError:
                raise _Stalled() from None

        return bounded_send


# -- how a response rides its connection ------------------------------------------------------------


async def per_step(gen: Generation, events: AsyncIterator[str]) -> AsyncIterator[str]:
    """`events` joined into one write per batch of engine outputs that are ready together.

    The driver hands over a step's outputs at once, so the n choices (x prompts) of one request
    arrive together; sent one by one, each is its own trip through the ASGI send, h11 and a
    socket write on the event loop, which the step thread's Python then waits on for the GIL
    (a 64-choice hog made a short request's parsing and first write, and its own step, slower).
    Joined, it is one write per step. Same bytes in the same order; an event is held only
    while the next output is already buffered (`num_buffered`), so nothing waits for the
    engine (after the end the stream keeps its end marker buffered: the tail is one write)."""
    batch: list[str] = []
    async for event in events:
        batch.append(event)
        if gen.stream is None or gen.stream.num_buffered == 0:
            yield "".join(batch)
            batch.clear()
    if batch:
        yield "".join(batch)


async def until_disconnect(http: HTTPRequest, work: Awaitable[Response]) -> Response:
    """Run a non-streamed request, cancelling it (and so aborting its choices) if the client
    disconnects: there is no write to fail on, so listen for the disconnect message."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(http.receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        watcher.cancel()
    if task in done:
        return task.result()
    raise ClientDisconnected()


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
