"""`PrefixAwareRouter`: a Ray Serve `RequestRouter` that keeps shared prompt prefixes together.

It runs in the process that holds the engine handle (the ingress replica). Each `EngineCall`
carries a route key (`keys.route_key`: the chained hash of the prompt's first full KV blocks);
every prompt that starts with the same blocks prefers the same replica, where the prefix cache
holds them. A key seen for the first time is placed on the replica holding the fewest live keys
(`keys.Placement`; rendezvous hashing breaks ties), so tenants spread evenly over the replicas'
caches, and adding or removing a replica moves no placed key but those of a removed one. A load
guard keeps a popular prefix from piling onto one replica: if the preferred replica has more than
`imbalance_bound` requests in flight beyond the least loaded one, the least loaded goes first.
In-flight counts are this router's own (`on_request_routed` / `on_request_completed`), exact with
one ingress replica.

Each rank is a single replica: Serve tries the ranks in order and moves on when a replica is at
`max_ongoing_requests`. `AbortCall`s, `ReleaseCall`s and `Probe`s go to the replica they name
(any, if it is gone). Do not mix in `FIFOMixin`: it hands a chosen replica to whichever request
waits longest, which breaks affinity.

Counters (`ROUTING`) feed the ingress's `/metrics`: routing decisions (the key's preferred replica
first, load-guard fallbacks, requests without a key) and calls sent to each replica. A decision
ranks the preferred replica first; Serve sends to the next rank only if it is at
`max_ongoing_requests`.
"""

from __future__ import annotations

import collections
import importlib
import logging

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from server.ray.keys import Placement, rank_replicas
from server.ray.wire import AbortCall, EngineCall, Probe, ReleaseCall

log = logging.getLogger("server.ray.router")


class RoutingCounters:
    """Routing decisions in this process (the ingress), read by its metrics collector."""

    # No lock: the router's hooks and the metrics collector run on the ingress's event loop
    # thread, and a Counter update is one bytecode-level operation under the GIL anyway.

    def __init__(self) -> None:
        self.decisions: collections.Counter[str] = collections.Counter()  # outcome -> count
        self.per_replica: collections.Counter[str] = collections.Counter()

    def record(self, outcome: str) -> None:
        self.decisions[outcome] += 1

    def sent(self, replica: str) -> None:
        self.per_replica[replica] += 1

    def snapshot(self) -> tuple[dict[str, int], dict[str, int]]:
        return dict(self.decisions), dict(self.per_replica)


ROUTING = RoutingCounters()


def _routing() -> RoutingCounters:
    """This process's `ROUTING`, looked up through the module: Serve may ship the router class
    by value (cloudpickle), and then its methods see a copy of this module's globals, not the
    counters the ingress's metrics read."""
    return importlib.import_module("server.ray.router").ROUTING


def _call_of(pending: PendingRequest | None) -> object:
    if pending is None or not pending.args:
        return None
    return pending.args[0]


class PrefixAwareRouter(RequestRouter):
    def initialize_state(self, imbalance_bound: int = 4, **kwargs: object) -> None:
        self.imbalance_bound = int(imbalance_bound)
        self.inflight: collections.Counter[str] = collections.Counter()
        self.placement = Placement()

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        call = _call_of(pending_request)
        if isinstance(call, AbortCall | Probe | ReleaseCall):  # pinned to the replica they name
            target = by_id.get(call.replica)
            if target is not None:
                return [[target]]
            # That replica is gone. Never answer with no replica: Serve (2.60) then asks again at
            # once without yielding, and the router's loop spins. Any replica will do: an abort
            # of a request it does not run is a no-op, and a probe's answer names its replica.
            return [[r] for r in candidate_replicas]
        key = call.route_key if isinstance(call, EngineCall) else None
        order, fell_back = rank_replicas(
            key, list(by_id), dict(self.inflight), self.imbalance_bound, self.placement
        )
        if isinstance(call, EngineCall) and order:
            _routing().record(
                "unkeyed" if key is None else "fallback" if fell_back else "preferred"
            )
        return [[by_id[r]] for r in order]

    # In-flight counts. Serve calls `on_send_request` for every request it sends (with or
    # without the strict max-ongoing protocol; `on_request_routed` only with it) and
    # `on_request_completed` when the call ends, successfully or not.
    def on_send_request(self, replica_id) -> None:  # noqa: ANN001
        super().on_send_request(replica_id)
        self.inflight[replica_id.unique_id] += 1
        _routing().sent(replica_id.unique_id)

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:  # noqa: ANN001
        super().on_request_completed(replica_id, internal_request_id)
        replica = replica_id.unique_id
        if self.inflight[replica] > 0:
            self.inflight[replica] -= 1

    def on_replica_actor_died(self, replica_id) -> None:  # noqa: ANN001
        super().on_replica_actor_died(replica_id)
        self.inflight.pop(replica_id.unique_id, None)
        self.placement.forget_replica(replica_id.unique_id)
