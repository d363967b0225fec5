"""`create_app`: the FastAPI application, its routes, lifespan, error mapping and HTTP guards.

Owns the HTTP surface: which paths exist, that every error leaves as OpenAI's error object with a
real status (never FastAPI's default shape, never a 500 for bad input), the bearer-token check,
the request-body size limit, and counting requests by status. Routes reach the engine only through
the `OpenAIServing` (and its `EngineClient`) stored on the app, via FastAPI dependencies; the
lifespan starts and stops the engine client.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from models import LoadedModel
from server.driver import AsyncEngineDriver, EngineClient
from server.metrics import CONTENT_TYPE, ServerMetrics
from server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
)
from server.serving import ClientDisconnected, ModelCard, OpenAIServing

log = logging.getLogger("server.app")

# Paths that need the API key when one is set. /health and /metrics stay open (probes, scrapers).
_PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
_COUNTED_PATHS = frozenset(
    {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize", "/health"}
)


@dataclass(frozen=True, slots=True)
class ServerSettings:
    served_model_names: tuple[str, ...] = ()  # default: the model's own name
    api_key: str | None = None
    max_body_bytes: int = 4 * 2**20
    log_prompts: bool = False
    shutdown_timeout: float = 30.0  # how long the lifespan waits for the engine to stop


def create_app(
    model: LoadedModel, engine_client: EngineClient, settings: ServerSettings | None = None
) -> FastAPI:
    """Build the app. `engine_client` is started and stopped by the app's lifespan."""
    settings = settings or ServerSettings()
    names = settings.served_model_names or (model.name,)
    card = ModelCard(
        names=tuple(names),
        max_model_len=engine_client.max_model_len,
        parameter_count=model.num_parameters(),
        engine=engine_client.engine_name,
    )
    metrics = ServerMetrics(engine_client.stats, lambda: engine_client.health().ok)
    if isinstance(engine_client, AsyncEngineDriver) and engine_client.observer is None:
        engine_client.observer = metrics  # the in-process driver reports step and queue times
    serving = OpenAIServing(
        engine_client, model.tokenizer, card, metrics, log_prompts=settings.log_prompts
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine_client.start()
        log.info(
            "serving %s (%s, %d parameters, context %d) with the %s engine",
            card.name,
            model.name,
            card.parameter_count,
            card.max_model_len,
            card.engine,
        )
        try:
            yield
        finally:
            await engine_client.stop(timeout=settings.shutdown_timeout)

    app = FastAPI(title="cbserve", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.state.engine_client = engine_client
    app.state.serving = serving
    app.state.metrics = metrics
    _add_error_handlers(app)
    # Starlette runs the last added middleware first: count -> authenticate -> limit the body.
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)
    app.add_middleware(RequestCounterMiddleware, metrics=metrics)
    app.include_router(_routes())
    return app


# --------------------------------------------------------------------------------------------------
# Routes
# --------------------------------------------------------------------------------------------------


def get_serving(request: Request) -> OpenAIServing:
    return request.app.state.serving


def get_engine_client(request: Request) -> EngineClient:
    return request.app.state.engine_client


def get_metrics(request: Request) -> ServerMetrics:
    return request.app.state.metrics


EngineDep = Annotated[EngineClient, Depends(get_engine_client)]
MetricsDep = Annotated[ServerMetrics, Depends(get_metrics)]
ServingDep = Annotated[OpenAIServing, Depends(get_serving)]


def _routes() -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health(client: EngineDep) -> Response:
        h = client.health()
        if h.ok:
            return JSONResponse({"status": "ok"})
        return JSONResponse(
            error_body(h.reason or "unhealthy", "server_error", None, "engine_unhealthy"),
            status_code=503,
        )

    @router.get("/metrics")
    async def metrics(m: MetricsDep) -> Response:
        return Response(m.render(), media_type=CONTENT_TYPE)

    @router.get("/v1/models")
    async def list_models(serving: ServingDep) -> Response:
        return JSONResponse(serving.models())

    @router.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, serving: ServingDep) -> Response:
        for entry in serving.models()["data"]:
            if entry["id"] == model_id:
                return JSONResponse(entry)
        raise APIError(
            404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found"
        )

    @router.post("/v1/completions")
    async def completions(
        body: CompletionRequest, request: Request, serving: ServingDep
    ) -> Response:
        return await serving.completions(body, request)

    @router.post("/v1/chat/completions")
    async def chat_completions(
        body: ChatCompletionRequest, request: Request, serving: ServingDep
    ) -> Response:
        return await serving.chat(body, request)

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest, serving: ServingDep) -> Response:
        return JSONResponse(serving.tokenize(body))

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, serving: ServingDep) -> Response:
        return JSONResponse(serving.detokenize(body))

    return router


# --------------------------------------------------------------------------------------------------
# Errors: every failure leaves as {"error": {"message", "type", "param", "code"}}
# --------------------------------------------------------------------------------------------------


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

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
    async def disconnected(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return JSONResponse(
            error_body(f"internal server error: {exc!r}", "server_error", None, "internal_error"),
            status_code=500,
        )


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
        # Union members repeat the same field path with a type suffix: keep only the field path.
        path = ".".join(x for x in loc if not x.startswith(("list[", "str", "int", "function-")))
        param = param or path or None
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        parts.append(f"{path}: {msg}" if path else msg)
    # Unions report one error per member; say each distinct thing once, and not too much of it.
    unique = list(dict.fromkeys(parts))
    message = "; ".join(unique[:5]) + (f" (and {len(unique) - 5} more)" if len(unique) > 5 else "")
    return message or "invalid request", param


# --------------------------------------------------------------------------------------------------
# HTTP guards (pure ASGI middleware: they must not buffer streamed responses)
# --------------------------------------------------------------------------------------------------


async def _send_error(
    send: Send, status: int, body: dict, headers: dict[str, str] | None = None
) -> None:
    response = JSONResponse(body, status_code=status, headers=headers)
    await response({"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:  # pragma: no cover - JSONResponse never reads
    return {"type": "http.disconnect"}


class APIKeyMiddleware:
    """401 unless `Authorization: Bearer <api_key>` (only when a key is configured)."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            self.key is None
            or scope["type"] != "http"
            or not scope["path"].startswith(_PROTECTED_PREFIXES)
        ):
            await self.app(scope, receive, send)
            return
        auth = ""
        for name, value in scope["headers"]:
            if name == b"authorization":
                auth = value.decode("latin-1")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.key):
            await self.app(scope, receive, send)
            return
        await _send_error(
            send,
            401,
            error_body(
                "Invalid or missing API key (send Authorization: Bearer <key>).",
                "invalid_request_error",
                None,
                "invalid_api_key",
            ),
            {"WWW-Authenticate": "Bearer"},
        )


class BodyLimitMiddleware:
    """413 for a request body over `max_bytes`: from Content-Length up front, or while reading a
    chunked body (the route's body read then fails with the 413)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    length = 0
                if length > limit:
                    await _send_error(send, 413, self._body(length))
                    return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise StarletteHTTPException(413, self._body(seen)["error"]["message"])
            return message

        await self.app(scope, limited_receive, send)

    def _body(self, size: int) -> dict:
        return error_body(
            f"request body of {size} bytes exceeds the limit of {self.max_bytes} bytes",
            "invalid_request_error",
            None,
            "request_too_large",
        )


class RequestCounterMiddleware:
    """Counts API requests by endpoint and response status for /metrics."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in _COUNTED_PATHS:
            await self.app(scope, receive, send)
            return
        status = 500  # if the app fails before starting a response

        async def counting_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            self.metrics.requests.labels(scope["path"], str(status)).inc()
