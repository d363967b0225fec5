"""Prometheus metrics for `/metrics`: one registry per app, so several apps (tests) never collide.

Owns the metric names and where each value comes from. Request-level latencies (TTFT, ITL, E2E,
queue time) and token counters are observed by `server.openai.serving` as outputs reach a request;
engine state (running, waiting, KV blocks, preemptions, prefix cache) is read from the engine
client's stats snapshot at scrape time, so it is never stale and costs nothing between scrapes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine import EngineStats
from server.generation.live import LiveWindow

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds. TTFT and E2E span queueing under load; ITL is a step on a small CPU model.
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats], healthy: Callable[[], bool]) -> None:
        self._stats = stats
        self._healthy = healthy

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self._stats()
        yield GaugeMetricFamily(
            "cbserve_num_requests_running", "Requests in the running batch.", s.num_running
        )
        yield GaugeMetricFamily(
            "cbserve_num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting
        )
        yield GaugeMetricFamily(
            "cbserve_num_requests_paused",
            "Requests paused because their client is not reading (backpressure).",
            s.num_paused,
        )
        yield GaugeMetricFamily(
            "cbserve_kv_cache_blocks_total", "KV cache blocks in the pool.", s.num_total_blocks
        )
        used = s.num_total_blocks - s.num_free_blocks
        yield GaugeMetricFamily("cbserve_kv_cache_blocks_used", "KV cache blocks in use.", used)
        yield GaugeMetricFamily(
            "cbserve_kv_cache_usage_ratio", "Fraction of KV blocks in use (0-1).", s.kv_usage
        )
        yield GaugeMetricFamily(
            "cbserve_state_slots_total",
            "Recurrent state slots for running requests (hybrid models; 0 otherwise).",
            s.num_state_slots,
        )
        yield GaugeMetricFamily(
            "cbserve_state_slots_used",
            "Recurrent state slots held by running requests.",
            s.num_state_slots - s.num_free_state_slots,
        )
        yield GaugeMetricFamily(
            "cbserve_state_snapshots",
            "Recurrent state snapshots the prefix cache keeps (of its snapshot slots).",
            s.num_state_snapshots,
        )
        yield GaugeMetricFamily(
            "cbserve_state_pool_bytes",
            "Bytes of the recurrent state pool (live and snapshot slots).",
            (s.num_state_slots + s.num_state_snapshot_slots) * s.state_bytes_per_slot,
        )
        yield CounterMetricFamily(
            "cbserve_num_preemptions", "Requests preempted by recompute.", s.num_preemptions
        )
        yield CounterMetricFamily(
            "cbserve_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            s.prefix_cache_queries,
        )
        yield CounterMetricFamily(
            "cbserve_prefix_cache_hits",
            "Prompt tokens served from the prefix cache.",
            s.prefix_cache_hits,
        )
        yield GaugeMetricFamily(
            "cbserve_engine_healthy", "1 while the engine loop is healthy.", int(self._healthy())
        )


class ServerMetrics:
    """The app's metrics. `render()` is the `/metrics` body."""

    def __init__(self, stats: Callable[[], EngineStats], healthy: Callable[[], bool]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "cbserve_requests",
            "HTTP API requests by endpoint and status code.",
            ["endpoint", "status"],
            registry=r,
        )
        self.finished = Counter(
            "cbserve_request_finished",
            "Generated sequences (choices) by finish reason.",
            ["finish_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "cbserve_prompt_tokens", "Prompt tokens of submitted sequences.", registry=r
        )
        self.generation_tokens = Counter(
            "cbserve_generation_tokens", "Generated tokens.", registry=r
        )
        self.ttft = Histogram(
            "cbserve_time_to_first_token_seconds",
            "Arrival to first token.",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "cbserve_inter_token_latency_seconds",
            "Gap between a sequence's outputs.",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "cbserve_e2e_request_latency_seconds",
            "Arrival to last token.",
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "cbserve_request_queue_time_seconds",
            "Arrival to the engine's first scheduling of the request.",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.step_time = Histogram(
            "cbserve_engine_step_seconds",
            "Duration of one engine step.",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        r.register(_EngineCollector(stats, healthy))
        # The last minute, for the web page's live view (GET /v1/engine/stats).
        self.live = LiveWindow()

    def observe_step(self, seconds: float, num_outputs: int) -> None:
        self.step_time.observe(seconds)
        self.live.observe_step(seconds, num_outputs)

    def observe_queue_time(self, seconds: float) -> None:
        self.queue_time.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
