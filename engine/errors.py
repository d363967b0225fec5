"""The engine's typed exceptions. The server maps each to one HTTP status in one table.

Every message here is written for the client that sent the request: no internals (tracebacks,
exception reprs) go into them, so the server may show them as they are.
"""


class EngineError(Exception):
    """Base class for errors the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """The engine refuses this request as given (a bad sampling value, a token id outside the
    vocabulary, ...). `param` names the offending field when there is one.

    A ValueError too, so callers that predate the typed errors keep working; the server catches
    this class, never ValueError itself (a ValueError from a bug must not become a 400).
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class RequestTooLongError(InvalidRequestError):
    """The prompt plus max_tokens exceeds the context length or could never fit the KV pool."""


class DuplicateRequestError(InvalidRequestError):
    """A request id that is already live in the engine."""


class QueueFullError(EngineError, RuntimeError):
    """The waiting queue is at its limit; the client should retry later."""


class EngineDeadError(EngineError, RuntimeError):
    """The engine failed (a step raised) or is stopping: it accepts and finishes nothing more."""
