"""tools.soak: a seconds-long soak against a real TinyGPT server, so the 30-minute tool does not rot;
and its classification of what clients saw, against a stand-in server that misbehaves on purpose
(a stream cut before [DONE], a 500, a bad request answered 200), so its must-be-0 counts can fail.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tools import soak
from tools.soak_traffic import BAD_REQUESTS, Clock, Mix, Plan, plan_request, send

SERVER_ARGS = "--max-waiting 64 --log-level warning --num-threads 1"


@pytest.mark.slow
def test_a_short_soak_against_tinygpt_loses_nothing_and_drains(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    code = soak.main(
        [
            "--model", "tinygpt",
            "--server-args", SERVER_ARGS,
            "--minutes", "0.2",
            "--rate", "4",
            # Enough bad requests and disconnects that a 12-second run has some of each.
            "--bad-fraction", "0.25",
            "--disconnect-fraction", "0.5",
            "--whole-disconnect-fraction", "0.3",
            "--sample-every", "2",
            "--drain-timeout", "60",
            "--log", str(tmp_path / "server.log"),
            "--json", str(out),
            "--quiet",
        ]
    )  # fmt: skip
    report = json.loads(out.read_text())
    assert code == 0, report["failures"]
    outcomes = report["outcomes"]
    assert report["sent"] == sum(outcomes.values()) > 20
    assert outcomes.get("finished", 0) > 0
    assert outcomes.get("rejected", 0) > 0 and not report["rejected_otherwise"]
    assert outcomes.get("disconnected", 0) > 0
    for must_be_zero in ("lost", "malformed", "accepted_bad"):
        assert outcomes.get(must_be_zero, 0) == 0
    assert report["client_5xx"] == 0 and report["server_5xx"] == 0
    assert report["drained"] and not any(report["gauges_after"].values())
    assert report["rss_start_mib"] > 0 and report["rss_end_mib"] > 0
    assert report["rss_peak_mib"] >= report["rss_start_mib"]
    assert len(report["samples"]) >= 4
    # Every kind of the mix was drawn at least once over the run's requests? Not in 12 s; but
    # streamed and whole requests of both endpoints were.
    kinds = set(report["by_kind"])
    for endpoint in ("completions", "chat"):
        for mode in ("stream", "whole"):
            assert any(k.startswith(endpoint) and k.endswith(mode) for k in kinds), kinds


@pytest.mark.slow
def test_without_a_rate_the_probe_picks_twice_the_sustainable_one(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    code = soak.main(
        [
            "--model", "tinygpt",
            "--server-args", SERVER_ARGS,
            "--minutes", "0.05",
            "--probe-start", "4",
            "--probe-seconds", "2",
            "--probe-max-steps", "2",
            "--json", str(out),
            "--quiet",
        ]
    )  # fmt: skip
    report = json.loads(out.read_text())
    assert code == 0, report["failures"]
    steps = report["probe"]
    assert 1 <= len(steps) <= 2 and steps[0]["rate"] == 4
    assert report["rate"] == 2 * report["sustainable_rate"]
    assert report["rate_source"] == "2 x probe"


def test_the_mix_draws_every_feature_bad_requests_and_disconnects() -> None:
    rng = random.Random(1)
    plans = [plan_request(rng, "m", Mix()) for _ in range(2000)]
    kinds = {p.kind for p in plans}
    for feature in ("plain", "n", "logprobs", "stop", "json_schema"):
        for endpoint in ("completions", "chat"):
            assert f"{endpoint}/{feature}/stream" in kinds
            assert f"{endpoint}/{feature}/whole" in kinds
    assert {f"bad/{name}" for name in BAD_REQUESTS} <= kinds
    assert any(p.disconnect_after_chunks is not None for p in plans)
    assert any(p.disconnect_after_s is not None for p in plans)
    surrogate = next(p for p in plans if p.kind == "bad/lone_surrogate")
    assert b"\\ud800" in surrogate.content  # sent as the JSON escape, which is valid JSON


def test_metrics_parsing_reads_the_gauges_and_the_servers_5xx() -> None:
    text = "\n".join(
        [
            "# HELP cbserve_num_requests_running Requests in the running batch.",
            "cbserve_num_requests_running 2.0",
            "cbserve_num_requests_waiting 0.0",
            "cbserve_num_requests_paused 0.0",
            "cbserve_kv_cache_blocks_used 7.0",
            'cbserve_requests_total{endpoint="/v1/completions",status="200"} 10.0',
            'cbserve_requests_total{endpoint="/v1/completions",status="503"} 2.0',
            'cbserve_requests_total{endpoint="/v1/chat/completions",status="500"} 1.0',
        ]
    )
    got = soak.parse_metrics(text)
    assert got.gauges == {"running": 2, "waiting": 0, "paused": 0, "kv_blocks_used": 7}
    assert got.server_5xx == 3


# --- a stand-in server that misbehaves, so the soak's checks are seen to fail ------------------


async def _misbehave(request: Request) -> Response:
    body = await request.json()
    what = body.get("prompt")
    if what == "cut":

        async def events() -> AsyncIterator[str]:
            yield 'data: {"choices": [{"index": 0, "text": "x", "finish_reason": null}]}\n\n'
            # ... and the server goes away without an error event or [DONE]

        return StreamingResponse(events(), media_type="text/event-stream")
    if what == "busy":  # a 429 that does not say when to come back
        return JSONResponse({"error": {"message": "full", "type": "rate_limit_error"}}, 429)
    if what == "crash":
        return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, 500)
    if what == "error_event":

        async def failing() -> AsyncIterator[str]:
            yield 'data: {"error": {"message": "shutting down", "type": "server_error", '
            yield '"code": "engine_unavailable"}}\n\ndata: [DONE]\n\n'

        return StreamingResponse(failing(), media_type="text/event-stream")
    # Anything else, even a bad body: a whole answer with one choice.
    return JSONResponse({"choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]})


@pytest.fixture(scope="module")
def standin() -> Iterator[str]:
    app = Starlette(routes=[Route("/v1/completions", _misbehave, methods=["POST"])])
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=5)
    sock.close()


def _plan(prompt: str, stream: bool, expect: int = 200) -> Plan:
    body = json.dumps({"prompt": prompt, "stream": stream}).encode()
    return Plan("test", "/v1/completions", body, stream, expect_status=expect, max_tokens=4)


def test_cut_streams_5xx_and_accepted_bad_requests_fail_the_soak(standin: str) -> None:
    async def run() -> list:
        async with httpx.AsyncClient(base_url=standin) as http:
            plans = [
                _plan("cut", stream=True),
                _plan("crash", stream=False),
                _plan("anything", stream=False, expect=400),
                _plan("error_event", stream=True),
                _plan("fine", stream=False),
                _plan("busy", stream=False),
            ]
            return [await send(http, p, Clock(), timeout=10) for p in plans]

    cut, crash, bad, error_event, fine, busy = asyncio.run(run())
    assert cut.outcome == "lost" and "before [DONE]" in cut.detail
    assert crash.outcome == "status" and crash.status == 500
    assert bad.outcome == "accepted_bad"
    assert error_event.outcome == "stream_error" and "engine_unavailable" in error_event.detail
    assert fine.outcome == "finished"
    assert busy.outcome == "malformed" and "Retry-After" in busy.detail

    report = soak.Report(
        conditions="",
        base_url=standin,
        model="m",
        rate=1,
        rate_source="--rate",
        sustainable_rate=None,
        probe=[],
        slo="",
        minutes=0,
        drained=True,
    )
    soak.tally(report, [cut, crash, bad, error_event, fine], soak.SLO())
    soak.judge(report, [])
    assert report.count("lost") == 1 and report.client_5xx == 1
    text = " | ".join(report.failures)
    assert "1 requests lost" in text and "5xx" in text and "bad requests answered 200" in text
    assert "FAIL" in soak.format_report(report)
