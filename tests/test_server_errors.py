"""Every error leaves as OpenAI's error object with the right status: 400 for bad values and
over-long requests, 404 for unknown models and paths, 401 without the API key, 413 for big
bodies, 429 with Retry-After when the waiting queue is full. Never a 500 for bad input."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from server.http.app import ServerSettings
from server.openai.protocol import (
    MAX_LOGPROBS,
    MAX_N,
    MAX_PROMPTS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
)
from tests.helpers.servers import LiveServer, StepGate, error_of, run_server

OK = {"model": "tinygpt", "prompt": "Hi", "max_tokens": 2}
CHAT_OK = {"model": "tinygpt", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def post(server: LiveServer, path: str, **kw) -> httpx.Response:
    return httpx.post(server.url(path), timeout=30, **kw)


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5}, "min_tokens"),  # more than max_tokens
        ({"n": 0}, "n"),
        ({"n": MAX_N + 1}, "n"),
        ({"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
        ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop"),
        ({"stop": "y" * (MAX_STOP_STRING_CHARS + 1)}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"logit_bias": {"not-a-token": 1}}, "logit_bias"),
        ({"logit_bias": {"65": 500}}, "logit_bias"),
        ({"logit_bias": {"99999": 1}}, "logit_bias"),
        ({"stop_token_ids": [99999]}, "stop_token_ids"),
        ({"prompt": [1, 2, 99999]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"seed": 2**64}, "seed"),
        ({"prompt": ["p"] * (MAX_PROMPTS + 1)}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"suffix": "tail"}, "suffix"),
        ({"best_of": 2}, "best_of"),
        ({"max_tokens": 0, "echo": False}, "max_tokens"),  # 0 only with echo
        ({"prompt_logprobs": MAX_LOGPROBS + 1}, "prompt_logprobs"),
        ({"stream_options": {"include_usage": True}}, None),  # without stream
        ({"temperature": "hot"}, "temperature"),
    ],
)
def test_invalid_completion_values_get_400_naming_the_field(server: LiveServer, change, param):
    r = post(server, "/v1/completions", json={**OK, **change})
    assert r.status_code == 400, r.text
    error = error_of(r)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    if param:
        assert param in error["message"]


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "no role"}]}, "messages.0.role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            None,
        ),
        ({"top_logprobs": 2}, None),  # without logprobs
        ({"logprobs": True, "top_logprobs": MAX_LOGPROBS + 1}, "top_logprobs"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type"),
    ],
)
def test_invalid_chat_values_get_400(server: LiveServer, change, param):
    r = post(server, "/v1/chat/completions", json={**CHAT_OK, **change})
    assert r.status_code == 400, r.text
    error = error_of(r)
    if param:
        assert error["param"] == param


def test_prompt_plus_max_tokens_beyond_the_context_gets_400_with_the_numbers(server: LiveServer):
    r = post(server, "/v1/completions", json={**OK, "prompt": "x" * 2000, "max_tokens": 100})
    assert r.status_code == 400
    error = error_of(r)
    assert error["code"] == "context_length_exceeded"
    for number in ("2048", "2101", "2001", "100"):  # limit, total, prompt (+BOS), completion
        assert number in error["message"]


def test_chat_prompt_filling_the_context_gets_400(server: LiveServer):
    messages = [{"role": "user", "content": "x" * 2100}]
    r = post(server, "/v1/chat/completions", json={"model": "tinygpt", "messages": messages})
    assert r.status_code == 400
    assert "2048" in error_of(r)["message"]


def test_malformed_json_gets_400(server: LiveServer):
    r = post(
        server,
        "/v1/completions",
        content=b'{"prompt": "x",',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400
    assert "JSON" in error_of(r)["message"]


def test_body_without_json_content_type_gets_400(server: LiveServer):
    r = post(
        server,
        "/v1/completions",
        content=b'{"prompt": "x"}',
        headers={"content-type": "text/plain"},
    )
    assert r.status_code == 400
    assert "JSON object" in error_of(r)["message"]


def test_missing_required_field_gets_400_naming_it(server: LiveServer):
    r = post(server, "/v1/completions", json={"model": "tinygpt"})
    assert r.status_code == 400
    assert error_of(r)["param"] == "prompt"


def test_unknown_model_gets_404(server: LiveServer):
    for path, body in (("/v1/completions", OK), ("/v1/chat/completions", CHAT_OK)):
        r = post(server, path, json={**body, "model": "gpt-17"})
        assert r.status_code == 404
        error = error_of(r)
        assert error["code"] == "model_not_found" and "gpt-17" in error["message"]


def test_unknown_path_and_wrong_method_are_openai_shaped(server: LiveServer):
    assert error_of(httpx.get(server.url("/v1/nothing"), timeout=10))["code"] == "not_found"
    r = httpx.get(server.url("/v1/completions"), timeout=10)
    assert r.status_code == 405
    error_of(r)


def test_body_over_the_limit_by_content_length_gets_413(server: LiveServer):
    big = b'{"prompt": "' + b"x" * (4 * 2**20) + b'"}'
    r = post(server, "/v1/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert error_of(r)["code"] == "request_too_large"


def test_chunked_body_over_the_limit_gets_413(server: LiveServer):
    def chunks():
        yield b'{"prompt": "'
        for _ in range(5):
            yield b"x" * 2**20
        yield b'"}'

    r = post(
        server, "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
    )
    assert r.status_code == 413
    assert error_of(r)["code"] == "request_too_large"


def test_openai_sdk_raises_typed_errors(server: LiveServer):
    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tinygpt", prompt="x", temperature=-1)
    assert bad.value.param == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")


def test_tokenize_and_detokenize_round_trip(server: LiveServer, tiny_lm):
    r = post(server, "/tokenize", json={"prompt": "héllo", "add_special_tokens": False})
    assert r.json()["tokens"] == tiny_lm.tokenizer.encode("héllo")
    assert r.json()["count"] == len("héllo".encode())
    assert post(server, "/detokenize", json={"tokens": r.json()["tokens"]}).json() == {
        "prompt": "héllo"
    }
    chat = post(server, "/tokenize", json={"messages": [{"role": "user", "content": "a"}]}).json()
    assert chat["count"] == len(chat["tokens"]) > 1
    assert post(server, "/detokenize", json={"tokens": [99999]}).status_code == 400
    assert post(server, "/tokenize", json={}).status_code == 400


# -- servers with their own settings ---------------------------------------------------------------


def test_api_key_is_required_on_the_api_but_not_on_health(tiny_lm):
    with run_server(tiny_lm, settings=ServerSettings(api_key="sekret")) as live:
        assert httpx.get(live.url("/health"), timeout=10).status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            r = httpx.post(live.url("/v1/completions"), json=OK, headers=headers, timeout=10)
            assert r.status_code == 401
            assert error_of(r)["code"] == "invalid_api_key"
        assert httpx.get(live.url("/v1/models"), timeout=10).status_code == 401
        client = openai.OpenAI(base_url=live.v1, api_key="sekret", max_retries=0)
        assert client.completions.create(model="tinygpt", prompt="x", max_tokens=1).choices
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=live.v1, api_key="nope", max_retries=0).models.list()


def test_full_waiting_queue_gets_429_with_retry_after(tiny_lm):
    gate: list[StepGate] = []
    with (
        run_server(
            tiny_lm,
            engine_options={"max_batch_size": 1},
            driver_options={"max_waiting": 1},
            before_start=lambda e: gate.append(StepGate(e)),
        ) as live,
        httpx.Client(timeout=30) as client,
        ThreadPoolExecutor(1) as pool,
    ):
        # /health in run_server never steps; the first step is this request's, held at the gate.
        body = {**OK, "stream": True, "max_tokens": 3}
        with client.stream("POST", live.url("/v1/completions"), json=body) as first:
            assert first.status_code == 200  # accepted: it takes the one slot
            assert gate[0].entered.wait(30)
            # The second cannot start (no free slot): it is the one request the queue may hold.
            second = pool.submit(httpx.post, live.url("/v1/completions"), json=OK, timeout=60)
            deadline = time.monotonic() + 30
            while live.driver.stats().num_cannot_start < 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            r = client.post(live.url("/v1/completions"), json=OK)
            assert r.status_code == 429
            assert r.headers["retry-after"] == "1"
            assert error_of(r)["type"] == "rate_limit_error"
            gate[0].open()
            assert "[DONE]" in first.read().decode()
            assert second.result().status_code == 200
        assert client.post(live.url("/v1/completions"), json=OK).status_code == 200
