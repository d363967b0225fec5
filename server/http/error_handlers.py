"""The app's exception handlers: every failure leaves as OpenAI's error object with a real status
(`server.errors` builds it), an invalid body as a 400 naming the field (FastAPI's default is a
422 of its own shape), a client gone while sending its body as a quiet 499.
"""

from __future__ import annotations

import uuid

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from engine import EngineError
from server.errors import APIError, ClientDisconnected, api_error, error_body


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
