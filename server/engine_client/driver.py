"""`AsyncEngineDriver`: the in-process `server.engine_client.interface.EngineClient`, over an `engine.Engine`.

The engine belongs to one dedicated thread, the engine thread, which steps it back to back while
there is work. The event loop never touches the engine: `submit`, `abort`, backpressure and
`stop` put commands in an inbox (one lock-guarded queue: add, abort, pause, resume, stop), and
the engine thread applies them between two steps, in the order they were sent (so an abort
always finds its request's add before it). After each step the engine thread hands the step's
outputs to the loop in one `call_soon_threadsafe` callback, which delivers them to their
streams, and goes straight on to the next step. It does not wait for the loop: handing each
step to a worker and awaiting it cost two thread wake-ups and whatever the loop was doing at
that moment on every step, ~0.8 ms of a ~6 ms single-stream step (9-15% of the step, against
1-2% for the one callback; Zen 4). With no work the thread sleeps on a condition that the next
submit, abort or resume notifies: no polling. Before it sleeps it hands the C heap's free pages
back to the OS (`server.engine_client.heap`), so a server's resident memory falls back after a
burst instead of staying at the burst's high-water mark.

What the loop reads of the engine, it reads from snapshots the engine thread sends along with
each step's outputs and with each acceptance (`stats()`), so the two threads share no mutable
engine state. Callbacks reach the loop in the order they were posted: a group's acceptance
before its first outputs.

Backpressure: each `OutputStream` is bounded (`max_buffered_outputs` unread outputs per request);
when its reader falls behind, the driver pauses the group's requests in the engine (`pause`, not
scheduled, their slot and blocks given up if someone else needs them) and resumes them once the
reader has caught up, so a client that does not read costs memory bounded by that, not by its
max_tokens. (The pause reaches the engine at its next window, so up to two steps' outputs may
land past the mark.)

The event loop and the engine thread share the GIL. At CPython's default switch interval (5 ms)
a thread that wants it back waits up to that long whenever the other one runs Python, so while a
busy engine steps, a new request's parsing and its first token's write can each wait a whole
interval. (`tools.hog_ttft`, TinyGPT, a short request behind a 64-choice hog, interleaved runs on
a loaded 2-core machine: median TTFT 69 and 74 ms at 5 ms, 34 and 41 ms at 0.5 ms.) While it
runs, the driver sets the interval to `gil_switch_interval` (0.5 ms by default; None leaves it
alone) and restores it when it stops.

If a step raises, every open stream ends with an `EngineDeadError`, later submits fail at once,
and `health()` reports the failure (the exception itself goes to the log, not to clients). A
step that runs longer than `step_timeout` makes `health()` report the engine as stuck.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine import Engine, EngineDeadError, EngineStats, QueueFullError, Request, StepOutput
from server.engine_client.heap import IdleHeapTrimmer
from server.engine_client.interface import EngineClient, EngineObserver, Health, OutputStream

log = logging.getLogger("server.driver")

DEFAULT_GIL_SWITCH_INTERVAL = 0.0005  # seconds; CPython's default is 0.005
ENGINE_THREAD_NAME = "engine-step"


@dataclass(slots=True, eq=False)  # compared by identity
class _PendingAdd:
    requests: list[Request]
    stream: OutputStream
    accepted: asyncio.Future[None]  # touched on the loop thread only


class _Op(enum.Enum):
    """What an inbox command asks of the engine thread."""

    ADD = "add"  # a _PendingAdd: add its requests, all or none
    ABORT = "abort"  # a request id
    PAUSE = "pause"  # request ids (backpressure: the reader is behind)
    RESUME = "resume"  # request ids (the reader caught up)
    STOP = "stop"  # nothing: stop once the engine has nothing left to report


_Command = tuple[_Op, Any]


class AsyncEngineDriver(EngineClient):
    """Runs a synchronous engine on its own thread, stepping back to back, for an asyncio server."""

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
        self.step_timeout = step_timeout
        self.num_threads = num_threads
        if self.num_threads:
            torch.set_num_threads(self.num_threads)
        self.gil_switch_interval = gil_switch_interval
        self._saved_switch_interval: float | None = None
        self.observer = observer
        self.clock = clock
        # Loop-thread state.
        self._streams: dict[str, OutputStream] = {}
        self._arrivals: dict[str, float] = {}  # until a request's first output: its queue time
        # Submitted groups whose acceptance has not come back yet (in the inbox or being added).
        self._unacked: list[_PendingAdd] = []
        self._stats: EngineStats = engine.stats()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._exited: asyncio.Future[None] | None = None
        # The inbox, guarded by the condition's lock: the loop appends, the engine thread takes
        # and applies in order.
        self._cv = threading.Condition()
        self._inbox: list[_Command] = []
        self._stopping = False
        # Written by the engine thread, read by health().
        self._step_started: float | None = None

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
        if self._thread is not None:
            return
        if self.gil_switch_interval is not None:
            self._saved_switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(self.gil_switch_interval)
        self._loop = asyncio.get_running_loop()
        self._exited = self._loop.create_future()
        # One thread for every step: torch's thread-local state (inference mode, the intra-op
        # thread count) is set up once there and the engine is never touched by two threads.
        self._thread = threading.Thread(
            target=self._engine_main, name=ENGINE_THREAD_NAME, daemon=True
        )
        self._thread.start()

    async def stop(self, timeout: float = 30.0) -> None:
        """Abort what is still open, let the current step finish (up to `timeout`), stop."""
        shutting_down = EngineDeadError("the server is shutting down")
        for stream in {id(s): s for s in self._streams.values()}.values():
            stream.fail(shutting_down)
        with self._cv:
            self._stopping = True
            # Groups not yet handed to the engine never will be; what it has is aborted.
            self._inbox = [c for c in self._inbox if c[0] is not _Op.ADD]
            self._inbox += [(_Op.ABORT, request_id) for request_id in self._streams]
            self._inbox.append((_Op.STOP, None))
            self._cv.notify()
        self._fail_unacked(shutting_down)
        self._streams.clear()
        self._arrivals.clear()
        if self._exited is not None:
            done, _ = await asyncio.wait({self._exited}, timeout=timeout)
            if not done:  # a stuck step: stop waiting for it; its thread dies with the process
                log.warning("engine step still running after %.0fs; not waiting for it", timeout)
            self._exited = None
        self._thread = None
        if self._saved_switch_interval is not None:
            sys.setswitchinterval(self._saved_switch_interval)
            self._saved_switch_interval = None

    async def submit(self, requests: Sequence[Request]) -> OutputStream:
        if self._error is not None:
            raise EngineDeadError("the engine failed and accepts no requests")
        if self._stopping or self._thread is None:
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
        add = _PendingAdd(list(requests), stream, asyncio.get_running_loop().create_future())
        for r in requests:
            self._streams[r.request_id] = stream
            self._arrivals[r.request_id] = r.arrival_time
        self._unacked.append(add)
        self._send(_Op.ADD, add)
        try:
            await add.accepted
        except asyncio.CancelledError:
            # The caller went away before the engine took the requests (or right after).
            for r in requests:
                self.abort(r.request_id)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        self._arrivals.pop(request_id, None)
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return  # finished, aborted already, or never submitted
        stream.close(request_id)
        self._send(_Op.ABORT, request_id)

    def _on_pressure(self, stream: OutputStream, pause: bool) -> None:
        """The stream's reader fell behind (pause) or caught up (resume): tell the engine at its
        next window. A pause need not wake an idle engine thread: it has nothing to pause."""
        ids = tuple(stream.open_request_ids)
        if pause:
            self._send(_Op.PAUSE, ids, wake=False)
        else:
            self._send(_Op.RESUME, ids)

    def _send(self, op: _Op, arg: Any, wake: bool = True) -> None:
        with self._cv:
            self._inbox.append((op, arg))
            if wake:
                self._cv.notify()

    def health(self) -> Health:
        if self._error is not None:
            # The exception's type, not its text: the text may carry internals (it is logged).
            return Health(False, f"engine step failed ({type(self._error).__name__})")
        if self._thread is None or not self._thread.is_alive():
            return Health(False, "engine driver is not running")
        started = self._step_started
        if started is not None and self.clock() - started > self.step_timeout:
            return Health(False, f"engine step has run for over {self.step_timeout:g}s")
        return Health(True)

    def stats(self) -> EngineStats:
        # The engine thread's latest snapshot, plus what the engine has not acknowledged yet.
        if not self._unacked:
            return self._stats
        pending = sum(len(add.requests) for add in self._unacked)
        return dataclasses.replace(self._stats, num_waiting=self._stats.num_waiting + pending)

    # -- the engine thread -----------------------------------------------------------------------------

    def _engine_main(self) -> None:
        if self.num_threads:
            torch.set_num_threads(self.num_threads)
        engine = self.engine
        stopped = False
        heap = IdleHeapTrimmer()
        try:
            while True:
                with self._cv:
                    while not self._inbox:
                        if engine.has_work():
                            break
                        if stopped:
                            return
                        if heap.pending:  # trimmed with the lock free: a submit never waits
                            self._cv.release()
                            try:
                                heap.idle()
                            finally:
                                self._cv.acquire()
                            continue  # what came meanwhile is seen before sleeping
                        self._cv.wait()
                    commands, self._inbox = self._inbox, []
                if commands:
                    accepted, stop = self._apply(commands)
                    stopped = stopped or stop
                    self._post(self._on_accepted, accepted, engine.stats())
                if not engine.has_work():
                    continue
                self._step_started = self.clock()
                t0 = time.perf_counter()
                outputs = engine.step()
                elapsed = time.perf_counter() - t0
                heap.stepped()
                step_started, self._step_started = self._step_started, None
                self._post(self._on_step, outputs, elapsed, step_started, engine.stats())
        except BaseException as e:
            self._step_started = None
            self._post(self._fail_all, e)
        finally:
            self._post(self._on_exit)

    def _apply(
        self, commands: list[_Command]
    ) -> tuple[list[tuple[_PendingAdd, Exception | None]], bool]:
        """Hand the inbox to the engine, in order (engine thread). What each add came to, and
        whether a stop came."""
        engine = self.engine
        accepted: list[tuple[_PendingAdd, Exception | None]] = []
        stop = False
        for op, arg in commands:
            if op is _Op.ADD:
                accepted.append((arg, self._add(arg)))
            elif op is _Op.ABORT:
                engine.abort(arg)
            elif op is _Op.PAUSE:
                for request_id in arg:
                    engine.pause(request_id)
            elif op is _Op.RESUME:
                for request_id in arg:
                    engine.resume(request_id)
            else:
                stop = True
        return accepted, stop

    def _add(self, add: _PendingAdd) -> Exception | None:
        """Add a group's requests, all or none (engine thread); the refusal, if any."""
        added: list[str] = []
        try:
            for r in add.requests:
                self.engine.add_request(r)
                added.append(r.request_id)
        except Exception as e:  # undo the group's earlier members
            for request_id in added:
                self.engine.abort(request_id)
            return e
        return None

    def _post(self, callback: Callable[..., None], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is left to tell
            self._loop.call_soon_threadsafe(callback, *args)

    # -- callbacks on the loop thread --------------------------------------------------------------

    def _on_accepted(
        self, accepted: list[tuple[_PendingAdd, Exception | None]], stats: EngineStats
    ) -> None:
        self._stats = stats
        for add, error in accepted:
            if add not in self._unacked:
                continue  # failed meanwhile by stop() or an engine failure
            self._unacked.remove(add)
            if error is not None:
                for r in add.requests:
                    self._streams.pop(r.request_id, None)
                    self._arrivals.pop(r.request_id, None)
                if not add.accepted.done():
                    add.accepted.set_exception(error)
            elif not add.accepted.done():
                add.accepted.set_result(None)

    def _on_step(
        self,
        outputs: list[StepOutput],
        elapsed: float,
        step_started: float | None,
        stats: EngineStats,
    ) -> None:
        self._stats = stats
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted: its terminal output has no reader
            if out.finished:
                del self._streams[out.request_id]
            arrival = self._arrivals.pop(out.request_id, None)
            if arrival is not None and self.observer is not None:
                # The engine's first scheduling of the request; an engine that does not record
                # it gets the start of the step that produced its first output (the same moment
                # unless its prefill was chunked).
                scheduled = out.first_scheduled_time or step_started
                self.observer.observe_queue_time(max(scheduled - arrival, 0.0))
            stream.deliver(out)
        if self.observer is not None:
            self.observer.observe_step(elapsed, len(outputs))

    def _on_exit(self) -> None:
        if self._exited is not None and not self._exited.done():
            self._exited.set_result(None)

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
        with self._cv:
            self._inbox = [c for c in self._inbox if c[0] is not _Op.ADD]
        self._fail_unacked(dead)

    def _fail_unacked(self, error: EngineDeadError) -> None:
        """Submitters still waiting for the engine to take their group get `error` (their
        streams, registered at submit, were failed with the rest or closed by an abort)."""
        unacked, self._unacked = self._unacked, []
        for add in unacked:
            if not add.accepted.done():
                add.accepted.set_exception(error)
