"""Prefill and decode on different replicas: the two Ray tiers and the ingress's client for them.

`python -m server.ray --disaggregated --prefill-replicas P --decode-replicas D` deploys three
deployments: the ingress (the same FastAPI app), `Prefill` (P replicas of `PrefillReplica`) and
`Decode` (D replicas of `DecodeReplica`). One request:

1. The ingress sends the group (`EngineCall`, with its prefix route key) to a prefill replica, as
   in the two-tier app (the prefix-aware router keeps shared prompts on one prefill replica, whose
   prefix cache then serves them).
2. The prefill replica's `PrefillEngine` computes the prompt and samples the first token; the
   request leaves its pool in that step with its K/V packed as bytes. The replica `ray.put`s the
   bytes (they go to the object store, not into the stream) and yields a `HandedOff`: the first
   token, the `RequestSnapshot`, and the `ObjectRef`.
3. The ingress delivers the first token to the HTTP stream at once, and starts one streaming
   `DecodeCall` per request on the decode tier, passing the `ObjectRef` on.
4. The decode replica fetches the bytes from the object store (from the prefill replica's node
   directly when they are on different machines), hands them to its `DecodeEngine`, and streams
   the remaining tokens back to the ingress like any engine replica.

The prefill replica pins each hand-off's object until the ingress sends a `ReleaseCall`: when the
decode replica has accepted the request (it fetched the K/V before accepting), or when the request
will never get there (aborted, refused, the decode replica gone). The ingress counts each transfer
when the decode replica has accepted it (it holds the K/V then):
`transfers`, `transferred_bytes` (payload bytes through the object store) and `transfer_seconds`
(from the hand-off's arrival at the ingress to the decode tier's acceptance: the object-store
fetch plus the decode replica's queueing), exported at the ingress's `/metrics`.

Aborts: a request still in prefill is aborted there (cancel the call, or a pinned `AbortCall` if
others of its group go on); one in decode has a call of its own, which is cancelled (the decode
replica aborts it in `finally`). If a decode replica dies, that request's stream ends with an
error; the prefill tier is not involved any more.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from engine import EngineDeadError
from engine.tiers import DecodeEngine, Handoff, PrefillEngine
from server.engine_client.interface import OutputStream
from server.ray.forwarding import CallGroup, RayEngineClient, call_of_its_own
from server.ray.replica import EngineReplica, EngineSpec
from server.ray.wire import (
    Accepted,
    DecodeCall,
    EngineCall,
    HandedOff,
    Probe,
    Refused,
    ReleaseCall,
    StepItem,
)

log = logging.getLogger("server.ray.disagg")


# A prefill replica keeps each hand-off's K/V object alive itself until the ingress releases it
# (`ReleaseCall`). Ray does not count the ObjectRef inside a streamed item as borrowed by the
# ingress: with only the stream holding it, the object was sometimes freed before the decode
# replica fetched it (ReferenceCountingAssertionError, "the prefilled K/V was lost"; seen in 2 of
# 6 test runs on 2026-12-01). No byte cap: an object the decode tier has not fetched yet is still
# needed, however many there are (the object store spills to disk past its memory). The time
# limit only catches a release that never came (an ingress that died): a decode call waits
# minutes in a queue only on a tier overloaded far beyond its SLO.
HANDOFF_PIN_SECONDS = 600.0


class PrefillReplica(EngineReplica):
    """An engine replica whose engine stops each request after its first token."""

    async def __init__(self, spec: EngineSpec) -> None:
        # request id -> (expiry, bytes, ObjectRef), oldest first (dicts keep insertion order)
        self._pinned: dict[str, tuple[float, int, Any]] = {}
        await super().__init__(spec)

    def _build_engine(self, lm: Any, make_engine: Any) -> Any:
        return PrefillEngine(lm.model, self.spec.config)

    def _pin(self, request_id: str, ref: Any, num_bytes: int) -> None:
        """Hold `ref` until `release` (or HANDOFF_PIN_SECONDS); drop pins past their time."""
        now = time.monotonic()
        while self._pinned:
            oldest = next(iter(self._pinned))
            if self._pinned[oldest][0] >= now:
                break
            log.warning("K/V hand-off of %s was never released; dropping it", oldest)
            del self._pinned[oldest]
        self._pinned[request_id] = (now + HANDOFF_PIN_SECONDS, num_bytes, ref)

    async def release(self, call: ReleaseCall) -> None:
        """The ingress is done with this hand-off's K/V object (see the module doc)."""
        self._pinned.pop(call.request_id, None)

    def _item(self, out: Any) -> Any:
        handoff = None if out.finished else self.engine.take_handoff(out.request_id)
        if handoff is None:
            return super()._item(out)
        import ray

        # It left the engine in the step that sampled its first token: close it in the
        # driver's books too (the engine no longer knows it, so nothing is aborted).
        self.driver.abort(out.request_id)
        ref = ray.put(handoff.payload)  # to the object store, out of the stream
        self._pin(out.request_id, ref, handoff.num_kv_bytes)
        return HandedOff(out, handoff.snapshot, ref, handoff.num_kv_bytes, self.driver.stats())

    def _forget(self, requests: list) -> None:
        for r in requests:  # a hand-off whose output nobody read (cancelled meanwhile)
            self.engine.take_handoff(r.request_id)

    async def probe(self, call: Probe) -> dict:
        state = await super().probe(call)
        state["handed_off"] = self.engine.handed_off
        state["handed_off_bytes"] = self.engine.handed_off_bytes
        state["pinned"] = len(self._pinned)
        state["pinned_bytes"] = sum(size for _, size, _ in self._pinned.values())
        return state


