"""The one generation loop: a prepared submission in, its response out.

Owns `GenerationLoop.respond`: the submission's engine requests go to the `EngineClient` as one
group (all admitted or none), each output comes back through its `Choice` (detokenization, stop
strings, whose match aborts the request in the engine), with per-request metrics, and the
submission's `Render` turns the updates into SSE events or, once every choice has ended, a
whole body. Every run ends in `_finish`, however it ends (finished, the client gone, a stalled
reader, the engine stopping): what is still open is aborted, the client's concurrency place
given back, and one log line written. A grammar that reaches a dead end mid-generation fails
the request with a 400 naming its field.

A prefill-only submission (embeddings) runs the same way; it is not a generation, so it holds
no client slot, records no token timings and writes no log line, and its prompt tokens count
once its vectors are in.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

from engine import EngineDeadError, Request, StepOutput
from models import Tokenizer
from server.engine_client.interface import EngineClient
from server.errors import APIError, grammar_error_code
from server.generation.metrics import ServerMetrics
from server.generation.sse import SSEResponse, until_disconnect
from server.generation.submission import Render, Submission
from server.generation.tenancy import ClientSlots
from server.generation.text import Choice, Generation, Update

log = logging.getLogger("server.requests")


class GenerationLoop:
    """Runs submissions on one engine client (the app's, shared by every surface)."""

    def __init__(
        self,
        client: EngineClient,
        tokenizer: Tokenizer,
        metrics: ServerMetrics | None,
        client_slots: ClientSlots,
        stall_timeout: float | None,
    ) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.metrics = metrics
        # Open generation requests per client identity, against `max_concurrent_per_client`.
        self.client_slots = client_slots
        # A streamed response whose client reads nothing for this long is given up (aborted).
        self.stall_timeout = stall_timeout

    async def respond(self, sub: Submission, http: HTTPRequest) -> Response:
        """Run `sub`: a streamed response (submitted before it returns, so a refusal is a
        status, not an event), or the whole body once done, cancelled if the client leaves."""
        gen, requests = sub.start(self.tokenizer)
        render = sub.render(gen)
        if sub.stream:
            await self._submit(gen, requests)
            return SSEResponse(
                render.stream(self._updates(gen)),
                lambda: self._finish(gen),
                stall_timeout=self.stall_timeout,
            )
        return await until_disconnect(http, self._whole(gen, requests, render))

    async def _whole(self, gen: Generation, requests: list[Request], render: Render) -> Response:
        await self._submit(gen, requests)
        body = await render.whole(self._updates(gen))
        if not gen.generates and self.metrics is not None:
            self.metrics.prompt_tokens.inc(sum(len(p) for p in gen.prompts))
        return JSONResponse(body)

    async def _submit(self, gen: Generation, requests: list[Request]) -> None:
        # What the client refuses (QueueFullError, InvalidRequestError, EngineDeadError) leaves
        # through server.errors' table.
        if gen.generates:
            self.client_slots.take(gen.client_id)
            gen.counted = True
        try:
            gen.stream = await self.client.submit(requests)
        except BaseException:
            self._release(gen)
            raise
        if gen.generates and self.metrics is not None:
            self.metrics.prompt_tokens.inc(sum(len(r.prompt_token_ids) for r in requests))

    async def _updates(self, gen: Generation) -> AsyncIterator[Update]:
        """(choice, text delta to send, new logprobs, new token count) per engine output, until
        all choices end."""
        assert gen.stream is not None
        m = self.metrics if gen.generates else None
        try:
            async for out in gen.stream:
                c = gen.by_request[out.request_id]
                if c.finished:
                    continue  # queued before a stop string ended it
                if gen.generates:
                    self._observe(gen, c, out)
                if c.update(out):  # a stop string: end it in the engine now
                    self.client.abort(c.request_id)
                if c.finished and m is not None:
                    m.finished.labels(c.finish_reason).inc()
                if out.error is not None:  # its grammar could not go on: no normal end
                    gen.status = "grammar_error"
                    raise APIError(
                        400,
                        f"choice {c.index}: {out.error}",
                        param=gen.grammar_param,
                        code=grammar_error_code(gen.grammar_param),
                    )
                yield c, c.take_delta(), out.logprobs or [], len(out.token_ids)
        except EngineDeadError:
            gen.status = "engine_error"
            raise
        except BaseException:  # cancelled: the client disconnected, or the server is stopping
            if gen.status == "ok":
                gen.status = "aborted"
            raise
        finally:
            self._finish(gen)

    def _finish(self, gen: Generation) -> None:
        """Abort whatever is still open and log the request. Idempotent."""
        if gen.done:
            return
        gen.done = True
        self._release(gen)
        if gen.stream is not None:
            for rid in gen.stream.open_request_ids:
                self.client.abort(rid)
        if not gen.generates:
            return
        for c in gen.choices:
            if not c.finished:
                c.finish_reason = "abort"
                if gen.status == "ok":
                    gen.status = "aborted"
                if self.metrics is not None:
                    self.metrics.finished.labels("abort").inc()
        log.info("%s", gen.summary())

    def _release(self, gen: Generation) -> None:
        """Give back the generation's place in its client's concurrency count. Idempotent."""
        if not gen.counted:
            return
        gen.counted = False
        self.client_slots.give_back(gen.client_id)

    def _observe(self, gen: Generation, c: Choice, out: StepOutput) -> None:
        now = time.monotonic()
        m = self.metrics
        if m is not None:
            m.generation_tokens.inc(len(out.token_ids))
            if c.first_time is None:
                m.ttft.observe(now - gen.arrival)
                m.live.observe_ttft(now - gen.arrival)
            elif c.last_time is not None:
                m.itl.observe(now - c.last_time)
                m.live.observe_itl(now - c.last_time)
            if out.finished:
                m.e2e.observe(now - gen.arrival)
        if c.first_time is None:
            c.first_time = now
        c.last_time = now
