"""How a response rides its connection: SSE framing, the streamed response, one write per
engine step, and a whole body's wait that a disconnect cancels.

Owns `sse` / `SSE_DONE` / `dumps` (the bytes of an event), `SSEResponse` (a `text/event-stream`
whose cleanup always runs, and which gives up on a client that reads nothing for
`stall_timeout`), `per_step` (the events of outputs that arrived together in one write) and
`until_disconnect` (a non-streamed request cancelled when its client goes away).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import Request as HTTPRequest
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from server.errors import ClientDisconnected
from server.generation.text import Generation

log = logging.getLogger("server.requests")

SSE_DONE = "data: [DONE]\n\n"


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def sse(obj: Any) -> str:
    return f"data: {dumps(obj)}\n\n"


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
