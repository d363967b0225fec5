"""What crosses the engine deployment's handle: small picklable dataclasses of token ids.

The ingress sends one `EngineCall` (a group of requests: the choices of one HTTP request) and
reads a stream of items back: first `Accepted` (or `Refused`, with the engine's typed error as
plain fields), then one `StepItem` per engine step per request (every token the request got in
that step, never one item per token: each item costs milliseconds of Ray overhead).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine import errors as engine_errors
from engine.interface import EngineStats
from engine.request import Request, StepOutput
from engine.tiers import RequestSnapshot


@dataclass(frozen=True, slots=True)
class EngineCall:
    requests: tuple[Request, ...]
    route_key: bytes | None = None  # read by `PrefixAwareRouter`; None: no full block


@dataclass(frozen=True, slots=True)
class AbortCall:
    """Abort one request of a group whose other requests go on (a stop string in choice k).
    `replica` pins it to the replica that runs the request (`PrefixAwareRouter` honours it)."""

    request_id: str
    replica: str


@dataclass(frozen=True, slots=True)
class Accepted:
    replica: str  # the replica's unique id
    stats: EngineStats


# The engine's typed errors that may cross, by class name (each rebuilt as the same class, so the
# HTTP edge maps it to the same status and code as in one process).
_ERRORS = {
    cls.__name__: cls
    for cls in (
        engine_errors.RequestTooLongError,
        engine_errors.DuplicateRequestError,
        engine_errors.InvalidRequestError,
        engine_errors.QueueFullError,
        engine_errors.EngineDeadError,
    )
}


@dataclass(frozen=True, slots=True)
class Refused:
    """The engine refused the group: the typed error as plain fields (exceptions with their own
    constructors do not all survive pickling)."""

    kind: str  # a class name of `_ERRORS`
    message: str
    param: str | None = None

    @classmethod
    def of(cls, error: Exception) -> Refused:
        kind = type(error).__name__ if type(error).__name__ in _ERRORS else "EngineDeadError"
        return cls(kind, str(error), getattr(error, "param", None))

    def error(self) -> Exception:
        cls = _ERRORS[self.kind]
        if issubclass(cls, engine_errors.InvalidRequestError):
            return cls(self.message, self.param)
        return cls(self.message)


@dataclass(frozen=True, slots=True)
class StepItem:
    output: StepOutput
    stats: EngineStats | None = None  # the replica's stats after that step (for /metrics)


@dataclass(frozen=True, slots=True)
class Probe:
    """Ask one replica (`replica`, pinned like `AbortCall`) for its state."""

    replica: str


# -- the disaggregated tiers (`server.ray.disagg`) -------------------------------------------------


@dataclass(frozen=True, slots=True)
class HandedOff:
    """Prefill tier -> ingress: a request's first token, and where its K/V waits. The K/V bytes
    stay in Ray's object store (`kv` is an `ObjectRef`): never inlined in a stream item."""

    output: StepOutput  # the first token (not finished)
    snapshot: RequestSnapshot
    kv: Any  # ray.ObjectRef of engine.kv_connector.pack_blocks bytes
    kv_bytes: int
    stats: EngineStats | None = None


@dataclass(frozen=True, slots=True)
class ReleaseCall:
    """Ingress -> the prefill replica that handed `request_id` off: the decode tier holds its K/V
    now (or never will), so the replica stops pinning the object. Pinned like `AbortCall`."""

    request_id: str
    replica: str


@dataclass(frozen=True, slots=True)
class DecodeCall:
    """Ingress -> decode tier: continue one prefilled request; it fetches `kv` itself."""

    snapshot: RequestSnapshot
    kv: Any  # the ObjectRef of `HandedOff.kv` (nested, so Ray does not resolve it for us)
