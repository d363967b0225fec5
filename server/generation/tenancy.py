"""Who sends a request, and how many generation requests each sender may have open at once.

`client_identity` names the sender (for the fair scheduling policy and per-client limits);
`ClientSlots` counts each sender's open generation requests against `--max-concurrent-per-client`
and refuses one more with a 429 (`QueueFullError`).
"""

from __future__ import annotations

import hashlib

from starlette.requests import Request as HTTPRequest

from engine import QueueFullError

CLIENT_ID_HEADER = "x-client-id"
MAX_CLIENT_ID_CHARS = 128


def client_identity(http: HTTPRequest) -> str | None:
    """Who sends a request, for per-client fairness and limits: the `X-Client-Id` header, else a
    digest of the bearer token (the key itself is never kept), else the peer's address, else
    None. The header is trusted as given: behind a gateway that sets it, it names the tenant."""
    given = http.headers.get(CLIENT_ID_HEADER)
    if given:
        return "id:" + given[:MAX_CLIENT_ID_CHARS]
    auth = http.headers.get("authorization", "")
    if auth.lower().startswith("bearer ") and auth[7:].strip():
        digest = hashlib.blake2b(auth[7:].strip().encode(), digest_size=8).hexdigest()
        return "key:" + digest
    if http.client is not None:
        return "ip:" + http.client.host
    return None


class ClientSlots:
    """Open generation requests per client identity, at most `limit` each (None: no limit)."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self._open: dict[str | None, int] = {}

    def take(self, client_id: str | None) -> None:
        """Count one more open request for `client_id`, or raise QueueFullError at the limit."""
        open_now = self._open.get(client_id, 0)
        if self.limit is not None and open_now >= self.limit:
            raise QueueFullError(
                f"this client has {open_now} requests in progress, the limit is {self.limit}"
            )
        self._open[client_id] = open_now + 1

    def give_back(self, client_id: str | None) -> None:
        left = self._open.get(client_id, 1) - 1
        if left > 0:
            self._open[client_id] = left
        else:
            self._open.pop(client_id, None)
