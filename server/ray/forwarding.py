"""`RayEngineClient`: the ingress's `EngineClient`, forwarding to the engine deployment's handle.

`submit` sends the group as one `EngineCall` (with its route key) through
`handle.options(stream=True).generate`, waits for the replica's `Accepted` (or raises the
engine's typed error from `Refused`), and starts a pump task that feeds the returned
`OutputStream` through its public producer methods. If the replica dies mid-stream the stream
fails with `EngineDeadError`, which the HTTP layer turns into an error event.

`abort(request_id)` closes the request here; when no request of its group is left open the Ray
call is cancelled, which cancels the replica's generator (it aborts in `finally`). Aborting one
choice of a group that goes on (a stop string with n > 1) sends an `AbortCall` pinned to the
replica that runs it.

`stats()` sums the latest snapshot each replica piggybacked on its items; `replica_stats()`
keeps them apart for the per-replica metrics.

`health()` is Serve's view of the engine tier(s), polled every `health_period` seconds by a task
started with the app: unhealthy while any engine deployment of this application has no RUNNING
replica (Serve takes a replica out of RUNNING when it dies or its `check_health` raises, e.g. for
a stuck step), so `/health` answers 503 exactly when no replica could serve a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine import EngineDeadError, EngineStats, Request
from server.engine_client.interface import EngineClient, Health, OutputStream
from server.ray.keys import DEFAULT_ROUTE_BLOCKS, route_key
from server.ray.wire import AbortCall, Accepted, EngineCall, Refused, StepItem

log = logging.getLogger("server.ray.forwarding")

_ZERO = EngineStats(*(0,) * len(dataclasses.fields(EngineStats)))


def call_of_its_own(method: Any, arg: Any) -> Any:
    """`method.remote(arg)` as a Serve call with an internal request id of its own.

    Serve gives every handle call made while it handles one HTTP request that request's internal
    id, and its request router (ray 2.60) indexes the calls waiting for a replica by that id:
    a second call waiting under the same id is never matched to a replica, and the router's loop
    then retries it without ever yielding, which stalls every call of the process. One HTTP
    request makes several concurrent calls when its choices go on to the decode tier or several
    of them are aborted (stop strings with n > 1): each goes out under a fresh id (the HTTP
    request id, used in logs, is kept). Cancelling them is this client's job (`abort`), not
    Serve's parent-child bookkeeping, which keys on that id.
    """
    return contextvars.copy_context().run(_with_fresh_internal_id, method, arg)


def _with_fresh_internal_id(method: Any, arg: Any) -> Any:
    from ray.serve import context

    current = context._get_serve_request_context()
    fresh = dataclasses.replace(current, _internal_request_id=str(uuid.uuid4()))
    context._serve_request_context.set(fresh)  # in the copied context only
    return method.remote(arg)


@dataclass(slots=True)
class CallGroup:
    """One submitted group of requests: its Ray call, the stream its outputs go to, the replica
    serving it, and the task that pumps the call's outputs into the stream."""

    call: Any  # the DeploymentResponseGenerator
    stream: OutputStream
    replica: str
    task: asyncio.Task | None = field(default=None)