class DecodeReplica(EngineReplica):
    """An engine replica that continues requests another replica prefilled."""

    def _build_engine(self, lm: Any, make_engine: Any) -> Any:
        return DecodeEngine(lm.model, self.spec.config)

    async def generate(self, call: DecodeCall) -> AsyncIterator[Accepted | Refused | StepItem]:  # type: ignore[override]
        request = call.snapshot.request
        try:
            payload = await call.kv  # from the object store (the prefill replica owns it)
        except Exception as e:  # its owner died, or the object was lost
            log.warning("K/V of %s could not be fetched: %r", request.request_id, e)
            yield Refused("EngineDeadError", "the prefilled K/V of the request was lost")
            return
        self.engine.expect(Handoff(call.snapshot, payload))
        try:
            async for item in super().generate(EngineCall((request,))):
                yield item
        finally:
            self.engine.forget(request.request_id)  # if it was never added

    async def probe(self, call: Probe) -> dict:
        state = await super().probe(call)
        state["kv_transfers"] = self.engine.connector.transfers
        state["kv_bytes"] = self.engine.connector.transferred_bytes
        return state


@dataclass(slots=True)
class _Decoding:
    call: Any  # the decode tier's DeploymentResponseGenerator
    stream: OutputStream


class DisaggregatedClient(RayEngineClient):
    """The ingress's `EngineClient` over a prefill and a decode deployment (see the module doc)."""

    # A grammar's state cannot follow the request from the prefill tier to the decode tier (the
    # hand-off carries its KV blocks and tokens, not a grammar matcher's state): a request with a grammar is a 400 here.
    grammar_placement = None

    def __init__(self, prefill_handle: Any, decode_handle: Any, **options: Any) -> None:
        super().__init__(prefill_handle, **options)
        self._decode = decode_handle
        self._decoding: dict[str, _Decoding] = {}  # request id -> its decode call
        self.transfers = 0
        self.transferred_bytes = 0
        self.transfer_seconds = 0.0
        self.transfer_failures = 0

    async def _pump(self, group: CallGroup) -> None:
        """The prefill call's items: tokens of requests that end there, and hand-offs."""
        stream = group.stream
        try:
            async for item in group.call:
                if isinstance(item, Refused):
                    stream.fail(item.error())
                    break
                if item.stats is not None:
                    self._note_stats(group.replica, item.stats)
                out = item.output
                self._groups.pop(out.request_id, None)  # it leaves the prefill replica here
                if isinstance(item, HandedOff):
                    if out.request_id not in stream.open_request_ids:
                        self._release(group.replica, out.request_id)  # aborted meanwhile
                        continue
                    stream.deliver(out)
                    self._start_decode(stream, item, group.replica)
                    continue
                assert isinstance(item, StepItem), item
                stream.deliver(out)
        except asyncio.CancelledError:
            stream.fail(EngineDeadError("the server is shutting down"))
            raise
        except Exception as e:  # the prefill replica died
            in_prefill = stream.open_request_ids - self._decoding.keys()
            if in_prefill:
                self.replica_failures += 1
                log.warning("prefill replica %s failed: %r", group.replica, e)
                self._stats.pop(group.replica, None)
                stream.fail(EngineDeadError("the engine replica failed while generating"))
        finally:
            for request_id in stream.request_ids:
                if self._groups.get(request_id) is group:
                    del self._groups[request_id]

    def _release(self, prefill_replica: str, request_id: str) -> None:
        """Let the prefill replica drop its pin on the request's K/V object (best effort: the
        pin times out otherwise)."""
        with contextlib.suppress(Exception):
            call_of_its_own(self._handle.release, ReleaseCall(request_id, prefill_replica))

    def _start_decode(self, stream: OutputStream, item: HandedOff, prefill_replica: str) -> None:
        request_id = item.output.request_id
        generate = self._decode.options(stream=True).generate
        call = call_of_its_own(generate, DecodeCall(item.snapshot, item.kv))
        self._decoding[request_id] = _Decoding(call, stream)
        task = asyncio.create_task(
            self._decode_pump(
                request_id, call, stream, item.kv_bytes, time.monotonic(), prefill_replica
            ),
            name="ray-decode-pump",
        )
        self._pumps.add(task)
        task.add_done_callback(self._pumps.discard)

    async def _decode_pump(
        self,
        request_id: str,
        call: Any,
        stream: OutputStream,
        kv_bytes: int,
        handed: float,
        prefill_replica: str,
    ) -> None:
        replica = None
        released = False
        try:
            first = await call.__anext__()
            # Accepted: the decode replica fetched the K/V first. Refused: it never will.
            self._release(prefill_replica, request_id)
            released = True
            if isinstance(first, Refused):
                self.transfer_failures += 1
                stream.fail(first.error())
                return
            assert isinstance(first, Accepted), first
            replica = first.replica
            self.transfers += 1
            self.transferred_bytes += kv_bytes
            self.transfer_seconds += time.monotonic() - handed
            self._note_stats(replica, first.stats)
            async for item in call:
                if isinstance(item, Refused):
                    stream.fail(item.error())
                    break
                assert isinstance(item, StepItem), item
                if item.stats is not None:
                    self._note_stats(replica, item.stats)
                stream.deliver(item.output)
        except asyncio.CancelledError:
            stream.fail(EngineDeadError("the server is shutting down"))
            raise
        except Exception as e:  # the decode replica died, or the call was cancelled by abort
            if request_id in stream.open_request_ids:
                self.replica_failures += 1
                log.warning("decode replica %s failed: %r", replica, e)
                if replica is not None:
                    self._stats.pop(replica, None)
                stream.fail(EngineDeadError("the engine replica failed while generating"))
        finally:
            if not released:  # cancelled (aborted) or the decode replica failed first
                self._release(prefill_replica, request_id)
            decoding = self._decoding.get(request_id)
            if decoding is not None and decoding.call is call:
                del self._decoding[request_id]

    def abort(self, request_id: str) -> None:
        decoding = self._decoding.pop(request_id, None)
        if decoding is None:
            super().abort(request_id)  # still in prefill (or already finished)
            return
        decoding.stream.close(request_id)
        decoding.call.cancel()  # the decode replica aborts it in `finally`

    async def stop(self, timeout: float = 30.0) -> None:
        await super().stop(timeout)
        for decoding in list(self._decoding.values()):
            decoding.stream.fail(EngineDeadError("the server is shutting down"))
            with contextlib.suppress(Exception):
                decoding.call.cancel()
        self._decoding.clear()

    def transfer_counters(self) -> dict[str, float]:
        return {
            "transfers": self.transfers,
            "bytes": self.transferred_bytes,
            "seconds": self.transfer_seconds,
            "failures": self.transfer_failures,
        }
