"""`AsyncEngineDriver`: the in-process `server.client.EngineClient`, over an `engine.Engine`.

The driver is one asyncio task that owns the engine. Between steps, on the event-loop thread, it
applies queued adds and aborts (so the engine is never touched by two threads at once); it runs
`engine.step()` in one dedicated worker thread, so the loop keeps accepting requests and writing
SSE while torch computes; and it hands each `StepOutput` to its stream's queue as soon as the step
returns. With no work it sleeps on an event that the next submit or abort sets: no polling.

Backpressure: each `OutputStream` is bounded (`max_buffered_outputs` unread outputs per request);
when its reader falls behind, the driver pauses the group's requests in the engine (`pause`, not
scheduled, their slot and blocks given up if someone else needs them) and resumes them once the
reader has caught up, so a client that does not read costs memory bounded by that, not by its
max_tokens.

The event loop and the step thread share the GIL. At CPython's default switch interval (5 ms)
a thread that wants it back waits up to that long whenever the other one runs Python, so while a
busy engine steps, a new request's parsing and its first token's write can each wait a whole
interval. (`tools.hog_ttft`, TinyGPT, a short request behind a 64-choice hog, interleaved runs on
a loaded 2-core machine: median TTFT 69 and 74 ms at 5 ms, 34 and 41 ms at 0.5 ms.) While it
runs, the driver sets the interval to `gil_switch_interval` (0.5 ms by default; None leaves it
alone) and restores it when it stops.

If a step raises, every open stream ends with an `EngineDeadError`, later submits fail at once,
and `health()` reports the failure (the exception itself goes to the log, not to clients). A step that runs longer than `step_timeout` makes `health()`
report the engine as stuck.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from engine import Engine, EngineDeadError, EngineStats, QueueFullError, Request
from server.client import EngineClient, EngineObserver, Health, OutputStream

__all__ = ["AsyncEngineDriver", "QueueFullError"]

log = logging.getLogger("server.driver")

DEFAULT_GIL_SWITCH_INTERVAL = 0.0005  # seconds; CPython's default is 0.005


@dataclass(slots=True)
class _PendingAdd:
    requests: Sequence[Request]
    stream: OutputStream
    accepted: asyncio.Future[None]


class AsyncEngineDriver(EngineClient):
    """Runs a synchronous engine as one asyncio task plus one worker thread."""

    def __init__(
        self,
        engine: Engine,
        *,
        max_waiting: int | None = None,
        max_buffered_outputs: int | None = 16,
        step_timeout: float = 60.0,
        num_threads: int | None = None,
        gil_switch_interval: float | None = DEFAULT_GIL_SWITCH_INTERVAL,
        observer: EngineObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        # Unread outputs per request beyond which its requests are paused (backpressure).
        self.max_buffered_outputs = max_buffered_outputs
        self._pressure: list[tuple[tuple[str, ...], bool]] = []
        self.step_timeout = step_timeout
        self.num_threads = num_threads
        self.gil_switch_interval = gil_switch_interval
        self._saved_switch_interval: float | None = None
        self.observer = observer
        self.clock = clock
        self._streams: dict[str, OutputStream] = {}
        self._arrivals: dict[str, float] = {}  # until a request's first output: its queue time
        self._adds: list[_PendingAdd] = []
        self._aborts: list[str] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._error: BaseException | None = None
        self._stopping = False
        self._step_started: float | None = None
        self._stats: EngineStats = engine.stats()

    # -- EngineClient --------------------------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def engine_name(self) -> str:
        return self.engine.name

    def set_observer(self, observer: EngineObserver) -> None:
        if self.observer is None:  # one given to the constructor stays
            self.observer = observer

    async def start(self) -> None:
        if self._task is not None:
            return
        if self.gil_switch_interval is not None:
            self._saved_switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(self.gil_switch_interval)
        # One thread for every step: torch's thread-local state (inference mode, the intra-op
        # thread count) is set up once there and the engine is never stepped concurrently.
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="engine-step", initializer=self._init_worker
        )
        self._wake = asyncio.Event()  # bind to the running loop
        self._task = asyncio.create_task(self._run(), name="engine-driver")

    async def stop(self, timeout: float = 30.0) -> None:
        """Abort what is still open, let the current step finish (up to `timeout`), stop."""
        self._stopping = True
        for stream in {id(s): s for s in self._streams.values()}.values():
            stream.fail(EngineDeadError("the server is shutting down"))
        for add in self._adds:
            add.stream.fail(EngineDeadError("the server is shutting down"))
            if not add.accepted.done():
                add.accepted.set_exception(EngineDeadError("the server is shutting down"))
        for request_id in list(self._streams):
            self._aborts.append(request_id)
        self._streams.clear()
        self._adds.clear()
        self._wake.set()
        finished = True
        if self._task is not None:
            done, _ = await asyncio.wait({self._task}, timeout=timeout)
            finished = bool(done)
            if not finished:  # a stuck step: stop waiting for it; its thread dies with the process
                log.warning("engine step still running after %.0fs; not waiting for it", timeout)
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await self._task
            self._task = None
        if self._executor is not None:
            self._executor.shutdown(wait=finished, cancel_futures=True)
            self._executor = None
        if self._saved_switch_interval is not None:
            sys.setswitchinterval(self._saved_switch_interval)
            self._saved_switch_interval = None

    async def submit(self, requests: Sequence[Request]) -> OutputStream:
        if self._error is not None:
            raise EngineDeadError("the engine failed and accepts no requests")
        if self._stopping or self._task is None:
            raise EngineDeadError("the engine is not running")
        if self.max_waiting is not None:
            # Only requests the engine cannot start at its next step count as queued: a burst
            # on an idle server fills the free batch slots first. A group arriving at an empty
            # queue is taken whatever its size, so a large n is never refused by an idle server.
            queued = self.stats().num_cannot_start
            if queued and queued + len(requests) > self.max_waiting:
                raise QueueFullError(
                    f"the engine's queue is full ({queued} requests waiting for a batch slot, "
                    f"limit {self.max_waiting})"
                )
        stream = OutputStream(
            [r.request_id for r in requests],
            max_buffered=self.max_buffered_outputs,
            on_pressure=self._on_pressure,
        )
        add = _PendingAdd(requests, stream, asyncio.get_running_loop().create_future())
        self._adds.append(add)
        self._wake.set()
        try:
            await add.accepted
        except asyncio.CancelledError:
            # The caller went away before the engine saw the requests (or right after).
            for r in requests:
                self.abort(r.request_id)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        self._arrivals.pop(request_id, None)
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.close(request_id)
            self._aborts.append(request_id)
            self._wake.set()
            return
        for add in self._adds:  # not yet handed to the engine: just drop it from the add
            if request_id in add.stream.request_ids:
                add.requests = [r for r in add.requests if r.request_id != request_id]
                add.stream.close(request_id)

    def _on_pressure(self, stream: OutputStream, pause: bool) -> None:
        """The stream's reader fell behind (pause) or caught up (resume): tell the engine at the
        next window. An engine without pause/resume just keeps generating."""
        self._pressure.append((tuple(stream.open_request_ids), pause))
        if not pause:
            self._wake.set()

    def health(self) -> Health:
        if self._error is not None:
            # The exception's type, not its text: the text may carry internals (it is logged).
            return Health(False, f"engine step failed ({type(self._error).__name__})")
        if self._task is None or self._task.done():
            return Health(False, "engine driver is not running")
        started = self._step_started
        if started is not None and self.clock() - started > self.step_timeout:
            return Health(False, f"engine step has run for over {self.step_timeout:g}s")
        return Health(True)

    def stats(self) -> EngineStats:
        # A snapshot taken between steps (the engine must not be read while a step runs), plus
        # what is queued for the next window.
        pending = sum(len(a.requests) for a in self._adds)
        if not pending:
            return self._stats
        return dataclasses.replace(self._stats, num_waiting=self._stats.num_waiting + pending)

    # -- the loop --------------------------------------------------------------------------------------

    def _init_worker(self) -> None:
        if self.num_threads:
            torch.set_num_threads(self.num_threads)

    def _apply_pending(self) -> None:
        """Hand queued adds and aborts to the engine. Runs on the loop thread between steps."""
        engine = self.engine
        aborts, self._aborts = self._aborts, []
        for request_id in aborts:
            engine.abort(request_id)
        pressure, self._pressure = self._pressure, []
        for request_ids, pause in pressure:
            act = getattr(engine, "pause" if pause else "resume", None)
            if act is not None:
                for request_id in request_ids:
                    act(request_id)
        adds, self._adds = self._adds, []
        for add in adds:
            if add.accepted.done():  # the submitter was cancelled meanwhile
                continue
            added: list[str] = []
            try:
                for r in add.requests:
                    engine.add_request(r)
                    added.append(r.request_id)
            except Exception as e:  # all or nothing: undo the group's earlier members
                for request_id in added:
                    engine.abort(request_id)
                add.accepted.set_exception(e)
                continue
            for r in add.requests:
                self._streams[r.request_id] = add.stream
                self._arrivals[r.request_id] = r.arrival_time
            add.accepted.set_result(None)
        if aborts or adds:
            self._stats = engine.stats()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        engine = self.engine
        try:
            while True:
                self._apply_pending()
                if not engine.has_work():
                    if self._stopping:
                        return
                    self._wake.clear()
                    if self._adds or self._aborts or self._pressure:
                        continue
                    await self._wake.wait()
                    continue
                self._step_started = self.clock()
                t0 = time.perf_counter()
                outputs = await loop.run_in_executor(self._executor, self.engine.step)
                elapsed = time.perf_counter() - t0
                step_started, self._step_started = self._step_started, None
                for out in outputs:
                    stream = self._streams.get(out.request_id)
                    if stream is None:
                        continue  # aborted: its terminal output has no reader
                    if out.finished:
                        del self._streams[out.request_id]
                    arrival = self._arrivals.pop(out.request_id, None)
                    if arrival is not None and self.observer is not None:
                        # The engine's first scheduling of the request; an engine that does
                        # not record it gets the start of the step that produced its first
                        # output (the same moment unless its prefill was chunked).
                        scheduled = out.first_scheduled_time or step_started
                        self.observer.observe_queue_time(max(scheduled - arrival, 0.0))
                    stream.deliver(out)
                self._stats = engine.stats()
                if self.observer is not None:
                    self.observer.observe_step(elapsed, len(outputs))
        except BaseException as e:
            self._step_started = None
            if isinstance(e, asyncio.CancelledError) and self._stopping:
                raise
            self._fail_all(e)
            if not isinstance(e, Exception):
                raise

    def _fail_all(self, error: BaseException) -> None:
        self._error = error
        log.error(
            "engine step failed; failing %d open requests: %s",
            len(self._streams),
            " ".join(sorted(self._streams)),
            exc_info=error,
        )
        dead = EngineDeadError("the engine failed while generating")
        for stream in {id(s): s for s in self._streams.values()}.values():
            stream.fail(dead)
        self._streams.clear()
        self._arrivals.clear()
        for add in self._adds:
            add.stream.fail(dead)
            if not add.accepted.done():
                add.accepted.set_exception(dead)
        self._adds.clear()
