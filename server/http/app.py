"""`create_app`: the FastAPI application, its routes, lifespan and HTTP guards.

Owns the HTTP surface: which paths exist, the bearer-token check, the request-body size limit,
and counting requests by status (errors are rendered by `server.errors`' handlers). Routes reach
the engine only through the `OpenAIServing` (and its `EngineClient`) stored on the app, via
FastAPI dependencies; the lifespan starts and stops the engine client. The app holds no model:
a tokenizer, a `ModelCard` and an engine client are all it needs, so the engine may live
elsewhere.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from models import Tokenizer
from server.engine_client.interface import EngineClient
from server.errors import APIError, error_body
from server.generation.metrics import CONTENT_TYPE, ServerMetrics
from server.grammars.check_worker import CheckBudget
from server.http.error_handlers import add_error_handlers
from server.http.openapi import install_openapi
from server.http.options import add_cors, settings_fields
from server.http.web import web_routes
from server.openai.embeddings import EmbeddingRequest, create_embeddings
from server.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    TokenizeRequest,
)
from server.openai.responses import ResponsesRequest, create_response
from server.openai.serving import DEFAULT_RESPONSE_BUDGET, OpenAIServing

log = logging.getLogger("server.app")

# Paths that need the API key when one is set. /health and /metrics stay open (probes, scrapers).
_PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
_COUNTED_PATHS = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/embeddings",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/health",
    }
)


@dataclass(frozen=True, slots=True)
class ServerSettings:
    api_key: str | None = None
    # -- the options of server.http.options (both command lines set them) --
    api_keys: tuple[str, ...] = ()  # more accepted keys (--api-key repeated, --api-key-file)
    allowed_origins: tuple[str, ...] = ()  # CORS; empty: no CORS headers
    chat_template: str | None = None  # the template text that replaces the model's
    tool_call_parser: str = "auto"
    reasoning_parser: str | None = None
    max_body_bytes: int = 4 * 2**20
    log_prompts: bool = False
    shutdown_timeout: float = 7.0  # how long the lifespan waits for the engine to stop
    # Open generation requests one client (X-Client-Id, else API key) may have; None: no limit.
    max_concurrent_per_client: int | None = None
    # A streamed response whose client reads nothing for this long is aborted; None: never.
    stall_timeout: float | None = 60.0
    web_ui: bool = True  # the page at / (server.http.web); `--no-web-ui` turns it off
    # Entries one response may carry (server.openai.serving: logprobs over every choice, embedded
    # input tokens); a request over it is a 400 before it runs.
    response_budget: int = DEFAULT_RESPONSE_BUDGET
    # What checking one new grammar may take, out of process (server.grammars.check_worker).
    grammar_budget: CheckBudget = CheckBudget()


def settings_from_flags(args: argparse.Namespace) -> ServerSettings:
    """The settings the flags of `python -m server` and `python -m server.ray` give (files such
    as --api-key-file read here). OSError / ValueError: a bad flag."""
    return ServerSettings(
        **settings_fields(args),
        max_body_bytes=args.max_body_size,
        log_prompts=args.log_prompts,
        shutdown_timeout=args.shutdown_timeout,
        max_concurrent_per_client=args.max_concurrent_per_client or None,
        stall_timeout=args.stall_timeout or None,
        web_ui=args.web_ui,
    )


def create_app(
    tokenizer: Tokenizer,
    card: ModelCard,
    engine_client: EngineClient,
    settings: ServerSettings | None = None,
) -> FastAPI:
    """Build the app. `engine_client` is started and stopped by the app's lifespan."""
    settings = settings or ServerSettings()
    metrics = ServerMetrics(engine_client.stats, lambda: engine_client.health().ok)
    engine_client.set_observer(metrics)  # step and queue times, where the client measures them
    serving = OpenAIServing(
        engine_client,
        tokenizer,
        card,
        metrics,
        log_prompts=settings.log_prompts,
        max_concurrent_per_client=settings.max_concurrent_per_client,
        stall_timeout=settings.stall_timeout,
        chat_template=settings.chat_template,
        tool_call_parser=settings.tool_call_parser,
        reasoning_parser=settings.reasoning_parser,
        response_budget=settings.response_budget,
        grammar_budget=settings.grammar_budget,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine_client.start()
        log.info(
            "serving %s (%d parameters, context %d) with the %s engine",
            card.name,
            card.parameter_count,
            card.max_model_len,
            card.engine,
        )
        try:
            yield
        finally:
            try:
                await engine_client.stop(timeout=settings.shutdown_timeout)
            finally:
                serving.close()

    app = FastAPI(title="cbserve", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.state.engine_client = engine_client
    app.state.serving = serving
    app.state.metrics = metrics
    add_error_handlers(app)
    # Starlette runs the last added middleware first: count -> authenticate -> limit the body.
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    keys = tuple(k for k in (settings.api_key, *settings.api_keys) if k)
    app.add_middleware(APIKeyMiddleware, api_keys=keys)
    app.add_middleware(RequestCounterMiddleware, metrics=metrics)
    add_cors(app, settings.allowed_origins)  # outermost: preflights skip the key check
    app.include_router(_routes())
    if settings.web_ui:
        app.include_router(web_routes())
    install_openapi(
        app, card, tokenizer.vocab_size
    )  # 400 not 422, the OpenAI error schema, SSE, the model's limits
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


# A JSON body at least this large is parsed in its turn (`_PacedRequest`).
LARGE_BODY = 256 * 1024


class _PacedRequest(Request):
    """A request whose large JSON body waits its turn to be parsed. Parsing holds the event loop
    (and the GIL: no thread would help) for ~10 ms a megabyte; eight clients sending 4 MB
    bodies would queue eight parses ahead of a /health probe. One at a time, everything else
    the loop has to do runs between two of them."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            if len(body) >= LARGE_BODY:
                state = self.scope["app"].state
                if getattr(state, "parse_turn", None) is None:
                    state.parse_turn = asyncio.Lock()  # made in the app's own loop
                async with state.parse_turn:
                    self._json = json.loads(body)
            else:
                self._json = json.loads(body)
        return self._json


class _Route(APIRoute):
    """Routes whose bodies are parsed by `_PacedRequest` (FastAPI's custom request hook)."""

    def get_route_handler(self) -> Any:
        handler = super().get_route_handler()

        async def paced(request: Request) -> Response:
            return await handler(_PacedRequest(request.scope, request.receive))

        return paced


def _routes() -> APIRouter:
    router = APIRouter(route_class=_Route)

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

    @router.get("/v1/engine/stats")
    async def engine_stats(client: EngineDep, m: MetricsDep) -> Response:
        # The web page's live view (server.generation.live); behind the API key like the rest of /v1.
        return JSONResponse(m.live.snapshot(client.stats()))

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

    @router.post("/v1/responses")  # the Responses API, on the chat path (server.openai.responses)
    async def responses(body: ResponsesRequest, request: Request, serving: ServingDep) -> Response:
        return await create_response(serving, body, request)

    @router.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request, serving: ServingDep) -> Response:
        return await create_embeddings(serving, body, request)  # server.openai.embeddings

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest, serving: ServingDep) -> Response:
        return JSONResponse(await serving.tokenize(body))

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, serving: ServingDep) -> Response:
        return JSONResponse(serving.detokenize(body))

    return router


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
    """401 unless `Authorization: Bearer <key>` with one of the keys (only when keys are
    configured)."""

    def __init__(self, app: ASGIApp, api_keys: tuple[str, ...]) -> None:
        self.app = app
        self.keys = tuple(k.encode() for k in api_keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            not self.keys
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
        given = token.strip().encode()
        # Every key compared (no early exit): the time taken does not say which one matched.
        matched = [hmac.compare_digest(given, key) for key in self.keys]
        if scheme.lower() == "bearer" and any(matched):
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