class RayEngineClient(EngineClient):
    # Requests carry grammar specs, compiled on the replica (server.engine_client.remote_grammar):
    # a compiled grammar's state does not pickle.
    grammar_placement: str | None = "replica"

    def __init__(
        self,
        handle: Any,
        *,
        max_model_len: int,
        engine_name: str,
        block_size: int,
        route_blocks: int = DEFAULT_ROUTE_BLOCKS,
        deployments: tuple[str, ...] = (),
        health_period: float = 2.0,
    ) -> None:
        self._handle = handle
        self._max_model_len = max_model_len
        self._engine_name = engine_name
        self.block_size = block_size
        self.route_blocks = route_blocks
        self._groups: dict[str, CallGroup] = {}
        self._pumps: set[asyncio.Task] = set()
        self._stats: dict[str, tuple[float, EngineStats]] = {}  # replica -> (when, stats)
        self._stopping = False
        self.replica_failures = 0
        # The engine deployments whose replicas /health watches (empty: not watched).
        self.deployments = deployments
        self.health_period = health_period
        self._tiers_health = Health(True)
        self._watch: asyncio.Task | None = None

    # -- EngineClient ------------------------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def engine_name(self) -> str:
        return self._engine_name

    async def start(self) -> None:
        self._stopping = False
        if self.deployments and self._watch is None:
            self._watch = asyncio.create_task(self._watch_tiers(), name="ray-engine-health")

    async def _watch_tiers(self) -> None:
        from ray import serve

        app = serve.get_replica_context().app_name
        while not self._stopping:
            try:
                # A blocking call to Serve's controller: off the event loop.
                status = await asyncio.to_thread(serve.status)
                deployments = status.applications[app].deployments
                down = [
                    name
                    for name in self.deployments
                    if deployments[name].replica_states.get("RUNNING", 0) == 0
                ]
                self._tiers_health = (
                    Health(False, f"no healthy replica of the {' and '.join(down)} deployment")
                    if down
                    else Health(True)
                )
            except Exception as e:  # the controller busy or restarting: keep the last verdict
                log.warning("could not read Serve's status: %r", e)
            await asyncio.sleep(self.health_period)

    async def stop(self, timeout: float = 30.0) -> None:
        """Serve has drained the ingress's HTTP requests before this runs; end what is left."""
        self._stopping = True
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        if self._pumps:
            await asyncio.wait(set(self._pumps), timeout=timeout)
        for group in {id(g): g for g in self._groups.values()}.values():
            group.stream.fail(EngineDeadError("the server is shutting down"))
            group.call.cancel()
        self._groups.clear()

    async def submit(self, requests: Sequence[Request]) -> OutputStream:
        if self._stopping:
            raise EngineDeadError("the server is shutting down")
        first_req = requests[0]
        key = route_key(
            first_req.prompt_token_ids, self.block_size, self.route_blocks, first_req.cache_salt
        )
        call = self._handle.options(stream=True).generate.remote(EngineCall(tuple(requests), key))
        try:
            first = await call.__anext__()
        except asyncio.CancelledError:
            call.cancel()
            raise
        except Exception as e:  # no replica could take it (all dead, deployment gone)
            log.warning("engine call failed before acceptance: %r", e)
            raise EngineDeadError("no engine replica accepted the request") from None
        if isinstance(first, Refused):
            raise first.error()
        assert isinstance(first, Accepted), first
        self._note_stats(first.replica, first.stats)
        stream = OutputStream([r.request_id for r in requests])
        group = CallGroup(call, stream, first.replica)
        for r in requests:
            self._groups[r.request_id] = group
        task = asyncio.create_task(self._pump(group), name="ray-engine-pump")
        group.task = task
        self._pumps.add(task)
        task.add_done_callback(self._pumps.discard)
        return stream

    async def _pump(self, group: CallGroup) -> None:
        stream = group.stream
        try:
            async for item in group.call:
                if isinstance(item, Refused):  # the engine failed while generating
                    stream.fail(item.error())
                    break
                assert isinstance(item, StepItem), item
                if item.stats is not None:
                    self._note_stats(group.replica, item.stats)
                out = item.output
                if out.finished:
                    self._groups.pop(out.request_id, None)
                stream.deliver(out)
        except asyncio.CancelledError:
            stream.fail(EngineDeadError("the server is shutting down"))
            raise
        except Exception as e:  # the replica died (actor killed, node lost) or the call ended
            if stream.open_request_ids:
                self.replica_failures += 1
                log.warning("engine replica %s failed mid-stream: %r", group.replica, e)
                self._stats.pop(group.replica, None)
            stream.fail(EngineDeadError("the engine replica failed while generating"))
        finally:
            for request_id in stream.request_ids:
                if self._groups.get(request_id) is group:
                    del self._groups[request_id]

    def abort(self, request_id: str) -> None:
        group = self._groups.pop(request_id, None)
        if group is None:
            return
        group.stream.close(request_id)
        if not group.stream.open_request_ids:
            group.call.cancel()  # cancels the replica's generator: it aborts in `finally`
        else:
            with contextlib.suppress(Exception):  # best effort; the replica frees it at the end
                call_of_its_own(self._handle.abort, AbortCall(request_id, group.replica))

    def health(self) -> Health:
        if self._stopping:
            return Health(False, "the server is shutting down")
        return self._tiers_health

    def stats(self) -> EngineStats:
        total = _ZERO
        for _, s in self._stats.values():
            total = EngineStats(*(a + b for a, b in zip(_astuple(total), _astuple(s), strict=True)))
        return total

    # -- per replica -------------------------------------------------------------------------------

    def _note_stats(self, replica: str, stats: EngineStats) -> None:
        self._stats[replica] = (time.monotonic(), stats)

    def replica_stats(self) -> dict[str, EngineStats]:
        return {replica: s for replica, (_, s) in self._stats.items()}


def _astuple(s: EngineStats) -> tuple[int, ...]:
    return tuple(getattr(s, f.name) for f in dataclasses.fields(s))
