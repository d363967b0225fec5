"""Presenting results: the printed block, the conditions line, JSON files, tables and plots.

Owns every output format and no measurement. The printed block uses vLLM benchmark_serving's
labels so numbers can be read side by side with its output; the conditions line follows the book
chapter's ("Conditions: <model> (<n> params), <cores>x <arch> CPU, torch <v>, <trace>, arrival rate <r>/s,
measured <date>"); JSON files hold the summary and every per-request record so any figure can be
recomputed later; plots put one line per engine (label) against arrival rate.
"""

from __future__ import annotations

import json
import math
import os
import platform
import textwrap
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from loadtest.metrics import Distribution, RequestRecord, Summary, e2e, tpot, ttft

WIDTH = 50


@dataclass(frozen=True, slots=True)
class Conditions:
    """What a measurement ran on; `rates` is one rate for a run, several for a sweep."""

    model: str
    parameter_count: int | None
    torch_version: str | None
    trace: str
    rates: tuple[float, ...]
    cores: int
    machine: str
    date: str

    def line(self) -> str:
        model = self.model
        if self.parameter_count is not None:
            model += f" ({self.parameter_count:,} params)"
        parts = [model, f"{self.cores}x {self.machine} CPU"]
        if self.torch_version:
            parts.append(f"torch {self.torch_version}")
        parts += [self.trace, _rates_text(self.rates), f"measured {self.date}"]
        return "Conditions: " + ", ".join(parts) + "."


def local_conditions(
    model: str,
    parameter_count: int | None,
    torch_version: str | None,
    trace: str,
    rates: Sequence[float],
    date: str | None = None,
) -> Conditions:
    """Conditions on this machine (the server's cores when it runs here, as in a sweep)."""
    return Conditions(
        model=model,
        parameter_count=parameter_count,
        torch_version=torch_version,
        trace=trace,
        rates=tuple(rates),
        cores=os.cpu_count() or 1,
        machine=platform.machine() or "unknown",
        date=date or datetime.now(UTC).isoformat(timespec="seconds"),
    )


def format_rate(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _rates_text(rates: Sequence[float]) -> str:
    if len(rates) == 1:
        rate = rates[0]
        if math.isinf(rate):
            return "all requests at once"
        # the seed's "8.0/s", but a finer rate as it is (0.25 is not "0.2")
        text = f"{rate:.1f}" if round(rate, 1) == rate else format_rate(rate)
        return f"arrival rate {text}/s"
    return "arrival rates " + ", ".join(format_rate(r) for r in rates) + "/s"


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1000:.2f}"


