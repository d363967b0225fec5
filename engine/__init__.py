"""Scheduling and KV memory, in token ids: continuous and static batching over a paged KV cache.

No HTTP, no pydantic, no text: the server turns text into ids and ids back into text.
"""

from engine.core import (
    ENGINES,
    ContinuousBatchEngine,
    EngineStats,
    NaiveEngine,
    StaticBatchEngine,
    make_engine,
)
from engine.errors import DuplicateRequestError, EngineDeadError, EngineError, RequestTooLongError
from engine.request import (
    FINISH_REASONS,
    Request,
    RequestState,
    RequestStatus,
    SamplingParams,
    StepOutput,
    TokenLogprob,
)

__all__ = [
    "ENGINES",
    "FINISH_REASONS",
    "ContinuousBatchEngine",
    "DuplicateRequestError",
    "EngineDeadError",
    "EngineError",
    "EngineStats",
    "NaiveEngine",
    "Request",
    "RequestState",
    "RequestStatus",
    "RequestTooLongError",
    "SamplingParams",
    "StaticBatchEngine",
    "StepOutput",
    "TokenLogprob",
    "make_engine",
]
