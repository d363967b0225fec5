"""Build the Serve application: an `Ingress` deployment in front of an `Engine` deployment.

`Ingress` serves `server.http.app.create_app` (the same routes, errors, SSE and metric names as
`python -m server`) over a `RayEngineClient` bound to the engine deployment's handle, and adds
the per-replica and routing metrics to its `/metrics`. It holds the tokenizer and the model card
(built once by the caller, pickled into the deployment), never the weights.

`Engine` is `EngineReplica` with the routing, sizing, health, autoscaling and drain options of
`DeploySpec`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from server.http.app import ServerSettings
from server.openai.protocol import ModelCard
from server.ray.keys import DEFAULT_ROUTE_BLOCKS
from server.ray.replica import EngineReplica, EngineSpec

ENGINE_DEPLOYMENT = "Engine"
PREFILL_DEPLOYMENT = "Prefill"
DECODE_DEPLOYMENT = "Decode"
INGRESS_DEPLOYMENT = "Ingress"


@dataclass(frozen=True, slots=True)
class DeploySpec:
    engine: EngineSpec
    replicas: int = 2
    # Autoscaling: both set -> Serve scales between them on ongoing requests per replica.
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None
    # Serve's default of 5 would starve an engine that batches itself: slots plus its queue.
    max_ongoing_requests: int | None = None
    max_queued_requests: int = -1  # -1: no limit (beyond it: 503)
    prefix_routing: bool = True
    imbalance_bound: int = 4
    route_blocks: int = DEFAULT_ROUTE_BLOCKS
    replica_num_cpus: float = 1.0
    ingress_num_cpus: float = 0.0
    health_check_period_s: float = 5.0
    health_check_timeout_s: float = 30.0
    # Prefill and decode on different replicas (`server.ray.disagg`); `replicas` is then unused.
    disaggregated: bool = False
    prefill_replicas: int = 1
    decode_replicas: int = 1

    def engine_max_ongoing(self) -> int:
        if self.max_ongoing_requests is not None:
            return self.max_ongoing_requests
        config = self.engine.config
        queue = self.engine.max_waiting if self.engine.max_waiting else 4 * config.max_batch_size
        return config.max_batch_size + queue


class _RayCollector:
    """Per-replica engine gauges (from the replicas' piggybacked stats) and routing counters."""

    def __init__(self, client: Any) -> None:
        self.client = client

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        from server.ray.router import ROUTING

        per = self.client.replica_stats()
        gauges = {
            "num_running": "Requests running on the replica.",
            "num_waiting": "Requests waiting on the replica.",
            "num_free_blocks": "Free KV blocks on the replica.",
        }
        for field, doc in gauges.items():
            g = GaugeMetricFamily(f"cbserve_replica_{field}", doc, labels=["replica"])
            for replica, s in sorted(per.items()):
                g.add_metric([replica], getattr(s, field))
            yield g
        hits = CounterMetricFamily(
            "cbserve_replica_prefix_cache_hits",
            "Prompt tokens served from the replica's prefix cache.",
            labels=["replica"],
        )
        for replica, s in sorted(per.items()):
            hits.add_metric([replica], s.prefix_cache_hits)
        yield hits
        decisions, routed = ROUTING.snapshot()
        c = CounterMetricFamily(
            "cbserve_router_decisions",
            "Engine calls by routing outcome: preferred (the key's rendezvous replica), "
            "fallback (load guard), unkeyed (prompt shorter than one block).",
            labels=["outcome"],
        )
        for outcome in ("preferred", "fallback", "unkeyed"):
            c.add_metric([outcome], decisions.get(outcome, 0))
        yield c
        r = CounterMetricFamily(
            "cbserve_router_routed", "Engine calls routed to each replica.", labels=["replica"]
        )
        for replica, n in sorted(routed.items()):
            r.add_metric([replica], n)
        yield r
        yield GaugeMetricFamily(
            "cbserve_replica_failures",
            "Streams ended because their engine replica failed.",
            value=self.client.replica_failures,
        )
        counters = getattr(self.client, "transfer_counters", None)
        if counters is None:  # not disaggregated
            return
        kv = counters()
        docs = {
            "cbserve_kv_transfers": "Requests handed from a prefill to a decode replica (counted when the "
            "decode replica accepted the K/V).",
            "cbserve_kv_transfer_bytes": "K/V payload bytes handed from prefill to decode replicas through Ray's "
            "object store.",
            "cbserve_kv_transfer_seconds": "Seconds from a hand-off reaching the ingress to the decode replica "
            "accepting it (object-store fetch and queueing), summed.",
            "cbserve_kv_transfer_failures": "Hand-offs the decode tier refused.",
        }
        for (name, doc), value in zip(docs.items(), kv.values(), strict=True):
            yield CounterMetricFamily(name, doc, value=value)


def build_app(spec: DeploySpec, tokenizer: Any, card: ModelCard, settings: ServerSettings) -> Any:
    """The Serve application (pass to `serve.run`)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from server.http.app import create_app
    from server.ray.forwarding import RayEngineClient

    engine_options: dict[str, Any] = {
        "name": ENGINE_DEPLOYMENT,
        "max_ongoing_requests": spec.engine_max_ongoing(),
        "max_queued_requests": spec.max_queued_requests,
        "ray_actor_options": {"num_cpus": spec.replica_num_cpus},
        "health_check_period_s": spec.health_check_period_s,
        "health_check_timeout_s": spec.health_check_timeout_s,
        "graceful_shutdown_timeout_s": spec.engine.shutdown_timeout,
        "graceful_shutdown_wait_loop_s": 0.5,
    }
    if spec.min_replicas is not None or spec.max_replicas is not None:
        lo = spec.min_replicas if spec.min_replicas is not None else 1
        hi = spec.max_replicas if spec.max_replicas is not None else max(lo, spec.replicas)
        engine_options["autoscaling_config"] = {
            "min_replicas": lo,
            "max_replicas": hi,
            "initial_replicas": min(max(spec.replicas, lo), hi),
            "target_ongoing_requests": spec.target_ongoing_requests
            or spec.engine.config.max_batch_size,
        }
    else:
        engine_options["num_replicas"] = spec.replicas
    if spec.prefix_routing:
        # By import path: replicas and the ingress import it from the installed package.
        engine_options["request_router_config"] = RequestRouterConfig(
            request_router_class="server.ray.router.PrefixAwareRouter",
            request_router_kwargs={"imbalance_bound": spec.imbalance_bound},
        )
    if spec.disaggregated:
        from server.ray.disagg import DecodeReplica, PrefillReplica

        engine_options.pop("autoscaling_config", None)
        prefill = serve.deployment(PrefillReplica).options(
            **{**engine_options, "name": PREFILL_DEPLOYMENT, "num_replicas": spec.prefill_replicas}
        )
        # Decode calls carry no route key: the same router ranks them least loaded first (and
        # pins `Probe`s), or Serve's default when prefix routing is off.
        decode = serve.deployment(DecodeReplica).options(
            **{**engine_options, "name": DECODE_DEPLOYMENT, "num_replicas": spec.decode_replicas}
        )
        tiers = (prefill.bind(spec.engine), decode.bind(spec.engine))
    else:
        tiers = (serve.deployment(EngineReplica).options(**engine_options).bind(spec.engine),)

    block_size = spec.engine.config.block_size
    route_blocks = spec.route_blocks
    health_period = spec.health_check_period_s

    @serve.ingress()
    class Ingress:
        def __init__(self, engine_handle: Any, decode_handle: Any = None) -> None:
            self.engine_handle = engine_handle  # the prefill tier's when disaggregated
            self.decode_handle = decode_handle

        def __serve_build_asgi_app__(self) -> Any:
            options = {
                "max_model_len": card.max_model_len,
                "engine_name": card.engine,
                "block_size": block_size,
                "route_blocks": route_blocks,
                "health_period": health_period,
            }
            if self.decode_handle is None:
                client = RayEngineClient(
                    self.engine_handle, deployments=(ENGINE_DEPLOYMENT,), **options
                )
            else:
                from server.ray.disagg import DisaggregatedClient

                client = DisaggregatedClient(
                    self.engine_handle,
                    self.decode_handle,
                    deployments=(PREFILL_DEPLOYMENT, DECODE_DEPLOYMENT),
                    **options,
                )
            app = create_app(tokenizer, card, client, settings)
            app.state.metrics.registry.register(_RayCollector(client))
            return app

    ingress = serve.deployment(
        Ingress,
        name=INGRESS_DEPLOYMENT,
        max_ongoing_requests=4096,  # HTTP streams; the engine tier bounds the real work
        ray_actor_options={"num_cpus": spec.ingress_num_cpus},
        graceful_shutdown_timeout_s=spec.engine.shutdown_timeout,
        graceful_shutdown_wait_loop_s=0.5,
    )
    return ingress.bind(*tiers)
