"""The web page at / and its live-stats endpoint.

The browser test drives Debian's chromium through playwright against a real server: the page
loads, a streamed answer appears in the chat box, and the live view changes while a load runs.
It skips where /usr/bin/chromium is not installed (`make test` installs it where it can).
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import httpx
import pytest

from server.http.app import ServerSettings
from tests.helpers.servers import run_server

CHROMIUM = Path("/usr/bin/chromium")
KEY = "sk-web-test"


@pytest.fixture(scope="module")
def keyed(tiny_lm):
    with run_server(tiny_lm, settings=ServerSettings(api_key=KEY)) as live:
        yield live


def test_page_is_served_without_the_key_and_its_data_needs_it(keyed):
    page = httpx.get(keyed.url("/"), timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    html = page.text
    assert "/v1/chat/completions" in html and "/v1/engine/stats" in html
    assert "http://" not in html and "https://" not in html  # nothing fetched from elsewhere
    assert httpx.get(keyed.url("/v1/engine/stats"), timeout=10).status_code == 401
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(keyed.url("/v1/engine/stats"), headers=auth, timeout=10).status_code == 200


def test_engine_stats_report_steps_and_latencies_after_a_request(keyed):
    auth = {"Authorization": f"Bearer {KEY}"}
    # ignore_eos: an unseeded draw may pick EOS early, and the count below needs all 8 tokens
    body = {"prompt": "Hello", "max_tokens": 8, "stream": True, "ignore_eos": True}
    r = httpx.post(keyed.url("/v1/completions"), json=body, headers=auth, timeout=60)
    assert r.status_code == 200
    s = httpx.get(keyed.url("/v1/engine/stats"), headers=auth, timeout=10).json()
    assert s["running"] == 0 and s["waiting"] == 0
    assert s["kv_blocks_total"] > 0 and 0 <= s["kv_blocks_used"] <= s["kv_blocks_total"]
    assert sum(s["batch_occupancy"]) >= 8  # the 8 tokens came from recorded steps
    assert s["ttft_ms"]["p50"] is not None and s["itl_ms"]["p50"] is not None
    assert 0.0 <= s["prefix_cache_hit_rate"] <= 1.0


def test_no_web_ui_leaves_the_page_out(tiny_lm):
    with run_server(tiny_lm, settings=ServerSettings(web_ui=False)) as live:
        assert httpx.get(live.url("/"), timeout=10).status_code == 404
        assert httpx.get(live.url("/v1/engine/stats"), timeout=10).status_code == 200


def test_cli_flag():
    from server.cli import build_parser

    assert build_parser().parse_args([]).web_ui is True
    assert build_parser().parse_args(["--no-web-ui"]).web_ui is False


@pytest.mark.slow
def test_in_a_real_browser_chat_streams_and_the_live_view_moves(keyed):
    if not CHROMIUM.exists() and not shutil.which("chromium"):
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api")
    auth = {"Authorization": f"Bearer {KEY}"}
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=str(CHROMIUM if CHROMIUM.exists() else shutil.which("chromium")),
            args=["--no-sandbox", "--disable-gpu"],
        )
        try:
            page = browser.new_page()
            page.goto(keyed.url("/"))
            page.fill("#key", KEY)
            page.dispatch_event("#key", "change")
            # The chat: a streamed answer appears.
            page.fill("#prompt", "Hello there")
            page.click("#send")
            page.wait_for_selector(".assistant[data-done='true']", timeout=60_000)
            assert page.inner_text("#error") == ""
            answer = page.locator(".assistant").last.text_content()
            assert answer  # TinyGPT's words are random, but there are some
            assert page.inner_text("#model").startswith("tinygpt")

            # The live view: running requests and tokens/s move while a load runs.
            stop = threading.Event()

            def load() -> None:
                body = {"prompt": "Load", "max_tokens": 48, "ignore_eos": True, "n": 4}
                for _ in range(20):  # bounded; ends as soon as the view has moved
                    if stop.is_set():
                        return
                    httpx.post(keyed.url("/v1/completions"), json=body, headers=auth, timeout=120)

            worker = threading.Thread(target=load)
            worker.start()
            try:
                page.wait_for_function(
                    "document.getElementById('running').textContent.split(' / ')[0] !== '0'",
                    timeout=60_000,
                )
                page.wait_for_function(
                    "parseFloat(document.getElementById('tps').textContent) > 0", timeout=60_000
                )
                assert page.inner_text("#ttft") != "-"
            finally:
                stop.set()
                worker.join(timeout=120)
        finally:
            browser.close()
