"""The text edge of the server: OpenAI requests in, engine requests out, and text back.

Owns everything between a validated request body and the bytes of the response: prompts and chat
templates to token ids, request fields to `SamplingParams`, incremental detokenization, stop
strings (a match truncates the text before it and aborts the request in the engine), logprobs in
OpenAI's two shapes, usage counted from token ids, response bodies, SSE chunks, per-request
metrics and the one log line per request. It talks to the engine only through `EngineClient`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jinja2
import torch
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from engine import EngineDeadError, Request, SamplingParams, StepOutput, TokenLogprob
from models import IncrementalDetokenizer, Tokenizer
from server.driver import EngineClient, OutputStream, QueueFullError
from server.metrics import ServerMetrics
from server.protocol import (
    MAX_CHOICES,
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
    error_body,
)

log = logging.getLogger("server.requests")

# JSON has no infinities; a token the sampler ruled out gets this floor, as vLLM does.
_LOGPROB_FLOOR = -9999.0
_SAMPLING_FIELDS = frozenset(SamplingParams.__dataclass_fields__)


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def sse(obj: Any) -> str:
    return f"data: {dumps(obj)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class ClientDisconnected(Exception):
    """The client went away before its (non-streamed) response was ready."""


@dataclass(frozen=True, slots=True)
class ModelCard:
    """What the API says about the served model."""

    names: tuple[str, ...]  # the first is the one responses carry
    max_model_len: int
    parameter_count: int
    engine: str
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def name(self) -> str:
        return self.names[0]


# --------------------------------------------------------------------------------------------------
# One generated sequence (an OpenAI "choice", an engine request)
# --------------------------------------------------------------------------------------------------


class Choice:
    """Text state of one choice: detokenizer, stop strings, what has been streamed, timings."""

    __slots__ = (
        "index",
        "request_id",
        "prompt_index",
        "detok",
        "stops",
        "hold",
        "stop_ids",
        "text",
        "sent",
        "num_tokens",
        "num_cached_tokens",
        "logprobs",
        "finish_reason",
        "first_time",
        "last_time",
    )

    def __init__(
        self,
        index: int,
        request_id: str,
        prompt_index: int,
        tokenizer: Tokenizer,
        prompt_ids: list[int],
        stops: Sequence[str],
        stop_ids: frozenset[int],
    ) -> None:
        self.index = index
        self.request_id = request_id
        self.prompt_index = prompt_index
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.stops = tuple(stops)
        # Streamed text stays this many characters behind, so a stop string that is still being
        # generated is never sent before it is recognised.
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.stop_ids = stop_ids
        self.text = ""
        self.sent = 0
        self.num_tokens = 0
        self.num_cached_tokens = 0
        self.logprobs: list[TokenLogprob] = []
        self.finish_reason: str | None = None
        self.first_time: float | None = None
        self.last_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, out: StepOutput) -> bool:
        """Take one step's output. True if a stop string ended the choice (abort it in the engine)."""
        ids = out.token_ids
        self.num_tokens += len(ids)
        self.num_cached_tokens = out.num_cached_tokens
        if out.logprobs:
            self.logprobs.extend(out.logprobs)
        text_ids = ids
        if out.finish_reason == "stop" and ids and ids[-1] in self.stop_ids:
            text_ids = ids[:-1]  # EOS / stop_token_ids end the text; they are not part of it
        delta = self.detok.add(text_ids) if text_ids else ""
        if out.finished:
            delta += self.detok.flush()
        if delta:
            search_from = max(len(self.text) - self.hold, 0)
            self.text += delta
            cut = self._find_stop(search_from)
            if cut is not None:
                self.text = self.text[:cut]
                self.finish_reason = "stop"
                return not out.finished
        if out.finished:
            self.finish_reason = out.finish_reason or "stop"
        return False

    def _find_stop(self, start: int) -> int | None:
        best: int | None = None
        for s in self.stops:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best):
                best = i
        return best

    def take_delta(self) -> str:
        """Text that is safe to stream now (all of it once finished)."""
        end = len(self.text) if self.finished else max(len(self.text) - self.hold, self.sent)
        delta = self.text[self.sent : end]
        self.sent = end
        return delta


