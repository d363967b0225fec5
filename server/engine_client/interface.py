"""The engine-client seam: everything the HTTP layer knows about an engine.

`EngineClient` is what routes may ask of an engine: submit a group of requests and iterate their
outputs, abort one, health, stats, start and stop. `server.engine_client.driver.AsyncEngineDriver` implements it
over an engine in this process; another implementation can forward the same calls to a remote
replica. Each submit returns an `OutputStream`, which the implementation feeds through the
stream's producer methods (`deliver`, `close`, `fail`) and a route consumes by iterating it.

Errors a client raises are the engine's typed ones (`engine.errors`): `InvalidRequestError` and
its subclasses for a refused request, `QueueFullError`, `EngineDeadError`.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from engine import EngineStats, Request, StepOutput


@dataclass(frozen=True, slots=True)
class Health:
    ok: bool
    reason: str | None = None


class OutputStream(AsyncIterator[StepOutput]):
    """The outputs of one submitted group of requests, in the order steps produce them.

    Iteration ends once every request in the group has finished or been closed; it raises the
    error given to `fail` (an `EngineDeadError`) if that comes first. Producer and consumer run
    on the same event loop.

    Backpressure: with `max_buffered` set, once that many outputs per request of the group wait
    unread, `on_pressure(self, True)` asks the producer to pause the group's requests (not to
    buffer more); once the reader has drained half of them, `on_pressure(self, False)` resumes
    them. The producer may still deliver a step or two past the mark (the in-process driver's
    engine thread may be in its next step when the pause is asked for): the bound is soft.
    """

    def __init__(
        self,
        request_ids: Sequence[str],
        *,
        max_buffered: int | None = None,
        on_pressure: Callable[[OutputStream, bool], None] | None = None,
    ) -> None:
        self.request_ids = tuple(request_ids)
        self._open = set(request_ids)
        # An output, the error that ended the stream, or None once every request has ended.
        self._queue: asyncio.Queue[StepOutput | BaseException | None] = asyncio.Queue()
        self._ended = False
        self._high = None if max_buffered is None else max_buffered * max(len(request_ids), 1)
        self.on_pressure = on_pressure
        self.paused = False

    # -- producer side (the engine client) -------------------------------------------------------

    def deliver(self, out: StepOutput) -> None:
        """Hand one output to the reader; a finished output closes its request."""
        if out.request_id not in self._open:
            return  # closed already (aborted by the server): nobody waits for its output
        self._queue.put_nowait(out)
        if out.finished:
            self.close(out.request_id)
        elif (
            self._high is not None
            and not self.paused
            and self._queue.qsize() >= self._high
            and self.on_pressure is not None
        ):
            self.paused = True
            self.on_pressure(self, True)

    def close(self, request_id: str) -> None:
        """No more outputs for this request (it finished, or the server aborted it)."""
        self._open.discard(request_id)
        if not self._open and not self._ended:
            self._ended = True
            self._queue.put_nowait(None)

    def fail(self, error: BaseException) -> None:
        """End the stream with `error`: the reader gets it after what was delivered before."""
        if not self._ended:
            self._ended = True
            self._open.clear()
            self._queue.put_nowait(error)

    # -- consumer side (a route) -----------------------------------------------------------------

    @property
    def open_request_ids(self) -> frozenset[str]:
        return frozenset(self._open)

    def __aiter__(self) -> OutputStream:
        return self

    @property
    def num_buffered(self) -> int:
        """Outputs delivered and not yet read."""
        return self._queue.qsize()

    async def __anext__(self) -> StepOutput:
        item = await self._queue.get()
        if self.paused and self._high is not None and self._queue.qsize() <= self._high // 2:
            self.paused = False
            if self.on_pressure is not None and not self._ended:
                self.on_pressure(self, False)
        if item is None:
            self._queue.put_nowait(item)  # stay exhausted
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._queue.put_nowait(item)
            raise item
        return item


class EngineObserver(Protocol):
    """Receives an engine client's timings (the app's metrics implement it)."""

    def observe_step(self, seconds: float, num_outputs: int) -> None: ...

    def observe_queue_time(self, seconds: float) -> None: ...


class EngineClient(abc.ABC):
    """What routes may ask of an engine. Implementations: `AsyncEngineDriver` (in process)."""

    @property
    @abc.abstractmethod
    def max_model_len(self) -> int: ...

    @property
    @abc.abstractmethod
    def engine_name(self) -> str: ...

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def stop(self, timeout: float = 30.0) -> None: ...

    @abc.abstractmethod
    async def submit(self, requests: Sequence[Request]) -> OutputStream:
        """Queue requests as one group (all admitted or none) and return their output stream.

        Returns once the engine has accepted them; raises `InvalidRequestError` (what
        `Engine.add_request` refuses), `QueueFullError` or `EngineDeadError`.
        """

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """End a request and free its memory before the next step. Idempotent."""

    @abc.abstractmethod
    def health(self) -> Health: ...

    @abc.abstractmethod
    def stats(self) -> EngineStats: ...

    def set_observer(self, observer: EngineObserver) -> None:  # noqa: B027 - optional hook
        """Report engine timings (step durations, queue times) to `observer`. A client that
        measures none keeps this default, which ignores it."""
