"""Failure and lifecycle: an engine step that raises reaches every open client and turns /health
to 503; a stuck step turns /health to 503; SIGTERM drains in-flight requests and exits; the CLI
reports a missing model without a traceback."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from models import ByteTokenizer
from tests.helpers.servers import FailingStep, StepGate, error_of, free_port, run_server, sse_events

ROOT = Path(__file__).resolve().parents[1]
BODY = {"model": "tinygpt", "prompt": "Hello", "temperature": 0, "ignore_eos": True}


def test_engine_fault_ends_open_streams_with_an_error_event_and_marks_health_503(tiny_lm, caplog):
    with run_server(tiny_lm) as live:
        FailingStep(live.engine, fail_at=4)
        with httpx.Client(timeout=30) as client:
            body = {**BODY, "max_tokens": 50, "stream": True}
            r = client.post(live.url("/v1/completions"), json=body)
            assert r.status_code == 200  # the stream had begun: the error arrives in-band
            payloads = sse_events(r.text)
            assert payloads[-1] == "[DONE]"
            request_id = json.loads(payloads[0])["id"]
            error = json.loads(payloads[-2])["error"]
            assert error["code"] == "engine_unavailable" and error["type"] == "server_error"
            # The client learns its request id, not the exception; the log has the exception.
            assert request_id in error["message"]
            assert "injected" not in error["message"]
            assert "injected engine fault" in caplog.text and request_id in caplog.text
            assert [json.loads(p).get("choices") for p in payloads[:-2]]  # tokens came first

            health = client.get(live.url("/health"))
            assert health.status_code == 503
            assert "RuntimeError" in error_of(health)["message"]
            assert "injected" not in error_of(health)["message"]
            assert live.metric("cbserve_engine_healthy") == 0
            # No hanging: new requests fail at once.
            r = client.post(live.url("/v1/completions"), json={**BODY, "max_tokens": 2})
            assert r.status_code == 503
            assert error_of(r)["code"] == "engine_unavailable"


def test_engine_fault_fails_a_non_streamed_request_with_503(tiny_lm):
    with run_server(tiny_lm) as live:
        FailingStep(live.engine, fail_at=3)
        r = httpx.post(
            live.url("/v1/chat/completions"),
            timeout=30,
            json={
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 20,
                "ignore_eos": True,
            },
        )
        assert r.status_code == 503
        error = error_of(r)
        assert error["code"] == "engine_unavailable" and "chatcmpl-" in error["message"]
        assert "injected" not in error["message"]
        assert httpx.get(live.url("/health"), timeout=10).status_code == 503


class LeakyTokenizer(ByteTokenizer):
    """A tokenizer with a bug: encoding raises a ValueError whose text must stay private."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        raise ValueError("secret internal detail")


def test_a_bug_is_a_500_with_a_request_id_and_no_internals(tiny_lm, caplog):
    # A ValueError from a bug is not the client's fault: no 400, and its text is only logged.
    leaky = dataclasses.replace(tiny_lm, tokenizer=LeakyTokenizer())
    with run_server(leaky) as live:
        r = httpx.post(live.url("/v1/completions"), json={**BODY, "max_tokens": 2}, timeout=30)
        assert r.status_code == 500
        error = error_of(r)
        assert error["code"] == "internal_error"
        assert "secret" not in error["message"]
        request_id = error["message"].rsplit("request id ", 1)[1].rstrip(")")
        assert "secret internal detail" in caplog.text and request_id in caplog.text


def test_engine_fault_reaches_every_concurrent_request(tiny_lm):
    with run_server(tiny_lm) as live:
        engine = live.engine
        step = engine.step

        def fail_once_all_three_run():
            if len(engine.requests) == 3:
                raise RuntimeError("injected engine fault")
            return step()

        engine.step = fail_once_all_three_run
        results: list[str] = []

        def stream(i: int) -> None:
            body = {**BODY, "prompt": f"p{i}", "max_tokens": 1500, "stream": True}
            results.append(httpx.post(live.url("/v1/completions"), json=body, timeout=60).text)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(results) == 3
        for text in results:
            payloads = sse_events(text)
            assert payloads[-1] == "[DONE]"
            assert json.loads(payloads[-2])["error"]["code"] == "engine_unavailable"


def test_stuck_step_turns_health_503(tiny_lm):
    now = [0.0]
    with run_server(tiny_lm, driver_options={"step_timeout": 5.0, "clock": lambda: now[0]}) as live:
        gate = StepGate(live.engine)
        with (
            httpx.Client(timeout=30) as client,
            client.stream(
                "POST", live.url("/v1/completions"), json={**BODY, "max_tokens": 2, "stream": True}
            ) as r,
        ):
            assert gate.entered.wait(30)
            assert client.get(live.url("/health")).status_code == 200  # running, not yet stuck
            now[0] += 6.0
            health = client.get(live.url("/health"))
            assert health.status_code == 503
            assert "over 5s" in error_of(health)["message"]
            gate.open()
            assert r.read().decode().endswith("data: [DONE]\n\n")
        assert httpx.get(live.url("/health"), timeout=10).status_code == 200  # it came unstuck


# -- the process: CLI and SIGTERM --------------------------------------------------------------------


@pytest.fixture
def server_process() -> Iterator[tuple[subprocess.Popen, int, list[str]]]:
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "server",
            "--model",
            "tinygpt",
            "--port",
            str(port),
            "--num-threads",
            "1",
            "--shutdown-timeout",
            "20",
        ],
        cwd=ROOT,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    try:
        yield proc, port, lines
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def _read_until(proc: subprocess.Popen, lines: list[str], marker: str) -> None:
    for line in proc.stderr:  # blocks on the server's own log output, not on a timer
        lines.append(line)
        if marker in line:
            return
    raise AssertionError(f"server exited before logging {marker!r}:\n{''.join(lines)}")


@pytest.mark.slow
def test_sigterm_stops_admission_lets_streams_finish_and_exits_cleanly(server_process):
    proc, port, lines = server_process
    _read_until(proc, lines, "Application startup complete")
    url = f"http://127.0.0.1:{port}/v1/completions"
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", url, json={**BODY, "max_tokens": 400, "stream": True}) as r,
    ):
        events = r.iter_lines()
        assert next(e for e in events if e.startswith("data: {"))
        proc.send_signal(signal.SIGTERM)
        _read_until(proc, lines, "Waiting for connections to close")
        with pytest.raises(httpx.ConnectError):
            httpx.post(url, json={**BODY, "max_tokens": 1}, timeout=5)
        rest = [e for e in events if e.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
    assert proc.wait(30) == 0
    log = "".join(lines) + proc.stderr.read()
    assert "output_tokens=400" in log and "status=ok" in log


def test_cli_missing_model_prints_the_loader_message_and_exits_1():
    r = subprocess.run(
        [sys.executable, "-m", "server", "--model", "/nonexistent/model.gguf"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1
    assert "error:" in r.stderr and "/nonexistent/model.gguf" in r.stderr
    assert "Traceback" not in r.stderr


def test_cli_help_lists_the_flags():
    r = subprocess.run(
        [sys.executable, "-m", "server", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0
    for flag in (
        "--model",
        "--engine",
        "--host",
        "--port",
        "--max-batch-size",
        "--kv-cache-memory",
        "--api-key",
        "--served-model-name",
        "--max-num-batched-tokens",
        "--num-threads",
        "--max-waiting",
        "--block-size",
        "--log-level",
    ):
        assert flag in r.stdout
