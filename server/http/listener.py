"""The uvicorn server `python -m server` runs: a drain deadline on shutdown and socket timeouts.

Owns how the process meets the network and how it ends, not what it serves (that is
`server.http.app`):

- `DrainingServer`: on SIGTERM uvicorn stops accepting connections and waits for open ones. At
  the drain deadline it would cancel their tasks, cutting streams without an error event or
  `[DONE]` and answering non-streamed requests with a plain-text 500 and an ASGI traceback in
  the log. Instead, at the deadline this server stops the engine client first, which fails every
  open stream with `EngineDeadError("the server is shutting down")`: a stream then ends with an
  OpenAI-shaped error event and `data: [DONE]`, a non-streamed request gets a JSON 503, and the
  connections close on their own before uvicorn's own (later) deadline. If a thread is still busy
  after that (an engine step cannot be interrupted: a long prefill, a big model), the process
  exits without waiting for it: Python would otherwise join the thread at exit, outliving
  Docker's grace and dying of SIGKILL (exit 137) although every client has its answer.
- `timed_h11`: uvicorn's h11 protocol with a deadline for reading each request (request line,
  headers and body). uvicorn has a keep-alive timeout but none for a request that is being
  sent, so a silent or slow socket (slowloris) would be held forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from server.engine_client.driver import ENGINE_THREAD_NAME

log = logging.getLogger("server.shutdown")

# Docker sends SIGKILL 10 s after SIGTERM unless told otherwise (`docker stop -t`,
# `--stop-timeout`). The drain must end, error events sent, before that.
DEFAULT_DRAIN_TIMEOUT = 8.0
# After the drain deadline: how long uvicorn waits for connections to close before it cancels
# them (a backstop: failed streams normally end within milliseconds), and how long stopping the
# engine waits for the step in progress.
_BACKSTOP = 1.0
STEP_WAIT = 0.5
# After a shutdown that passed the drain deadline: how long threads still running (a step that
# outlived STEP_WAIT) get before the process exits without them. Deadline + STEP_WAIT + this +
# the interpreter's teardown must stay under Docker's grace.
EXIT_WAIT = 0.1

DEFAULT_REQUEST_READ_TIMEOUT = 30.0  # seconds for a client to send a whole request
DEFAULT_KEEP_ALIVE_TIMEOUT = 5  # idle seconds between two requests (uvicorn's default)
MAX_HEADER_BYTES = 64 * 1024  # h11's buffer for a request line and headers


class DrainingServer(uvicorn.Server):
    """A `uvicorn.Server` that ends open requests itself at `drain_timeout` after shutdown
    begins, by awaiting `on_deadline` (the engine client's stop)."""

    def __init__(
        self,
        config: uvicorn.Config,
        on_deadline: Callable[[], Awaitable[None]],
        drain_timeout: float,
    ) -> None:
        super().__init__(config)
        self.on_deadline = on_deadline
        self.drain_timeout = drain_timeout
        self.deadline_passed = False

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        deadline = asyncio.create_task(self._deadline(), name="drain-deadline")
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await deadline
        if self.deadline_passed:
            await self._exit_if_threads_linger()

    async def _exit_if_threads_linger(self) -> None:
        """Every request has been answered; a thread still running (a step the engine could not
        interrupt) would hold the process at the interpreter's exit, which joins non-daemon
        threads. Give threads `EXIT_WAIT` to end, then exit without them. Only a server that
        owns the process (runs in its main thread, as `python -m server` does) exits this way; one
        embedded in a thread of another program leaves that to its host."""
        if threading.current_thread() is not threading.main_thread():
            return
        loop = asyncio.get_running_loop()
        end = loop.time() + EXIT_WAIT
        while (busy := _lingering_threads()) and loop.time() < end:
            await asyncio.sleep(0.05)
        if busy:
            log.warning(
                "exiting without joining %d thread(s) still alive (%s): an engine step that "
                "cannot be interrupted, or idle pool workers",
                len(busy),
                ", ".join(t.name for t in busy),
            )
            logging.shutdown()  # flush the log handlers: os._exit skips atexit
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)

    async def _deadline(self) -> None:
        await asyncio.sleep(self.drain_timeout)
        self.deadline_passed = True
        open_connections = len(self.server_state.connections)
        if open_connections:
            log.warning(
                "drain deadline of %gs passed with %d open connection(s): ending their requests "
                "with an error",
                self.drain_timeout,
                open_connections,
            )
        await self.on_deadline()


def _lingering_threads() -> list[threading.Thread]:
    """Non-daemon threads other than this one: what the interpreter would wait for at exit
    (idle pool workers count too; exiting past them costs nothing), and the engine thread: a
    daemon, but one still inside a torch op when the interpreter finalizes can crash the exit."""
    me = threading.current_thread()
    return [
        t
        for t in threading.enumerate()
        if t is not me and t.is_alive() and (not t.daemon or t.name == ENGINE_THREAD_NAME)
    ]


def timed_h11(read_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request is not fully received within
    `read_timeout` seconds of its first byte (or of connecting, for the first request)."""

    class TimedH11Protocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._read_timer: asyncio.TimerHandle | None = None
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._read_timer is None and self.conn.their_state is h11.IDLE:
                self._arm()  # the first bytes of the next request on a kept-alive connection
            super().data_received(data)
            if self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
                self._disarm()  # the whole request is in (or the connection is done)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._read_timer = self.loop.call_later(read_timeout, self._read_timed_out)

        def _disarm(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None

        def _read_timed_out(self) -> None:
            self._read_timer = None
            if self.transport.is_closing() or self.conn.their_state not in (
                h11.IDLE,
                h11.SEND_BODY,
            ):
                return
            log.info("closing a connection that sent no complete request in %gs", read_timeout)
            # A route still reading the body sees a disconnect (a quiet 499, server.errors).
            self.transport.close()

    return TimedH11Protocol


def server_config(
    app: Any,
    *,
    host: str,
    port: int,
    log_level: str = "info",
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
    request_read_timeout: float = DEFAULT_REQUEST_READ_TIMEOUT,
    keep_alive_timeout: int = DEFAULT_KEEP_ALIVE_TIMEOUT,
) -> uvicorn.Config:
    """The uvicorn config the CLI (and the shutdown tests) run the app with."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,  # server.requests logs one line per generation request instead
        http=timed_h11(request_read_timeout),
        timeout_keep_alive=keep_alive_timeout,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        # uvicorn's own deadline is only a backstop behind DrainingServer's.
        timeout_graceful_shutdown=drain_timeout + _BACKSTOP,
    )