def format_summary(summary: Summary, title: str = "Serving Benchmark Result") -> str:
    """The result block, in vLLM benchmark_serving's labels and layout."""
    lines = [f" {title} ".center(WIDTH, "=")]

    def row(label: str, value: Any) -> None:
        lines.append(f"{label:<40} {value}")

    row("Successful requests:", summary.completed)
    row("Failed requests:", summary.failed)
    row("Benchmark duration (s):", f"{summary.duration:.2f}")
    row("Total input tokens:", summary.input_tokens)
    row("Total generated tokens:", summary.output_tokens)
    row("Request throughput (req/s):", f"{summary.request_throughput:.2f}")
    row("Request goodput (req/s):", f"{summary.goodput:.2f}")
    row("Goodput fraction:", f"{summary.goodput_fraction:.1%}")
    row("Output token throughput (tok/s):", f"{summary.output_throughput:.2f}")
    row("Total Token throughput (tok/s):", f"{summary.total_token_throughput:.2f}")
    row("Peak concurrent requests:", summary.peak_concurrency)
    row("Output length mismatches:", summary.length_mismatches)
    lines.append(f"Goodput SLO: {summary.slo.describe()}")
    sections = (
        ("Time to First Token", "TTFT", summary.ttft),
        ("Time per Output Token (excl. 1st token)", "TPOT", summary.tpot),
        ("Inter-token Latency", "ITL", summary.itl),
        ("End-to-end Latency", "E2EL", summary.e2e),
    )
    for heading, name, dist in sections:
        lines.append(heading.center(WIDTH, "-"))
        row(f"Mean {name} (ms):", _ms(dist.mean if dist else None))
        row(f"Median {name} (ms):", _ms(dist.p50 if dist else None))
        for p in ("p90", "p95", "p99"):
            row(f"P{p[1:]} {name} (ms):", _ms(getattr(dist, p) if dist else None))
    for error, count in sorted(summary.errors.items(), key=lambda item: -item[1])[:5]:
        lines.append(f"error x{count}: {error}")
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def to_json(value: Any) -> Any:
    """Strict-JSON-safe copy: non-finite floats (rate=inf) become strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_json(v) for v in value]
    return value


def record_json(record: RequestRecord) -> dict[str, Any]:
    """A record with its derived latencies, so the file can be read without this code."""
    return {**asdict(record), "ttft": ttft(record), "tpot": tpot(record), "e2e": e2e(record)}


def run_json(
    conditions: Conditions, summary: Summary, records: Sequence[RequestRecord], label: str = ""
) -> dict[str, Any]:
    return to_json(
        {
            "label": label,
            "conditions": {**asdict(conditions), "line": conditions.line()},
            "summary": asdict(summary),
            "records": [record_json(r) for r in records],
        }
    )


def write_json(path: Path, payload: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, allow_nan=False) + "\n")


@dataclass(frozen=True, slots=True)
class SweepPoint:
    """One run of a sweep: which engine (label), at which arrival rate, with what result."""

    label: str
    rate: float
    summary: Summary


def _dist_ms(dist: Distribution | None, stat: str) -> str:
    return "n/a" if dist is None else f"{getattr(dist, stat) * 1000:.1f}"


def format_sweep_table(points: Sequence[SweepPoint]) -> str:
    """A markdown table, one row per engine x rate (latencies in ms)."""
    header = (
        "| engine | rate (req/s) | completed | output tok/s | TTFT p50 | TTFT p90 | TTFT p99 "
        "| ITL p50 | ITL p99 | TPOT p50 | goodput (req/s) | goodput % |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for p in points:
        s = p.summary
        cells = [
            p.label,
            format_rate(p.rate),
            f"{s.completed}/{s.total}",
            f"{s.output_throughput:.1f}",
            _dist_ms(s.ttft, "p50"),
            _dist_ms(s.ttft, "p90"),
            _dist_ms(s.ttft, "p99"),
            _dist_ms(s.itl, "p50"),
            _dist_ms(s.itl, "p99"),
            _dist_ms(s.tpot, "p50"),
            f"{s.goodput:.2f}",
            f"{s.goodput_fraction:.0%}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_sweep(points: Sequence[SweepPoint], out_dir: Path, title: str = "") -> list[Path]:
    """PNG plots against arrival rate, one line per label: TTFT p50/p99, ITL p50/p99, goodput.

    Rates of inf (all at once) have no place on a rate axis and are left out.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    labels = list(dict.fromkeys(p.label for p in points))

    def series(label: str, value: Any) -> tuple[list[float], list[float]]:
        chosen = sorted(
            (p for p in points if p.label == label and math.isfinite(p.rate)), key=lambda p: p.rate
        )
        ys = [value(p.summary) for p in chosen]
        return [p.rate for p in chosen], [math.nan if y is None else y for y in ys]

    def ms(metric: str, stat: str) -> Any:
        def get(s: Summary) -> float | None:
            dist = getattr(s, metric)
            return None if dist is None else getattr(dist, stat) * 1000

        return get

    figures = [
        (
            "ttft.png",
            "TTFT (ms)",
            [("p50", "-", ms("ttft", "p50")), ("p99", "--", ms("ttft", "p99"))],
        ),
        ("itl.png", "ITL (ms)", [("p50", "-", ms("itl", "p50")), ("p99", "--", ms("itl", "p99"))]),
        ("goodput.png", "goodput (req/s)", [("", "-", lambda s: s.goodput)]),
    ]
    paths = []
    for filename, ylabel, curves in figures:
        fig, ax = plt.subplots(figsize=(6, 4))
        for i, label in enumerate(labels):
            color = f"C{i}"
            for name, style, value in curves:
                xs, ys = series(label, value)
                ax.plot(xs, ys, style, marker="o", color=color, label=f"{label} {name}".strip())
        ax.set_xlabel("arrival rate (req/s)")
        ax.set_ylabel(ylabel)
        if title:
            # The conditions line is long: wrap it rather than let the figure crop it.
            ax.set_title(textwrap.fill(title, 90), fontsize=7)
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out_dir / filename
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths
