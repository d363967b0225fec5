"""Per-request records and the metrics computed from them, defined below.

Owns the numbers and nothing else: `RequestRecord` (what the runner observed for one request) and
pure functions over records. Definitions match the book chapter's and vLLM benchmark_serving's:

- TTFT = first streamed token - send time
- ITL  = gaps between consecutive streamed tokens (pooled over requests for the distribution)
- TPOT = (E2E - TTFT) / (output tokens - 1)
- E2E  = end of stream - send time
- throughput = tokens / wall time of the run; goodput = requests/s meeting the SLO
  (TTFT <= 1.0 s and mean ITL <= 0.05 s by default, optionally a per-request p99 ITL bound)

A "streamed token" is a chunk that carries text; a chunk may carry several tokens, so output
token counts come from the server's usage chunk (falling back to counting chunks).
Percentiles interpolate linearly between order statistics, as numpy's default does.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

TIMEOUT = "timeout"


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What the client saw of one request. Times are seconds since the run started.

    `send_time` is None for a request the run never sent (it ended first); `end_time` is None when
    the stream did not finish. `completion_tokens`/`prompt_tokens` come from the usage chunk.
    """

    index: int
    arrival: float
    prompt_len: int
    output_len: int
    send_time: float | None
    chunk_times: tuple[float, ...] = ()
    end_time: float | None = None
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.send_time is not None and self.end_time is not None

    @property
    def output_tokens(self) -> int:
        if self.completion_tokens is not None:
            return self.completion_tokens
        return len(self.chunk_times)

    @property
    def length_mismatch(self) -> bool:
        """A finished request that did not produce the output length it asked for."""
        return self.ok and self.output_tokens != self.output_len


@dataclass(frozen=True, slots=True)
class SLO:
    """A latency objective a request must meet to count towards goodput (seconds)."""

    ttft: float = 1.0
    itl_mean: float = 0.05
    itl_p99: float | None = None

    def describe(self) -> str:
        parts = [f"TTFT <= {self.ttft * 1000:g} ms", f"mean ITL <= {self.itl_mean * 1000:g} ms"]
        if self.itl_p99 is not None:
            parts.append(f"p99 ITL <= {self.itl_p99 * 1000:g} ms")
        return " and ".join(parts)


@dataclass(frozen=True, slots=True)
class Distribution:
    """Summary statistics of one metric, in seconds."""

    count: int
    mean: float
    p50: float
    p90: float
    p95: float
    p99: float
    max: float


@dataclass(frozen=True, slots=True)
class Summary:
    """The metrics of one run. Latency distributions cover successful requests only."""

    total: int
    completed: int
    failed: int
    duration: float
    input_tokens: int
    output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    goodput: float
    goodput_fraction: float
    slo: SLO
    peak_concurrency: int
    length_mismatches: int
    ttft: Distribution | None
    tpot: Distribution | None
    itl: Distribution | None
    e2e: Distribution | None
    errors: dict[str, int] = field(default_factory=dict)


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0-100) with linear interpolation; `values` must not be empty."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def distribution(values: Sequence[float]) -> Distribution | None:
    if not values:
        return None
    return Distribution(
        count=len(values),
        mean=sum(values) / len(values),
        p50=percentile(values, 50),
        p90=percentile(values, 90),
        p95=percentile(values, 95),
        p99=percentile(values, 99),
        max=max(values),
    )


def ttft(record: RequestRecord) -> float | None:
    if record.send_time is None or not record.chunk_times:
        return None
    return record.chunk_times[0] - record.send_time


def itls(record: RequestRecord) -> list[float]:
    times = record.chunk_times
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def e2e(record: RequestRecord) -> float | None:
    if record.send_time is None or record.end_time is None:
        return None
    return record.end_time - record.send_time


def tpot(record: RequestRecord) -> float | None:
    """Mean time per output token after the first; None for a one-token or unfinished request."""
    first, total = ttft(record), e2e(record)
    if first is None or total is None or record.output_tokens < 2:
        return None
    return (total - first) / (record.output_tokens - 1)


def meets_slo(record: RequestRecord, slo: SLO) -> bool:
    """Whether a request finished within the SLO. A one-chunk answer has no gaps to violate it."""
    first = ttft(record)
    if not record.ok or first is None or first > slo.ttft:
        return False
    gaps = itls(record)
    if gaps and sum(gaps) / len(gaps) > slo.itl_mean:
        return False
    return not (slo.itl_p99 is not None and gaps and percentile(gaps, 99) > slo.itl_p99)


def summarize(
    records: Sequence[RequestRecord],
    duration: float,
    peak_concurrency: int,
    slo: SLO | None = None,
) -> Summary:
    """All run metrics from the per-request records and the run's wall time in seconds."""
    slo = slo or SLO()
    done = [r for r in records if r.ok]
    good = sum(meets_slo(r, slo) for r in done)
    input_tokens = sum(r.prompt_len if r.prompt_tokens is None else r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)

    def rate(amount: float) -> float:
        return amount / duration if duration > 0 else 0.0

    return Summary(
        total=len(records),
        completed=len(done),
        failed=len(records) - len(done),
        duration=duration,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        request_throughput=rate(len(done)),
        output_throughput=rate(output_tokens),
        total_token_throughput=rate(input_tokens + output_tokens),
        goodput=rate(good),
        # Over all requests, not just finished ones: a failure is a request that missed its SLO.
        goodput_fraction=good / len(records) if records else 0.0,
        slo=slo,
        peak_concurrency=peak_concurrency,
        length_mismatches=sum(r.length_mismatch for r in done),
        ttft=distribution([t for r in done if (t := ttft(r)) is not None]),
        tpot=distribution([t for r in done if (t := tpot(r)) is not None]),
        itl=distribution([gap for r in done for gap in itls(r)]),
        e2e=distribution([t for r in done if (t := e2e(r)) is not None]),
        errors=dict(Counter(r.error or "incomplete" for r in records if not r.ok)),
    )
