"""loadtest/: traces, metrics on hand-made records, the runner and CLI against a fake server.

The fake server below is a minimal Starlette app on a real uvicorn bound to a loopback port: it
stands in for an external OpenAI-compatible server and streams with known delays, so the runner's
timings can be checked against them (httpx's ASGITransport would buffer the stream).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import statistics
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from loadtest.__main__ import main as loadtest_main
from loadtest.metrics import (
    SLO,
    RequestRecord,
    distribution,
    e2e,
    itls,
    meets_slo,
    percentile,
    summarize,
    tpot,
    ttft,
)
from loadtest.report import Conditions, SweepPoint, format_summary, format_sweep_table
from loadtest.runner import TokenCounter, fetch_model_info, request_body, run_trace
from loadtest.sweep import ServerStartError, free_port, server_command, server_process
from loadtest.trace import TraceRequest, TraceSpec, build_trace, fit_text

# --- the fake server --------------------------------------------------------------------------

FIRST_DELAY = 0.05  # before the first token
GAP = 0.03  # between tokens
CAP = 6  # the fake stops after this many tokens, whatever max_tokens says
# First prompt token ids that select a misbehaviour.
REJECT, FAIL_MIDWAY, SLOW = 1, 2, 3


def _sse(obj: object) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _models(request: Request) -> Response:
    entry = {"id": "fake", "object": "model", "parameter_count": 5_838_080, "torch_version": "9.9"}
    return JSONResponse({"object": "list", "data": [entry]})


async def _tokenize(request: Request) -> Response:
    body = await request.json()
    tokens = [256, *body["prompt"].encode()]  # byte-level with a BOS, like TinyGPT
    return JSONResponse({"count": len(tokens), "tokens": tokens, "max_model_len": 2048})


async def _generate(request: Request) -> Response:
    body = await request.json()
    chat = "messages" in body
    prompt = body["messages"][-1]["content"] if chat else body["prompt"]
    marker = prompt[0] if isinstance(prompt, list) and prompt else None
    if marker == REJECT:
        error = {"message": "prompt rejected", "type": "invalid_request_error", "param": "prompt"}
        return JSONResponse({"error": {**error, "code": None}}, status_code=400)
    n = min(body["max_tokens"], CAP)
    gap = 1.0 if marker == SLOW else GAP

    def chunk(text: str, finish: str | None = None) -> dict[str, object]:
        choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
        return {"choices": [{**choice, "finish_reason": finish}]}

    async def events() -> AsyncIterator[str]:
        if chat:  # an immediate role-only chunk, which carries no token
            yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        await asyncio.sleep(FIRST_DELAY)
        for i in range(n):
            if i:
                await asyncio.sleep(gap)
            yield _sse(chunk("x"))
            if marker == FAIL_MIDWAY:
                yield _sse({"error": {"message": "engine failed", "type": "server_error"}})
                return
        yield _sse(chunk("", finish="length"))  # empty text: not a token
        usage = {"prompt_tokens": len(prompt), "completion_tokens": n}
        yield _sse({"choices": [], "usage": usage})
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    app = Starlette(
        routes=[
            Route("/v1/models", _models),
            Route("/tokenize", _tokenize, methods=["POST"]),
            Route("/v1/completions", _generate, methods=["POST"]),
            Route("/v1/chat/completions", _generate, methods=["POST"]),
        ]
    )
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and
    # without it every response waits ~40 ms for a delayed ACK (Nagle), skewing all timings.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    # Listening before uvicorn starts means early connections wait in the backlog: no readiness poll.
    sock.listen(64)
    config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=5)
    sock.close()


def _request(
    index: int, arrival: float = 0.0, output_len: int = 4, first: int = 65
) -> TraceRequest:
    prompt = (first, 66, 67, 68, 69)
    return TraceRequest(index, arrival, prompt, prompt_len=len(prompt), output_len=output_len)


# Sleeps may end up to a clock tick early; the timing assertions allow for that.
SLACK = 0.005


# --- traces -----------------------------------------------------------------------------------


def test_trace_is_deterministic_for_a_seed() -> None:
    assert build_trace(TraceSpec(seed=7)) == build_trace(TraceSpec(seed=7))


def test_trace_differs_across_seeds() -> None:
    a, b = build_trace(TraceSpec(seed=7)), build_trace(TraceSpec(seed=8))
    assert [r.arrival for r in a] != [r.arrival for r in b]
    assert [r.prompt for r in a] != [r.prompt for r in b]


def test_seed_workload_defaults() -> None:
    spec = TraceSpec()
    assert (spec.rate, spec.burstiness, spec.seed) == (4.0, 1.0, 7)
    assert (spec.prompt_len, spec.output_len) == ((32, 96), (16, 48))
    assert spec.describe() == "poisson, prompt 32-96, output 16-48, seed 7"


def test_poisson_arrivals_have_the_requested_mean_rate() -> None:
    trace = build_trace(TraceSpec(num_requests=2000, rate=10.0, seed=1))
    assert trace[0].arrival == 0.0
    gaps = [b.arrival - a.arrival for a, b in zip(trace, trace[1:], strict=False)]
    # The mean of 1999 exponential gaps has a relative standard error of 2.2%; allow 10%.
    assert statistics.fmean(gaps) == pytest.approx(0.1, rel=0.10)
    assert min(gaps) >= 0


def test_gamma_burstiness_keeps_the_rate_and_changes_dispersion() -> None:
    def gaps(burstiness: float) -> list[float]:
        trace = build_trace(TraceSpec(num_requests=2000, rate=10.0, burstiness=burstiness))
        return [b.arrival - a.arrival for a, b in zip(trace, trace[1:], strict=False)]

    for b in (0.25, 1.0, 4.0):
        g = gaps(b)
        assert statistics.fmean(g) == pytest.approx(0.1, rel=0.15)
        # Gamma(shape=b) has coefficient of variation 1/sqrt(b): 2, 1, 0.5.
        cv = statistics.pstdev(g) / statistics.fmean(g)
        assert cv == pytest.approx(1 / math.sqrt(b), rel=0.2)


def test_infinite_rate_sends_everything_at_once() -> None:
    trace = build_trace(TraceSpec(num_requests=50, rate=math.inf))
    assert {r.arrival for r in trace} == {0.0}


def test_lengths_fill_their_inclusive_ranges() -> None:
    trace = build_trace(TraceSpec(num_requests=2000, prompt_len=(3, 6), output_len=(1, 4)))
    assert {r.prompt_len for r in trace} == {3, 4, 5, 6}
    assert {r.output_len for r in trace} == {1, 2, 3, 4}
    assert all(len(r.prompt) == r.prompt_len for r in trace)


def test_token_prompts_stay_in_the_id_range() -> None:
    trace = build_trace(TraceSpec(num_requests=200, token_ids=(40, 45)))
    ids = {t for r in trace for t in r.prompt}
    assert ids == set(range(40, 46))


def test_rate_changes_timing_but_not_the_requests() -> None:
    slow, fast = build_trace(TraceSpec(rate=1.0)), build_trace(TraceSpec(rate=16.0))
    assert [r.arrival for r in slow] != [r.arrival for r in fast]
    assert [(r.prompt, r.output_len) for r in slow] == [(r.prompt, r.output_len) for r in fast]


def test_shared_prefix_starts_every_token_prompt() -> None:
    trace = build_trace(TraceSpec(num_requests=20, shared_prefix=16, prompt_len=(4, 8)))
    prefix = trace[0].prompt[:16]
    assert all(r.prompt[:16] == prefix for r in trace)
    assert all(r.prompt_len == len(r.prompt) and 20 <= r.prompt_len <= 24 for r in trace)
    assert len({r.prompt[16:] for r in trace}) == 20  # the rest is each request's own


def byte_count(text: str) -> int:
    return len(text.encode()) + 1  # a byte-level tokenizer that adds BOS


def word_count(text: str) -> int:
    return len(text.split()) + 1  # a word-level tokenizer: padding must add whole words


@pytest.mark.parametrize("count", [byte_count, word_count])
def test_text_prompts_have_exact_token_length(count) -> None:
    spec = TraceSpec(num_requests=30, prompt_kind="text", shared_prefix=10)
    trace = build_trace(spec, count)
    assert all(isinstance(r.prompt, str) and count(r.prompt) == r.prompt_len for r in trace)
    assert all(42 <= r.prompt_len <= 106 for r in trace)  # 32-96 drawn, plus the prefix
    assert count(os.path.commonprefix([r.prompt for r in trace])) >= 10


def test_text_prompt_needs_a_token_counter() -> None:
    with pytest.raises(ValueError, match="count_tokens"):
        build_trace(TraceSpec(prompt_kind="text"))


def test_fit_text_fails_loudly_when_the_length_cannot_be_hit() -> None:
    with pytest.raises(ValueError, match="exactly 7"):
        fit_text(lambda text: 2 * len(text.encode()), 7, ["ab"] * 10)


@pytest.mark.parametrize(
    "bad",
    [
        {"rate": 0.0},
        {"burstiness": 0.0},
        {"prompt_len": (9, 3)},
        {"output_len": (0, 4)},
        {"num_requests": 0},
        {"prompt_kind": "words"},
    ],
)
def test_trace_spec_rejects_bad_values(bad: dict) -> None:
    with pytest.raises(ValueError):
        TraceSpec(**bad)


# --- metrics on hand-made records -------------------------------------------------------------

# A slow request: TTFT 0.5 s, gaps 0.1, 0.2, 0.3 s, E2E 1.2 s, 4 tokens.
SLOW_REC = RequestRecord(
    index=0, arrival=1.0, prompt_len=10, output_len=4, send_time=1.0,
    chunk_times=(1.5, 1.6, 1.8, 2.1), end_time=2.2, completion_tokens=4, prompt_tokens=10,
)  # fmt: skip
# A fast request within the SLO: TTFT 0.2 s, gaps 0.02, 0.02 s, 3 tokens, no usage prompt count.
FAST_REC = RequestRecord(
    index=1, arrival=0.0, prompt_len=5, output_len=3, send_time=0.0,
    chunk_times=(0.2, 0.22, 0.24), end_time=0.25, completion_tokens=3,
)  # fmt: skip
FAILED_REC = RequestRecord(
    index=2, arrival=0.5, prompt_len=5, output_len=3, send_time=0.5, chunk_times=(0.9,),
    error="HTTP 500 server_error: boom",
)  # fmt: skip
UNSENT_REC = RequestRecord(
    index=3, arrival=9.0, prompt_len=5, output_len=3, send_time=None, error="timeout"
)


def test_per_request_metrics() -> None:
    assert ttft(SLOW_REC) == pytest.approx(0.5)
    assert itls(SLOW_REC) == pytest.approx([0.1, 0.2, 0.3])
    assert e2e(SLOW_REC) == pytest.approx(1.2)
    assert tpot(SLOW_REC) == pytest.approx((1.2 - 0.5) / 3)
    assert ttft(UNSENT_REC) is None and e2e(FAILED_REC) is None


def test_tpot_needs_two_tokens() -> None:
    one = replace(FAST_REC, chunk_times=(0.2,), completion_tokens=1)
    assert tpot(one) is None


def test_percentile_interpolates_linearly() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 25) == 1.75
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile([7.0], 99) == 7.0


def test_slo_uses_ttft_and_mean_itl() -> None:
    assert meets_slo(FAST_REC, SLO())
    assert not meets_slo(SLOW_REC, SLO())  # mean ITL 0.2 s > 0.05 s
    assert meets_slo(SLOW_REC, SLO(ttft=0.5, itl_mean=0.21))
    assert not meets_slo(SLOW_REC, SLO(ttft=0.49, itl_mean=0.21))
    assert not meets_slo(FAILED_REC, SLO(ttft=10, itl_mean=10))


def test_slo_on_p99_itl_catches_one_long_pause() -> None:
    # Nine 10 ms gaps and one 300 ms pause: mean 39 ms passes, p99 (273.9 ms) does not.
    times = tuple(0.1 + 0.01 * i for i in range(10)) + (0.1 + 0.09 + 0.3,)
    rec = replace(FAST_REC, chunk_times=times, end_time=times[-1], completion_tokens=11)
    assert percentile(itls(rec), 99) == pytest.approx(0.2739)
    assert meets_slo(rec, SLO())
    assert not meets_slo(rec, SLO(itl_p99=0.2))
    assert meets_slo(rec, SLO(itl_p99=0.3))


def test_summary_of_hand_made_records() -> None:
    s = summarize([SLOW_REC, FAST_REC, FAILED_REC, UNSENT_REC], duration=4.0, peak_concurrency=2)
    assert (s.total, s.completed, s.failed) == (4, 2, 2)
    assert s.input_tokens == 15  # 10 from usage, 5 from the trace where usage gave none
    assert s.output_tokens == 7
    assert s.request_throughput == 0.5
    assert s.output_throughput == 1.75
    assert s.total_token_throughput == 5.5
    assert s.goodput == 0.25  # only FAST_REC meets the SLO
    assert s.goodput_fraction == 0.25
    assert s.peak_concurrency == 2
    assert s.errors == {"HTTP 500 server_error: boom": 1, "timeout": 1}
    assert s.ttft is not None and s.itl is not None and s.tpot is not None
    assert s.ttft.mean == pytest.approx(0.35)
    assert s.ttft.p90 == pytest.approx(0.47)
    assert s.ttft.p99 == pytest.approx(0.497)
    # Gaps pooled over requests: 0.02, 0.02, 0.1, 0.2, 0.3.
    assert s.itl.count == 5
    assert s.itl.mean == pytest.approx(0.128)
    assert s.itl.p50 == pytest.approx(0.1)
    assert s.itl.p90 == pytest.approx(0.26)
    assert s.tpot.p50 == pytest.approx(((0.7 / 3) + 0.025) / 2)


def test_length_mismatch_uses_usage_or_counts_chunks() -> None:
    short = replace(SLOW_REC, completion_tokens=3)
    no_usage = replace(SLOW_REC, completion_tokens=None)  # four chunks stand in for four tokens
    assert short.length_mismatch and not no_usage.length_mismatch
    assert not FAILED_REC.length_mismatch
    assert summarize([short, FAST_REC], 1.0, 1).length_mismatches == 1


def test_empty_run_has_no_distributions() -> None:
    s = summarize([UNSENT_REC], duration=0.0, peak_concurrency=0)
    assert s.ttft is None and s.completed == 0 and s.output_throughput == 0.0
    assert distribution([]) is None
    assert "n/a" in format_summary(s)


# --- the runner against the fake server -------------------------------------------------------


async def test_runner_measures_ttft_and_itl_from_the_stream(url: str) -> None:
    trace = (_request(0), _request(1))
    result = await run_trace(trace, base_url=url, model="fake", progress=False)
    assert result.peak_concurrency == 2
    for rec in result.records:
        assert rec.ok, rec.error
        assert len(rec.chunk_times) == 4  # the empty finish chunk is not a token
        assert rec.completion_tokens == 4 and rec.prompt_tokens == 5
        assert ttft(rec) >= FIRST_DELAY - SLACK
        assert all(gap >= GAP - SLACK for gap in itls(rec))
        assert rec.send_time <= rec.chunk_times[0] <= rec.chunk_times[-1] <= rec.end_time
        assert tpot(rec) == pytest.approx((e2e(rec) - ttft(rec)) / 3)
        assert not rec.length_mismatch
    assert result.duration >= max(r.end_time for r in result.records)


async def test_runner_is_open_loop(url: str) -> None:
    # Each request streams for ~0.14 s but they arrive 0.04 s apart: an open loop sends each on
    # time regardless, so all three are in flight together.
    trace = tuple(_request(i, arrival=0.04 * i) for i in range(3))
    result = await run_trace(trace, base_url=url, model="fake", progress=False)
    for rec in result.records:
        assert rec.ok
        assert rec.arrival - SLACK <= rec.send_time <= rec.arrival + 0.02
    assert result.peak_concurrency == 3


async def test_runner_records_errors_without_stopping(url: str) -> None:
    trace = (_request(0, first=REJECT), _request(1, first=FAIL_MIDWAY), _request(2))
    result = await run_trace(trace, base_url=url, model="fake", progress=False)
    rejected, failed, fine = result.records
    assert rejected.error == "HTTP 400 invalid_request_error: prompt rejected"
    assert failed.error == "stream error server_error: engine failed"
    assert len(failed.chunk_times) == 1 and not failed.ok
    assert fine.ok
    assert summarize(result.records, result.duration, result.peak_concurrency).failed == 2


async def test_runner_flags_output_length_mismatch(url: str) -> None:
    result = await run_trace(
        (_request(0, output_len=CAP + 2),), base_url=url, model="fake", progress=False
    )
    (rec,) = result.records
    assert rec.ok and rec.completion_tokens == CAP
    assert rec.length_mismatch


async def test_time_limit_cancels_the_rest_as_timeouts(url: str) -> None:
    trace = (_request(0, first=SLOW, output_len=5), _request(1), _request(2, arrival=30.0))
    result = await run_trace(trace, base_url=url, model="fake", time_limit=0.3, progress=False)
    slow, fine, unsent = result.records
    assert slow.error == "timeout" and slow.send_time is not None
    assert len(slow.chunk_times) == 1  # what it saw before the cut is kept
    assert unsent.error == "timeout" and unsent.send_time is None
    assert fine.ok
    assert 0.3 - SLACK <= result.duration < 1.0


async def test_chat_endpoint_times_content_not_the_role_chunk(url: str) -> None:
    trace = (TraceRequest(0, 0.0, "hello there", prompt_len=12, output_len=3),)
    result = await run_trace(trace, base_url=url, model="fake", endpoint="chat", progress=False)
    (rec,) = result.records
    assert rec.ok and len(rec.chunk_times) == 3
    assert ttft(rec) >= FIRST_DELAY - SLACK


async def test_chat_endpoint_refuses_token_prompts(url: str) -> None:
    with pytest.raises(ValueError, match="text prompts"):
        await run_trace((_request(0),), base_url=url, model="fake", endpoint="chat")


def test_request_body_asks_for_exactly_output_len_tokens() -> None:
    body = request_body(_request(0, output_len=9), "m", "completions")
    assert body["prompt"] == [65, 66, 67, 68, 69]
    assert body["max_tokens"] == 9
    assert body["ignore_eos"] is True and body["temperature"] == 0
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


def test_sampling_fields_greedy_by_default_none_for_server_defaults_or_given() -> None:
    from loadtest.runner import SERVER_DEFAULTS, describe_sampling, parse_sampling

    def sampling_of(sampling):
        body = request_body(_request(0), "m", "completions", sampling)
        return {k: v for k, v in body.items() if k in ("temperature", "top_p", "top_k")}

    assert sampling_of(parse_sampling("greedy")) == {"temperature": 0}
    assert parse_sampling("server") == SERVER_DEFAULTS and sampling_of(SERVER_DEFAULTS) == {}
    given = parse_sampling('{"top_p": 0.9, "temperature": 0.2}')
    assert sampling_of(given) == {"temperature": 0.2, "top_p": 0.9}
    assert describe_sampling(SERVER_DEFAULTS) == "the server's defaults"
    with pytest.raises(ValueError, match="JSON object"):
        parse_sampling("[1]")
    with pytest.raises(ValueError, match="greedy, server or a JSON object"):
        parse_sampling("hot")


def test_the_loadtest_cli_refuses_bad_sampling(capsys) -> None:
    from loadtest.__main__ import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--sampling", "hot"])
    assert "--sampling" in capsys.readouterr().err


def test_model_info_and_tokenize_come_from_the_server(url: str) -> None:
    info = fetch_model_info(url)
    assert (info.id, info.parameter_count, info.torch_version) == ("fake", 5_838_080, "9.9")
    with TokenCounter(url, "fake") as counter:
        assert counter("abc") == 4
        trace = build_trace(TraceSpec(num_requests=5, prompt_kind="text"), counter)
    assert all(len(r.prompt.encode()) + 1 == r.prompt_len for r in trace)


# --- reports ----------------------------------------------------------------------------------


def test_conditions_line_matches_the_seed_format() -> None:
    conditions = Conditions(
        model="tinygpt", parameter_count=5_838_080, torch_version="2.4.0",
        trace="poisson, prompt 32-96, output 16-48, seed 7", rates=(8.0,), cores=4,
        machine="x86_64", date="2026-09-13T15:28:11+00:00",
    )  # fmt: skip
    assert conditions.line() == (
        "Conditions: tinygpt (5,838,080 params), 4x x86_64 CPU, torch 2.4.0, poisson, "
        "prompt 32-96, output 16-48, seed 7, arrival rate 8.0/s, measured 2026-09-13T15:28:11+00:00."
    )
    unknown = replace(conditions, parameter_count=None, torch_version=None, rates=(1.0, 4.0))
    assert unknown.line().startswith("Conditions: tinygpt, 4x x86_64 CPU, poisson")
    assert "arrival rates 1, 4/s" in unknown.line()
    assert "arrival rate 0.25/s" in replace(conditions, rates=(0.25,)).line()


def test_summary_block_uses_vllm_labels() -> None:
    text = format_summary(summarize([SLOW_REC, FAST_REC], 4.0, 2))
    for label in (
        "Successful requests:",
        "Benchmark duration (s):",
        "Request throughput (req/s):",
        "Output token throughput (tok/s):",
        "Request goodput (req/s):",
        "Mean TTFT (ms):",
        "Median TTFT (ms):",
        "P99 TTFT (ms):",
        "Mean ITL (ms):",
        "P99 TPOT (ms):",
        "Median E2EL (ms):",
    ):
        assert label in text
    assert "Mean TTFT (ms):                          350.00" in text


def test_sweep_table_has_a_row_per_point() -> None:
    summary = summarize([SLOW_REC, FAST_REC], 4.0, 2)
    table = format_sweep_table(
        [SweepPoint("static", 1.0, summary), SweepPoint("cont", 16, summary)]
    )
    lines = table.splitlines()
    assert len(lines) == 4
    assert all(line.count("|") == 13 for line in lines)
    assert lines[3].startswith("| cont | 16 | 2/2 | 1.8 | 350.0 |")


# --- CLI and sweeps ---------------------------------------------------------------------------


def test_cli_run_prints_report_and_writes_json(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run.json"
    argv = ["run", "--base-url", url, "--rate", "inf", "--num-requests", "3", "--prompt-len", "4:8"]
    argv += ["--output-len", "2:4", "--no-progress", "--out", str(out)]
    assert loadtest_main(argv) == 0
    printed = capsys.readouterr().out
    assert "Successful requests:                     3" in printed
    assert "Conditions: fake (5,838,080 params)" in printed and "torch 9.9" in printed
    saved = json.loads(out.read_text())  # strict JSON: rate inf is written as a string
    assert len(saved["records"]) == 3 and saved["summary"]["completed"] == 3
    assert saved["conditions"]["rates"] == ["inf"]
    assert all(r["ttft"] > 0 for r in saved["records"])


def test_cli_rejects_chat_with_token_prompts(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        loadtest_main(["run", "--endpoint", "chat"])
    assert "--prompt-kind text" in capsys.readouterr().err


def test_sweep_against_a_running_server_writes_table_and_plots(url: str, tmp_path: Path) -> None:
    argv = ["sweep", "--base-url", url, "--engines", "fake", "--rates", "50,inf"]
    argv += ["--num-requests", "3", "--output-len", "2:3", "--no-progress", "--out", str(tmp_path)]
    argv += ["--endpoint", "chat", "--prompt-kind", "text"]
    assert loadtest_main(argv) == 0
    table = (tmp_path / "results.md").read_text()
    assert "| fake | 50 | 3/3 |" in table and "| fake | inf | 3/3 |" in table
    assert "arrival rates 50, inf/s" in table and "text prompts" in table
    run = json.loads((tmp_path / "fake-rate50.json").read_text())
    assert all(isinstance(r["prompt_len"], int) and r["ttft"] > 0 for r in run["records"])
    for name in ("ttft.png", "itl.png", "goodput.png", "fake-rate50.json", "sweep.json"):
        assert (tmp_path / name).stat().st_size > 0


def test_server_command_runs_our_server_on_loopback() -> None:
    assert server_command("tinygpt", "static", 8123, ["--max-batch-size", "4"]) == [
        sys.executable, "-m", "server", "--model", "tinygpt", "--engine", "static",
        "--host", "127.0.0.1", "--port", "8123", "--max-batch-size", "4",
    ]  # fmt: skip


HEALTH_SERVER = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def test_server_process_waits_for_health_and_stops_the_server(tmp_path: Path) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-c", HEALTH_SERVER, str(port)]
    with server_process(command, base, tmp_path / "server.log", startup_timeout=20) as got:
        assert got == base
        assert httpx.get(f"{base}/health").status_code == 200
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{base}/health")


def test_server_process_reports_a_server_that_exits(tmp_path: Path) -> None:
    command = [sys.executable, "-c", "import sys; print('bad flag'); sys.exit(2)"]
    base = f"http://127.0.0.1:{free_port()}"
    with (
        pytest.raises(ServerStartError, match="exited with code 2") as info,
        server_process(command, base, tmp_path / "server.log", startup_timeout=20),
    ):
        pass
    assert "bad flag" in str(info.value)
