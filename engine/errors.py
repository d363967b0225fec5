"""The engine's typed exceptions. The server maps each to one HTTP status in one handler."""


class EngineError(Exception):
    """Base class for errors the engine raises on purpose."""


class RequestTooLongError(EngineError, ValueError):
    """The prompt plus max_tokens exceeds the context length or could never fit the KV pool."""


class DuplicateRequestError(EngineError, ValueError):
    """A request id that is already live in the engine."""


class EngineDeadError(EngineError, RuntimeError):
    """A step raised; the engine must not be stepped again."""
