"""SIGTERM while an engine step is still running at the drain deadline: the process must exit
soon after the deadline, not when the step ends.

An engine step cannot be interrupted. Before `DrainingServer` exited on its own, Python joined the
step's thread at interpreter exit, so a long step (a big prefill, a big model) kept the process
alive past Docker's 10 s grace and it died of SIGKILL (exit 137), although every client already
had its error. Here one step prefills 8 prompts of ~2,000 tokens on TinyGPT (seconds), and
SIGTERM arrives while it runs, with a 1 s drain.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from loadtest.sweep import free_port

DRAIN = 1.0


@pytest.mark.slow
def test_sigterm_during_a_long_step_exits_without_waiting_for_it(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "server.log"
    cmd = [
        sys.executable, "-m", "server", "--model", "tinygpt", "--port", str(port),
        "--shutdown-timeout", str(DRAIN),
        # One step takes every prompt whole: 8 x 2,000 tokens.
        "--max-num-batched-tokens", "16384", "--target-step-ms", "0",
        "--num-threads", "1",
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)

        answers: list[httpx.Response] = []

        def ask(i: int) -> None:
            prompt = chr(ord("a") + i) * 2000  # distinct prompts: no prefix-cache sharing
            body = {"prompt": prompt, "max_tokens": 4}
            answers.append(httpx.post(url + "/v1/completions", json=body, timeout=120))

        clients = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
        for c in clients:
            c.start()
        # Wait until the engine has taken the requests (the step is running), then stop.
        while True:
            metrics = httpx.get(url + "/metrics", timeout=30).text
            if "cbserve_num_requests_running 0.0" not in metrics:
                break
            time.sleep(0.05)
        time.sleep(0.2)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        elapsed = time.monotonic() - t0
        for c in clients:
            c.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log_path.read_text()
    # The scenario happened: the step outlived the deadline and the driver's wait for it.
    assert "engine step still running" in text, text
    assert "exiting without joining" in text and "engine-step" in text, text
    assert code == 0
    # Deadline + the driver's 0.5 s step wait + 0.1 s for threads + the exit itself.
    assert elapsed < DRAIN + 2.5, f"exit took {elapsed:.1f} s\n{text}"
    assert len(answers) == 8
    for r in answers:
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "engine_unavailable"
        assert "shutting down" in r.json()["error"]["message"]
    assert "Traceback" not in text
