"""The Grafana dashboard in docs/grafana/ against a live server's /metrics.

Every metric a panel's PromQL names, and every label it filters or groups by, must be one the
server really exports, so a renamed metric or label breaks this test instead of leaving an empty
panel. The server gets some traffic first (a completion, a stream, a rejected request): labelled
series such as `cbserve_requests_total{status=...}` only appear once something was counted.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "docs" / "grafana" / "cbserve-dashboard.json"
# Labels Prometheus attaches at scrape time; the server never exports them.
SCRAPE_LABELS = {"job", "instance"}

METRIC = re.compile(r"\b(cbserve_[a-zA-Z0-9_]+)")
SELECTOR = re.compile(r"\b(cbserve_[a-zA-Z0-9_]+)\{([^}]*)\}")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*\"")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s")
LABEL = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)=\"")


def queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of every panel, rows' nested panels included."""
    out = []

    def walk(panels: list[dict]) -> None:
        for panel in panels:
            out.extend((panel["title"], t["expr"]) for t in panel.get("targets", []))
            walk(panel.get("panels", []))

    walk(json.loads(DASHBOARD.read_text())["panels"])
    return out


def exported(text: str) -> dict[str, set[str]]:
    """Sample name -> label names seen on it, from a Prometheus text exposition."""
    series: dict[str, set[str]] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        m = SAMPLE.match(line)
        assert m, line
        series.setdefault(m[1], set()).update(LABEL.findall(m[2] or ""))
    return series


@pytest.fixture(scope="module")
def metrics_text(server) -> str:
    """/metrics after a completion, a streamed completion and a rejected request."""
    body = {"model": "tinygpt", "prompt": "Hello", "max_tokens": 4}
    assert httpx.post(server.url("/v1/completions"), json=body, timeout=60).status_code == 200
    with httpx.stream(
        "POST", server.url("/v1/completions"), json={**body, "stream": True}, timeout=60
    ) as r:
        assert r.status_code == 200
        r.read()
    bad = {**body, "max_tokens": -1}
    assert httpx.post(server.url("/v1/completions"), json=bad, timeout=60).status_code == 400
    return httpx.get(server.url("/metrics"), timeout=10).text


def test_every_panel_queries_at_least_one_cbserve_metric():
    found = queries()
    assert len(found) >= 20
    for title, expr in found:
        assert METRIC.search(expr), (title, expr)


def test_every_metric_a_panel_queries_is_in_metrics(metrics_text):
    series = exported(metrics_text)
    missing = {
        (title, name)
        for title, expr in queries()
        for name in METRIC.findall(expr)
        if name not in series
    }
    assert not missing, f"queried but not exported: {sorted(missing)}"


def test_every_label_a_panel_filters_or_groups_by_is_in_metrics(metrics_text):
    series = exported(metrics_text)
    missing = set()
    for title, expr in queries():
        for name, matchers in SELECTOR.findall(expr):
            for label in set(MATCHER.findall(matchers)) - SCRAPE_LABELS:
                if label not in series.get(name, set()):
                    missing.add((title, name, label))
        # `sum by (endpoint, status) (...)`: each label must be on a metric the expression reads.
        labels_read = set().union(*(series.get(n, set()) for n in METRIC.findall(expr)))
        for group in GROUPING.findall(expr):
            for label in (g.strip() for g in group.split(",") if g.strip()):
                if label not in labels_read | SCRAPE_LABELS:
                    missing.add((title, "by", label))
    assert not missing, f"labels not exported: {sorted(missing)}"


def test_histogram_quantiles_read_bucket_series_by_le():
    found = [(t, e) for t, e in queries() if "histogram_quantile" in e]
    assert len(found) >= 15  # p50/p90/p99 of TTFT, ITL, E2E, queue time, step time
    for title, expr in found:
        names = METRIC.findall(expr)
        assert names and all(n.endswith("_bucket") for n in names), (title, expr)
        assert re.search(r"\bby\s*\(\s*le\s*\)", expr), (title, expr)


def test_every_panel_uses_the_dashboards_datasource_variable():
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "job", "instance"} <= variables
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