@dataclass(slots=True)
class Generation:
    """One HTTP generation request: its engine requests, choices and usage."""

    kind: str  # "completion" | "chat"
    id: str
    model: str
    created: int
    arrival: float
    prompts: list[list[int]]
    prompt_texts: list[str]
    choices: list[Choice]
    include_usage: bool = False
    echo: bool = False
    logprobs: int | None = None  # top-N, None when not requested
    stream: OutputStream | None = None
    by_request: dict[str, Choice] = field(default_factory=dict)
    status: str = "ok"
    done: bool = False

    def usage(self) -> dict:
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(c.num_tokens for c in self.choices)
        # Prompt tokens served from the prefix cache, once per prompt (n choices share it).
        cached = sum(
            max((c.num_cached_tokens for c in self.choices if c.prompt_index == i), default=0)
            for i in range(len(self.prompts))
        )
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }


# --------------------------------------------------------------------------------------------------
# The serving object the routes call
# --------------------------------------------------------------------------------------------------


class OpenAIServing:
    def __init__(
        self,
        client: EngineClient,
        tokenizer: Tokenizer,
        card: ModelCard,
        metrics: ServerMetrics | None = None,
        *,
        log_prompts: bool = False,
    ) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.card = card
        self.metrics = metrics
        self.log_prompts = log_prompts
        self.vocab_size = tokenizer.vocab_size
        self._token_text: dict[int, tuple[str, list[int]]] = {}

    # -- public entry points -------------------------------------------------------------------------

    def models(self) -> dict[str, Any]:
        c = self.card
        data = [
            {
                "id": name,
                "object": "model",
                "created": c.created,
                "owned_by": "cbserve",
                "root": c.name,
                "parent": None,
                "max_model_len": c.max_model_len,
                "parameter_count": c.parameter_count,
                "torch_version": torch.__version__,
                "engine": c.engine,
            }
            for name in c.names
        ]
        return {"object": "list", "data": data}

    async def completions(self, req: CompletionRequest, http: HTTPRequest) -> Response:
        arrival = time.monotonic()
        model = self._check_model(req.model)
        if req.suffix is not None:
            raise APIError(400, "suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of > 1:
            raise APIError(
                400, "best_of > 1 is not supported; use n for several choices", param="best_of"
            )
        if req.echo and req.logprobs is not None:
            raise APIError(
                400,
                "echo with logprobs is not supported (prompt logprobs are not computed)",
                param="echo",
            )
        prompts: list[list[int]] = []
        texts: list[str] = []
        for p in req.prompts:
            if isinstance(p, str):
                prompts.append(self.tokenizer.encode(p, add_special_tokens=True))
                texts.append(p)
            else:
                self._check_token_ids(p, "prompt")
                prompts.append(list(p))
                texts.append(self.tokenizer.decode(list(p)) if req.echo else "")
            if not prompts[-1]:
                raise APIError(
                    400, "prompt must not be empty (it encodes to no tokens)", param="prompt"
                )
        gen = Generation(
            "completion",
            f"cmpl-{uuid.uuid4().hex}",
            model,
            int(time.time()),
            arrival,
            prompts,
            texts,
            [],
            include_usage=req.include_usage,
            echo=req.echo,
            logprobs=req.logprobs,
        )
        self._log_prompt(gen, texts)
        requests = self._engine_requests(gen, req, req.max_tokens or 16, req.logprobs)
        if req.stream:
            await self._submit(gen, requests)
            return SSEResponse(self._stream_completion(gen), on_close=lambda: self._finish(gen))
        return await self._until_disconnect(http, self._full_completion(gen, requests))

    async def chat(self, req: ChatCompletionRequest, http: HTTPRequest) -> Response:
        arrival = time.monotonic()
        model = self._check_model(req.model)
        if req.tools:
            raise APIError(400, "tools are not supported", param="tools")
        text = self._render_chat(req.messages, req.add_generation_prompt)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise APIError(400, "the rendered chat prompt is empty", param="messages")
        gen = Generation(
            "chat",
            f"chatcmpl-{uuid.uuid4().hex}",
            model,
            int(time.time()),
            arrival,
            [ids],
            [text],
            [],
            include_usage=req.include_usage,
            logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        )
        self._log_prompt(gen, [text])
        max_tokens = req.max_completion_tokens or req.max_tokens
        if max_tokens is None:  # vLLM's default: whatever context the prompt leaves
            max_tokens = self.card.max_model_len - len(ids)
            if max_tokens < 1:
                raise self._too_long(len(ids), 1)
        requests = self._engine_requests(gen, req, max_tokens, gen.logprobs)
        if req.stream:
            await self._submit(gen, requests)
            return SSEResponse(self._stream_chat(gen), on_close=lambda: self._finish(gen))
        return await self._until_disconnect(http, self._full_chat(gen, requests))

    def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        self._check_model(req.model)
        if req.messages is not None:
            text = self._render_chat(req.messages, req.add_generation_prompt)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = self.tokenizer.encode(req.prompt or "", add_special_tokens=req.add_special_tokens)
        return {"count": len(ids), "max_model_len": self.card.max_model_len, "tokens": ids}

    def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        self._check_model(req.model)
        self._check_token_ids(req.tokens, "tokens")
        return {"prompt": self.tokenizer.decode(req.tokens)}

    # -- request -> engine -------------------------------------------------------------------------------

    def _check_model(self, name: str | None) -> str:
        if name is not None and name not in self.card.names:
            raise APIError(
                404, f"The model `{name}` does not exist.", param="model", code="model_not_found"
            )
        return self.card.name

    def _check_token_ids(self, ids: Sequence[int], param: str) -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(
                400,
                f"{param} contains token id {bad}, outside the vocabulary [0, {self.vocab_size})",
                param=param,
            )

    def _render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool) -> str:
        if not self.tokenizer.chat_template:
            raise APIError(
                400, "this model has no chat template; use /v1/completions", param="messages"
            )
        dicts = []
        for m in messages:
            d: dict[str, Any] = {"role": m.role, "content": m.text()}
            if m.name is not None:
                d["name"] = m.name
            dicts.append(d)
        try:
            return self.tokenizer.apply_chat_template(
                dicts, add_generation_prompt=add_generation_prompt
            )
        except (jinja2.TemplateError, ValueError) as e:  # e.g. roles out of order
            raise APIError(
                400, f"the chat template rejected the messages: {e}", param="messages"
            ) from e

    def _too_long(self, prompt_len: int, max_tokens: int) -> APIError:
        limit = self.card.max_model_len
        return APIError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
            f"completion). Please reduce the prompt or max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )

    def _sampling_params(
        self, req: SamplingFields, max_tokens: int, logprobs: int | None, seed: int | None
    ) -> SamplingParams:
        bias: list[tuple[int, float]] = []
        for key, value in (req.logit_bias or {}).items():
            try:
                tok = int(key)
            except ValueError:
                raise APIError(
                    400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
                ) from None
            if not 0 <= tok < self.vocab_size:
                raise APIError(
                    400, f"logit_bias token id {tok} is outside the vocabulary", param="logit_bias"
                )
            if not math.isfinite(value):
                raise APIError(400, "logit_bias values must be finite", param="logit_bias")
            bias.append((tok, float(value)))
        stop_ids = tuple(req.stop_token_ids or ())
        self._check_token_ids(stop_ids, "stop_token_ids")
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                # OpenAI / vLLM spell "off" -1 (and 0); the engine spells it None.
                top_k=None if req.top_k in (None, 0, -1) else req.top_k,
                top_p=1.0 if req.top_p is None else req.top_p,
                min_p=0.0 if req.min_p is None else req.min_p,
                repetition_penalty=1.0
                if req.repetition_penalty is None
                else req.repetition_penalty,
                presence_penalty=0.0 if req.presence_penalty is None else req.presence_penalty,
                frequency_penalty=0.0 if req.frequency_penalty is None else req.frequency_penalty,
                stop_token_ids=stop_ids,
                ignore_eos=req.ignore_eos,
                min_tokens=req.min_tokens,
                logprobs=logprobs,
                seed=seed,
                logit_bias=tuple(bias),
            )
        except ValueError as e:  # SamplingParams names the field first
            name = str(e).split(" ", 1)[0]
            raise APIError(400, str(e), param=name if name in _SAMPLING_FIELDS else None) from None

    def _engine_requests(
        self, gen: Generation, req: SamplingFields, max_tokens: int, logprobs: int | None
    ) -> list[Request]:
        n = req.n
        if len(gen.prompts) * n > MAX_CHOICES:
            raise APIError(
                400,
                f"prompts x n may be at most {MAX_CHOICES}, got {len(gen.prompts) * n}",
                param="n",
            )
        for ids in gen.prompts:
            if len(ids) + max_tokens > self.card.max_model_len:
                raise self._too_long(len(ids), max_tokens)
        # Choice j of every prompt samples with seed + j (as vLLM does for n > 1): reproducible,
        # and the n choices differ from one another.
        params = [
            self._sampling_params(
                req, max_tokens, logprobs, None if req.seed is None else req.seed + j
            )
            for j in range(n)
        ]
        eos = () if req.ignore_eos else tuple(self.tokenizer.eos_token_ids)
        stop_ids = frozenset(eos) | frozenset(req.stop_token_ids or ())
        requests = []
        for p, ids in enumerate(gen.prompts):
            for j in range(n):
                index = p * n + j
                rid = f"{gen.id}-{index}"
                choice = Choice(index, rid, p, self.tokenizer, ids, req.stop_strings, stop_ids)
                gen.choices.append(choice)
                gen.by_request[rid] = choice
                requests.append(
                    Request(list(ids), params[j], request_id=rid, arrival_time=gen.arrival)
                )
        return requests

    async def _submit(self, gen: Generation, requests: list[Request]) -> None:
        try:
            gen.stream = await self.client.submit(requests)
        except QueueFullError as e:
            raise APIError(
                429,
                str(e),
                type="rate_limit_error",
                code="rate_limit_exceeded",
                headers={"Retry-After": "1"},
            ) from None
        except EngineDeadError as e:
            raise APIError(503, str(e), type="server_error", code="engine_unavailable") from None
        except ValueError as e:  # the engine's own checks (RequestTooLongError: the KV pool)
            raise APIError(400, str(e)) from None
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(sum(len(r.prompt_token_ids) for r in requests))

    # -- the generation loop, shared by all four response shapes ---------------------------------------

    async def _outputs(
        self, gen: Generation
    ) -> AsyncIterator[tuple[Choice, str, list[TokenLogprob], int]]:
        """(choice, text delta to send, new logprobs, new token count) per engine output, until
        all choices end."""
        assert gen.stream is not None
        try:
            async for out in gen.stream:
                c = gen.by_request[out.request_id]
                if c.finished:
                    continue  # queued before a stop string ended it
                self._observe(gen, c, out)
                if c.update(out):  # a stop string: end it in the engine now
                    self.client.abort(c.request_id)
                if c.finished and self.metrics is not None:
                    self.metrics.finished.labels(c.finish_reason).inc()
                yield c, c.take_delta(), out.logprobs or [], len(out.token_ids)
        except EngineDeadError:
            gen.status = "engine_error"
            raise
        except BaseException:  # cancelled: the client disconnected, or the server is stopping
            gen.status = "aborted"
            raise
        finally:
            self._finish(gen)

    def _finish(self, gen: Generation) -> None:
        """Abort whatever is still open and log the request. Idempotent."""
        if gen.done:
            return
        gen.done = True
        if gen.stream is not None:
            for rid in gen.stream.open_request_ids:
                self.client.abort(rid)
        for c in gen.choices:
            if not c.finished:
                c.finish_reason = "abort"
                if gen.status == "ok":
                    gen.status = "aborted"
                if self.metrics is not None:
                    self.metrics.finished.labels("abort").inc()
        self._log_done(gen)

    def _observe(self, gen: Generation, c: Choice, out: StepOutput) -> None:
        now = time.monotonic()
        m = self.metrics
        if m is not None:
            m.generation_tokens.inc(len(out.token_ids))
            if c.first_time is None:
                m.ttft.observe(now - gen.arrival)
            elif c.last_time is not None:
                m.itl.observe(now - c.last_time)
            if out.finished:
                m.e2e.observe(now - gen.arrival)
        if c.first_time is None:
            c.first_time = now
        c.last_time = now

    async def _until_disconnect(self, http: HTTPRequest, work) -> Response:
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

    # -- non-streamed responses --------------------------------------------------------------------------

    async def _collect(self, gen: Generation, requests: list[Request]) -> None:
        await self._submit(gen, requests)
        try:
            async for _ in self._outputs(gen):
                pass
        except EngineDeadError as e:
            raise APIError(
                500, f"generation failed: {e}", type="server_error", code="engine_error"
            ) from None

    async def _full_completion(self, gen: Generation, requests: list[Request]) -> Response:
        await self._collect(gen, requests)
        choices = []
        for c in gen.choices:
            prefix = gen.prompt_texts[c.prompt_index] if gen.echo else ""
            choices.append(
                {
                    "index": c.index,
                    "text": prefix + c.text,
                    "logprobs": self._completion_logprobs(c.logprobs, len(prefix))
                    if gen.logprobs is not None
                    else None,
                    "finish_reason": c.finish_reason,
                    "stop_reason": None,
                }
            )
        body = {
            "id": gen.id,
            "object": "text_completion",
            "created": gen.created,
            "model": gen.model,
            "choices": choices,
            "usage": gen.usage(),
        }
        return JSONResponse(body)

    async def _full_chat(self, gen: Generation, requests: list[Request]) -> Response:
        await self._collect(gen, requests)
        choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": {"content": self._chat_logprobs(c.logprobs, gen.logprobs)}
                if gen.logprobs is not None
                else None,
                "finish_reason": c.finish_reason,
            }
            for c in gen.choices
        ]
        body = {
            "id": gen.id,
            "object": "chat.completion",
            "created": gen.created,
            "model": gen.model,
            "choices": choices,
            "usage": gen.usage(),
        }
        return JSONResponse(body)

    # -- streamed responses -------------------------------------------------------------------------------

    async def _stream_completion(self, gen: Generation) -> AsyncIterator[str]:
        head = {
            "id": gen.id,
            "object": "text_completion",
            "created": gen.created,
            "model": gen.model,
        }

        def chunk(index: int, text: str, logprobs: Any, finish: str | None) -> str:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
            return sse({**head, "choices": [choice]})

        offsets = {c.index: 0 for c in gen.choices}
        try:
            if gen.echo:
                for c in gen.choices:
                    text = gen.prompt_texts[c.prompt_index]
                    offsets[c.index] = len(text)
                    yield chunk(c.index, text, None, None)
            async for c, delta, lps, new_tokens in self._outputs(gen):
                # A chunk for every step that produced a token, even when its text is empty
                # (a special token, half a character, text held for a stop string): clients see
                # each token's timing, as vLLM streams it. Only token-less outputs are skipped.
                if not delta and not c.finished and not new_tokens:
                    continue
                lp = None
                if gen.logprobs is not None:
                    lp = self._completion_logprobs(lps, offsets[c.index])
                    offsets[c.index] += sum(len(t) for t in lp["tokens"])
                yield chunk(c.index, delta, lp, c.finish_reason)
            if gen.include_usage:
                yield sse({**head, "choices": [], "usage": gen.usage()})
        except Exception as e:
            yield self._stream_error(e)
        yield SSE_DONE

    async def _stream_chat(self, gen: Generation) -> AsyncIterator[str]:
        head: dict[str, Any] = {
            "id": gen.id,
            "object": "chat.completion.chunk",
            "created": gen.created,
            "model": gen.model,
        }
        if gen.include_usage:
            head["usage"] = None  # OpenAI's shape: null on every chunk but the usage chunk

        def chunk(index: int, delta: dict, logprobs: Any, finish: str | None) -> str:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            return sse({**head, "choices": [choice]})

        try:
            for c in gen.choices:  # the role comes first, before any content, as OpenAI sends it
                yield chunk(c.index, {"role": "assistant", "content": ""}, None, None)
            async for c, delta, lps, new_tokens in self._outputs(gen):
                if not delta and not c.finished and not new_tokens:
                    continue
                lp = None
                if gen.logprobs is not None:
                    lp = {"content": self._chat_logprobs(lps, gen.logprobs)}
                yield chunk(c.index, {"content": delta} if delta else {}, lp, c.finish_reason)
            if gen.include_usage:
                yield sse({**head, "choices": [], "usage": gen.usage()})
        except Exception as e:
            yield self._stream_error(e)
        yield SSE_DONE

    def _stream_error(self, e: Exception) -> str:
        if isinstance(e, EngineDeadError):
            return sse(error_body(f"generation failed: {e}", "server_error", None, "engine_error"))
        log.exception("error while streaming", exc_info=e)
        return sse(error_body(f"internal error: {e!r}", "server_error", None, "internal_error"))

    # -- logprobs ----------------------------------------------------------------------------------------

    def _token(self, token_id: int) -> tuple[str, list[int]]:
        """A token's text and UTF-8 bytes for logprobs. A piece that is not whole UTF-8 on its own
        (one byte of a character) is shown as OpenAI does, `bytes:\\xNN`."""
        hit = self._token_text.get(token_id)
        if hit is not None:
            return hit
        raw = _token_bytes(self.tokenizer, token_id)
        if raw is not None:
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            value = (text, list(raw))
        else:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            value = (text, list(text.encode("utf-8")))
        self._token_text[token_id] = value
        return value

    def _completion_logprobs(self, lps: Sequence[TokenLogprob], offset: int) -> dict[str, Any]:
        tokens, token_lps, tops, offsets = [], [], [], []
        for lp in lps:
            text = self._token(lp.token_id)[0]
            tokens.append(text)
            token_lps.append(_clamp(lp.logprob))
            top = {self._token(t)[0]: _clamp(v) for t, v in lp.top}
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

    def _chat_logprobs(
        self, lps: Sequence[TokenLogprob], top_n: int | None
    ) -> list[dict[str, Any]]:
        content = []
        for lp in lps:
            text, raw = self._token(lp.token_id)
            top = []
            for t, v in lp.top[: top_n or 0]:
                t_text, t_raw = self._token(t)
                top.append({"token": t_text, "logprob": _clamp(v), "bytes": t_raw})
            content.append(
                {"token": text, "logprob": _clamp(lp.logprob), "bytes": raw, "top_logprobs": top}
            )
        return content

    # -- logging --------------------------------------------------------------------------------------------

    def _log_prompt(self, gen: Generation, texts: list[str]) -> None:
        if self.log_prompts:
            log.info("%s prompt=%r", gen.id, texts if len(texts) > 1 else texts[0])

    def _log_done(self, gen: Generation) -> None:
        firsts = [c.first_time for c in gen.choices if c.first_time is not None]
        lasts = [c.last_time for c in gen.choices if c.last_time is not None]
        ttft = f"{min(firsts) - gen.arrival:.3f}s" if firsts else "-"
        e2e = f"{(max(lasts) if lasts else time.monotonic()) - gen.arrival:.3f}s"
        reasons = ",".join(sorted({c.finish_reason or "-" for c in gen.choices}))
        log.info(
            "%s choices=%d prompt_tokens=%d output_tokens=%d ttft=%s e2e=%s finish=%s status=%s",
            gen.id,
            len(gen.choices),
            sum(len(p) for p in gen.prompts),
            sum(c.num_tokens for c in gen.choices),
            ttft,
            e2e,
            reasons,
            gen.status,
        )


def _clamp(logprob: float) -> float:
    return logprob if logprob > _LOGPROB_FLOOR else _LOGPROB_FLOOR  # also maps NaN to the floor


def _token_bytes(tokenizer: Tokenizer, token_id: int) -> bytes | None:
    """The raw bytes of a byte-level token, when the tokenizer can say (None: decode instead)."""
    fn = getattr(tokenizer, "token_bytes", None)
    if fn is not None:
        return fn(token_id)
    if type(tokenizer).__name__ == "ByteTokenizer":
        return bytes([token_id]) if 0 <= token_id < 256 else b""
    return None


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class SSEResponse(StreamingResponse):
    """`text/event-stream` whose generator is always closed, so its cleanup (aborting the
    engine requests) runs however the response ends: finished, client gone, or cancelled."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # A generator cancelled between two chunks, or never started, runs no cleanup of its
            # own; closing it and calling on_close makes sure the engine requests end here.
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(RuntimeError):
                    await aclose()
            self.on_close()
