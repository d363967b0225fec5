"""Errors at the HTTP edge: OpenAI's error object, the one table from error type to HTTP status,
and the app's exception handlers that apply it.

Every failure leaves as `{"error": {"message", "type", "param", "code"}}` with a real status:
before a stream starts as the response itself, after it as an SSE error event (both built by
`api_error`). The engine's typed errors map through `ERRORS`; an `APIError` says its own status;
anything else is a bug: it is logged with the request id, and the client gets a generic message
naming that id, never the exception's text.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from engine import (
    EngineDeadError,
    EngineError,
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


def request_id_of(request: Request) -> str:
    """The id a route gave this request (a generation's id), or a fresh one for the log."""
    return getattr(request.state, "request_id", None) or f"req-{uuid.uuid4().hex}"


def add_error_handlers(app: FastAPI) -> None:
    def render(exc: APIError) -> Response:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(APIError)
    async def client_error(request: Request, exc: APIError) -> Response:
        return render(exc)

    @app.exception_handler(EngineError)
    async def engine_error(request: Request, exc: EngineError) -> Response:
        return render(api_error(exc, request_id_of(request)))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        # vLLM answers an invalid body with 400 (OpenAI too); FastAPI's default is a 422 of its own shape.
        message, param = _describe_validation_errors(exc.errors())
        return JSONResponse(
            error_body(message, "invalid_request_error", param, None), status_code=400
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(
            exc.status_code
        )
        return JSONResponse(
            error_body(str(exc.detail), kind, None, code),
            status_code=exc.status_code,
            headers=exc.headers,
        )

    @app.exception_handler(ClientDisconnected)
    @app.exception_handler(ClientDisconnect)  # gone (or timed out) while sending its body
    async def disconnected(request: Request, exc: Exception) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        return render(api_error(exc, request_id_of(request)))


# Union members repeat the same field path with a tag naming the member's type
# ("str", "list[int]", "function-after[_valid_unicode(), str]"): not part of the field's path.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool"})
_TYPE_TAG_PREFIXES = ("list[", "dict[", "function-", "constrained-", "lax-", "strict-")


def _field_path(loc: list[str]) -> str:
    """The dotted field path of a pydantic error location, for `param` and the message. A bad
    dict key ("[key]" follows the key) names its dict: the key itself is the client's text."""
    if "[key]" in loc:
        loc = loc[: max(loc.index("[key]") - 1, 0)]
    return ".".join(x for x in loc if x not in _TYPE_TAGS and not x.startswith(_TYPE_TAG_PREFIXES))


def _describe_validation_errors(errors) -> tuple[str, str | None]:
    parts, param = [], None
    for err in errors:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        kind = err.get("type", "")
        if kind == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "")
            parts.append(
                f"the request body is not valid JSON ({detail} at position {loc[0] if loc else '?'})"
            )
            continue
        if not loc and kind in ("model_attributes_type", "dict_type", "model_type"):
            parts.append(
                "the request body must be a JSON object (send Content-Type: application/json)"
            )
            continue
        if not loc and kind == "missing":
            parts.append("a JSON request body is required")
            continue
        path = _field_path(loc)
        param = param or path or None
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        parts.append(f"{path}: {msg}" if path else msg)
    # Unions report one error per member; say each distinct thing once, and not too much of it.
    unique = list(dict.fromkeys(parts))
    message = "; ".join(unique[:5]) + (f" (and {len(unique) - 5} more)" if len(unique) > 5 else "")
    return message or "invalid request", param
