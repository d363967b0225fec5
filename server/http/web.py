"""The web page at `/`: a chat box and a live view of the engine, in one static file.

Owns the route that serves `server/http/static/index.html` (plain HTML, CSS and a little JS: no build
step, nothing fetched from elsewhere). The page itself holds no data, so it is served without the
API key; everything it shows comes from `/v1/chat/completions` (streamed) and `/v1/engine/stats`
(polled), which need the key when one is set: the page asks for it in an input and sends it as a
bearer token. `python -m server --no-web-ui` leaves the route out.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from fastapi import APIRouter
from starlette.responses import HTMLResponse

STATIC = Path(__file__).resolve().parent / "static"


@cache
def _page() -> str:
    return (STATIC / "index.html").read_text(encoding="utf-8")


def web_routes() -> APIRouter:
    router = APIRouter()

    @router.get("/", include_in_schema=False)
    async def index() -> HTMLResponse:
        return HTMLResponse(_page(), headers={"Cache-Control": "no-cache"})

    return router
