"""The live view of the engine: recent timings and a JSON snapshot for the web page.

Owns `LiveWindow`, a bounded record of the last few hundred engine steps (duration, rows that
produced a token) and of recent time-to-first-token and inter-token gaps, and `snapshot()`, the
body of `GET /v1/engine/stats`: running and waiting requests, batch occupancy of recent steps, KV
blocks in use, prefix-cache hit rate, and TTFT / ITL percentiles over the last minute. Prometheus
(`/metrics`) keeps the cumulative histograms; this keeps only what a person watching needs now.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from engine.interface import EngineStats

WINDOW_SECONDS = 60.0


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    s = sorted(values)

    def at(q: float) -> float:
        return round(s[min(len(s) - 1, int(q * len(s)))] * 1e3, 2)

    return {"p50": at(0.50), "p90": at(0.90), "p99": at(0.99)}


class LiveWindow:
    """Recent steps and latencies. Fed from the step thread and the event loop: one lock."""

    def __init__(self, max_steps: int = 240, max_samples: int = 2048) -> None:
        self._lock = threading.Lock()
        self.steps: deque[tuple[float, float, int]] = deque(maxlen=max_steps)  # (t, s, rows)
        self.ttft: deque[tuple[float, float]] = deque(maxlen=max_samples)
        self.itl: deque[tuple[float, float]] = deque(maxlen=max_samples)

    def observe_step(self, seconds: float, num_outputs: int) -> None:
        with self._lock:
            self.steps.append((time.monotonic(), seconds, num_outputs))

    def observe_ttft(self, seconds: float) -> None:
        with self._lock:
            self.ttft.append((time.monotonic(), seconds))

    def observe_itl(self, seconds: float) -> None:
        with self._lock:
            self.itl.append((time.monotonic(), seconds))

    def snapshot(self, stats: EngineStats) -> dict[str, Any]:
        now = time.monotonic()
        since = now - WINDOW_SECONDS
        with self._lock:
            steps = list(self.steps)
            ttft = [v for t, v in self.ttft if t >= since]
            itl = [v for t, v in self.itl if t >= since]
        recent = [s for s in steps if s[0] >= now - 10.0]
        return {
            "time": time.time(),
            "running": stats.num_running,
            "waiting": stats.num_waiting,
            "kv_blocks_used": stats.num_total_blocks - stats.num_free_blocks,
            "kv_blocks_total": stats.num_total_blocks,
            "kv_usage": round(stats.kv_usage, 4),
            "prefix_cache_hit_rate": round(stats.prefix_cache_hit_rate, 4),
            "preemptions": stats.num_preemptions,
            # Rows that produced a token in each of the last steps, oldest first.
            "batch_occupancy": [rows for _, _, rows in steps[-120:]],
            "step_ms": _percentiles([s for _, s, _ in recent]),
            "tokens_per_s_10s": round(sum(r for _, _, r in recent) / 10.0, 2),
            "ttft_ms": _percentiles(ttft),
            "itl_ms": _percentiles(itl),
            "window_seconds": WINDOW_SECONDS,
        }
