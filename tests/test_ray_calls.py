"""How the ingress's calls reach Serve's router, without a cluster (the full path is in
tests/test_ray_serve.py):

- every decode call and abort goes out under an internal request id of its own. Serve (2.60)
  gives each call the internal id of the HTTP request it was made for and indexes the calls waiting
  for a replica by it: two calls of one request waiting at once left one of them unrouted and
  the router spinning, which hung the whole ingress (a hung request in about 1 of 3 runs);
- a call pinned to a replica that is gone is answered with the other replicas, never with no
  replica (Serve then retries at once without yielding: the same spin).

Serve's objects are stood in for by plain namespaces carrying the fields the code reads.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve", reason="the [ray] extra is not installed")

from ray.serve import context  # noqa: E402

from server.ray.forwarding import call_of_its_own  # noqa: E402
from server.ray.keys import Placement  # noqa: E402
from server.ray.router import PrefixAwareRouter  # noqa: E402
from server.ray.wire import AbortCall, Probe, ReleaseCall  # noqa: E402

pytestmark = pytest.mark.ray


class _Method:
    """What a handle method's `.remote` sees of the request context, call by call."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def remote(self, arg: object) -> object:
        ctx = context._get_serve_request_context()
        self.seen.append((ctx.request_id, ctx._internal_request_id))
        return arg


def test_each_call_gets_its_own_internal_id_and_keeps_the_request_id() -> None:
    async def in_a_request() -> tuple[list[tuple[str, str]], str]:
        context._set_request_context(request_id="http-1", _internal_request_id="internal-1")
        method = _Method()
        for k in range(3):  # the choices of one request going on to the decode tier
            assert call_of_its_own(method, k) == k
        return method.seen, context._get_serve_request_context()._internal_request_id

    seen, after = asyncio.run(in_a_request())
    assert [rid for rid, _ in seen] == ["http-1"] * 3  # logs still name the HTTP request
    internal = [iid for _, iid in seen]
    assert len(set(internal)) == 3 and "internal-1" not in internal
    assert after == "internal-1"  # the request's own context is left as it was


def _router(replicas: list[str]) -> tuple[PrefixAwareRouter, list[SimpleNamespace]]:
    router = PrefixAwareRouter.__new__(PrefixAwareRouter)  # Serve builds it with a live handle
    router.initialize_state()
    assert isinstance(router.placement, Placement)
    candidates = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=r)) for r in replicas]
    return router, candidates


@pytest.mark.parametrize(
    "call", [AbortCall("req-1", "r2"), ReleaseCall("req-1", "r2"), Probe("r2")]
)
def test_a_pinned_call_goes_to_its_replica_or_to_any_when_it_is_gone(call) -> None:
    router, candidates = _router(["r1", "r2"])
    pending = SimpleNamespace(args=(call,))
    ranks = asyncio.run(router.choose_replicas(candidates, pending))
    assert [[r.replica_id.unique_id for r in rank] for rank in ranks] == [["r2"]]
    ranks = asyncio.run(router.choose_replicas(candidates[:1], pending))  # r2 died
    assert [[r.replica_id.unique_id for r in rank] for rank in ranks] == [["r1"]]
