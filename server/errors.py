"""Errors at the HTTP edge: OpenAI's error object and the one table from error type to HTTP
status (the app's exception handlers that apply it are `server.http.error_handlers`').

Every failure leaves as `{"error": {"message", "type", "param", "code"}}` with a real status:
before a stream starts as the response itself, after it as an SSE error event (both built by
`api_error`). The engine's typed errors map through `ERRORS`; an `APIError` says its own status;
anything else is a bug: it is logged with the request id, and the client gets a generic message
naming that id, never the exception's text.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from engine import (
    EngineDeadError,
    InvalidRequestError,
    QueueFullError,
    RequestTooLongError,
)

log = logging.getLogger("server.errors")


def error_body(
    message: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    return {
        "error": {
            "message": encodable(message),
            "type": type,
            "param": None if param is None else encodable(param),
            "code": code,
        }
    }


def encodable(text: str) -> str:
    """`text` with anything UTF-8 cannot encode (lone surrogates from a client's JSON, echoed in
    a message or a field path) replaced by "?": an error body must always be sendable, or the
    error itself becomes a 500."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")


class APIError(Exception):
    """An error the client caused or must know about, rendered as OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


class ClientDisconnected(Exception):
    """The client went away before its (non-streamed) response was ready."""


@dataclass(frozen=True, slots=True)
class ErrorSpec:
    status: int
    type: str
    code: str | None = None
    retry_after: int | None = None  # seconds, sent as Retry-After


# The one table from the engine's errors to HTTP. Looked up along the exception's MRO, so a
# subclass without its own row takes its parent's.
ERRORS: dict[type[Exception], ErrorSpec] = {
    RequestTooLongError: ErrorSpec(400, "invalid_request_error", "context_length_exceeded"),
    InvalidRequestError: ErrorSpec(400, "invalid_request_error"),
    QueueFullError: ErrorSpec(429, "rate_limit_error", "rate_limit_exceeded", retry_after=1),
    EngineDeadError: ErrorSpec(503, "server_error", "engine_unavailable"),
}
INTERNAL_ERROR = ErrorSpec(500, "server_error", "internal_error")


def api_error(exc: BaseException, request_id: str) -> APIError:
    """The `APIError` a client sees for `exc` (see the module docstring)."""
    if isinstance(exc, APIError):
        return exc
    spec = next((ERRORS[c] for c in type(exc).__mro__ if c in ERRORS), None)
    if spec is None:
        log.error("internal error in request %s", request_id, exc_info=exc)
        spec, message = INTERNAL_ERROR, f"internal server error (request id {request_id})"
    elif spec.status >= 500:
        message = f"{exc} (request id {request_id})"  # engine messages carry no internals
    else:
        message = str(exc)
    return APIError(
        spec.status,
        message,
        type=spec.type,
        param=getattr(exc, "param", None),
        code=spec.code,
        headers=None if spec.retry_after is None else {"Retry-After": str(spec.retry_after)},
    )


def grammar_error_code(param: str | None) -> str:
    """The 400 code of a grammar's failure (one that does not parse or compile, or that reaches
    a dead end mid-generation): the tools' grammar, or structured output's."""
    return "invalid_tools" if param and param.startswith("tools") else "invalid_structured_output"
