"""The OpenAI wire format as a client sees it: SSE framing, error bodies, text deltas.

Owns everything both the client and the load generator need to read a server's bytes: splitting a
`text/event-stream` into `data:` payloads, turning a JSON chunk into a dict (or a `ClientError` when
the server sends an error event mid-stream), pulling the text out of a completion or chat chunk, and
mapping an HTTP error body to a `ClientError`. No I/O happens here, so sync and async callers share it.
"""

from __future__ import annotations

import json
from typing import Any

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DONE = "[DONE]"


class ClientError(Exception):
    """An error reported by the server: an HTTP status before streaming, or an error event after.

    `status` is None for an error that arrived inside a 200 stream (the status line was already sent).
    """

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        type: str | None = None,
        param: str | None = None,
        code: str | int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code

    def __str__(self) -> str:
        where = f"HTTP {self.status}" if self.status is not None else "stream error"
        kind = f" {self.type}" if self.type else ""
        return f"{where}{kind}: {self.message}"


def normalize_base_url(base_url: str) -> str:
    """Accept both `http://host:port` and the OpenAI SDK's `http://host:port/v1` spelling.

    Our paths carry `/v1` themselves, and some endpoints (`/tokenize`, `/health`) live at the root.
    """
    url = base_url.rstrip("/")
    return url.removesuffix("/v1")


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def error_from_body(status: int | None, body: bytes | str, reason: str = "") -> ClientError:
    """Build a `ClientError` from an error body, whatever shape the server chose.

    OpenAI and current vLLM: `{"error": {"message", "type", "param", "code"}}`; older vLLM sends
    that object flat with `"object": "error"`; FastAPI's default is `{"detail": ...}`; anything
    else (a proxy's HTML page) is kept as text so the user still sees it.
    """
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    try:
        obj: Any = json.loads(text)
    except ValueError:
        return ClientError(text.strip() or reason or "unknown error", status=status)
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict):
            return _from_error_object(err, status)
        if isinstance(err, str):
            return ClientError(err, status=status)
        if obj.get("object") == "error":
            return _from_error_object(obj, status)
        if "detail" in obj:
            return ClientError(str(obj["detail"]), status=status)
    return ClientError(text.strip() or reason or "unknown error", status=status)


def _from_error_object(err: dict[str, Any], status: int | None) -> ClientError:
    return ClientError(
        str(err.get("message") or "unknown error"),
        status=status,
        type=err.get("type"),
        param=err.get("param"),
        code=err.get("code"),
    )


class SSEDecoder:
    """Turns the lines of a `text/event-stream` into the data payload of each event.

    Feed it lines without their line terminators (as httpx's `iter_lines` yields them). An event
    ends at a blank line; its `data:` lines are joined with newlines, comment lines (`: ping`, which
    sse-starlette sends to keep idle connections open) and other fields are skipped.
    """

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        """Take one line; return the event's data when this line completes an event."""
        if not line:
            return self.flush()
        if line.startswith(":"):
            return None
        field, _, value = line.partition(":")
        if field == "data":
            self._data.append(value.removeprefix(" "))
        return None

    def flush(self) -> str | None:
        """End the current event (a blank line, or the end of the stream)."""
        if not self._data:
            return None
        data = "\n".join(self._data)
        self._data = []
        return data


def parse_chunk(data: str) -> dict[str, Any]:
    """Decode one SSE data payload (not `[DONE]`); an error event raises `ClientError`."""
    try:
        obj = json.loads(data)
    except ValueError as exc:
        raise ClientError(f"malformed stream chunk: {data[:200]!r}") from exc
    if not isinstance(obj, dict):
        raise ClientError(f"malformed stream chunk: {data[:200]!r}")
    if "error" in obj or obj.get("object") == "error":
        raise error_from_body(None, data)
    return obj


def carries_tokens(chunk: dict[str, Any]) -> bool:
    """Does a streamed chunk report generated tokens?

    A choice with text does; so does one with empty text and no finish_reason (a special token or
    half a character: servers such as vLLM and ours stream a chunk per token even then). Not a
    chat chunk that only announces the role, not an empty chunk that only carries finish_reason
    (OpenAI's closing chunk), and not the usage chunk (no choices).
    """
    for choice in chunk.get("choices") or ():
        if "delta" in choice:
            delta = choice.get("delta") or {}
            if delta.get("content") or (
                "role" not in delta and choice.get("finish_reason") is None
            ):
                return True
        elif "text" in choice and (choice.get("text") or choice.get("finish_reason") is None):
            return True
    return False


def chunk_text(chunk: dict[str, Any]) -> str:
    """The text a streamed chunk adds, over all its choices (completion `text` or chat `delta`).

    The usage chunk (`choices: []`) and a chat chunk that only announces the role both add "".
    """
    parts: list[str] = []
    for choice in chunk.get("choices") or ():
        if "delta" in choice:
            parts.append((choice.get("delta") or {}).get("content") or "")
        else:
            parts.append(choice.get("text") or "")
    return "".join(parts)
