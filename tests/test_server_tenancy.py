"""Tenancy at the HTTP edge: `cache_salt` keeps a tenant's prefix cache to itself,
`priority` is accepted and checked, and a per-client concurrency limit answers 429."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from server.http.app import ServerSettings
from tests.helpers.servers import LiveServer, StepGate, error_of, run_server


def cached_tokens(live: LiveServer, prompt: str, **extra) -> int:
    client = openai.OpenAI(base_url=live.v1, api_key="x", max_retries=0)
    r = client.completions.create(model="tinygpt", prompt=prompt, max_tokens=1, extra_body=extra)
    return r.usage.prompt_tokens_details.cached_tokens


def test_cache_salt_separates_prefix_caches(server):
    prompt = "a shared system prompt " * 5 + uuid.uuid4().hex  # ~150 byte tokens, unseen
    assert cached_tokens(server, prompt) == 0
    assert cached_tokens(server, prompt) > 100  # unsalted requests share
    assert cached_tokens(server, prompt, cache_salt="tenant-a") == 0  # not with the unsalted
    assert cached_tokens(server, prompt, cache_salt="tenant-a") > 100  # but within the tenant
    assert cached_tokens(server, prompt, cache_salt="tenant-b") == 0


@pytest.mark.parametrize(
    "extra", [{"priority": "high"}, {"priority": 2**40}, {"cache_salt": ""}, {"cache_salt": 5}]
)
def test_bad_priority_or_cache_salt_is_a_400(server, extra):
    body = {"prompt": "x", "max_tokens": 1, **extra}
    r = httpx.post(server.url("/v1/completions"), json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert error_of(r)["type"] == "invalid_request_error"


def test_priority_is_accepted(server):
    body = {"prompt": "x", "max_tokens": 1, "priority": -3}
    assert httpx.post(server.url("/v1/completions"), json=body, timeout=30).status_code == 200


def test_per_client_concurrency_limit(tiny_lm):
    gate: list[StepGate] = []
    body = {"prompt": "x", "max_tokens": 2, "stream": True}
    with (
        run_server(
            tiny_lm,
            settings=ServerSettings(max_concurrent_per_client=1),
            before_start=lambda e: gate.append(StepGate(e)),
        ) as live,
        httpx.Client(timeout=60) as client,
        ThreadPoolExecutor(1) as pool,
    ):
        url = live.url("/v1/completions")
        a = {"X-Client-Id": "a"}
        with client.stream("POST", url, json=body, headers=a) as first:
            assert first.status_code == 200
            assert gate[0].entered.wait(30)
            r = client.post(url, json=body, headers=a)  # a's second at once: over its limit
            assert r.status_code == 429 and r.headers["retry-after"]
            assert error_of(r)["type"] == "rate_limit_error"
            other = pool.submit(
                httpx.post, url, json=body, headers={"X-Client-Id": "b"}, timeout=60
            )
            gate[0].open()
            assert "[DONE]" in first.read().decode()
            assert other.result().status_code == 200
        # a's request has ended: its place is free again.
        assert client.post(url, json={**body, "stream": False}, headers=a).status_code == 200
