"""Scheduling and KV memory, in token ids: continuous and static batching over a paged KV cache.

No HTTP, no pydantic, no text: the server turns text into ids and ids back into text. Every
engine implements `engine.interface.Engine`, is built from an `EngineConfig`, and is listed by
short name in `engine.registry`.

Names are imported lazily (PEP 562), so `engine.registry` (the engine names a command line
offers) can be read without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BatchEngine": "engine.batch",
    "BatchMode": "engine.batch",
    "ContinuousBatchEngine": "engine.batch",
    "StaticBatchEngine": "engine.batch",
    "EngineBase": "engine.core",
    "NaiveEngine": "engine.core",
    "DisaggregatedEngine": "engine.disaggregated",
    "PooledEngine": "engine.pooled",
    "DecodeEngine": "engine.tiers",
    "PrefillEngine": "engine.tiers",
    "SchedulingPolicy": "engine.policy",
    "Engine": "engine.interface",
    "EngineConfig": "engine.interface",
    "EngineStats": "engine.interface",
    "ENGINES": "engine.registry",
    "engine_class": "engine.registry",
    "engine_names": "engine.registry",
    "make_engine": "engine.registry",
    "DuplicateRequestError": "engine.errors",
    "EngineDeadError": "engine.errors",
    "EngineError": "engine.errors",
    "InvalidRequestError": "engine.errors",
    "QueueFullError": "engine.errors",
    "RequestTooLongError": "engine.errors",
    "FINISH_REASONS": "engine.request",
    "Request": "engine.request",
    "RequestState": "engine.request",
    "RequestStatus": "engine.request",
    "SamplingParams": "engine.request",
    "StepOutput": "engine.request",
    "TokenLogprob": "engine.request",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'engine' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
