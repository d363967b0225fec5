"""Hostile input at the HTTP edge, on a real server: text that is not Unicode (lone surrogate
escapes, valid JSON) in every client string field, strict JSON types, sampling values at and
beyond their limits, and an OpenAPI document that says what the server does."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from server.http.openapi import UNSTATED_RULE_CODES
from server.openai.protocol import MAX_N, MAX_SEED, MAX_STOP_STRINGS
from tests.helpers.servers import LiveServer, error_of

SURROGATE = "\ud800"
OK = {"model": "tinygpt", "prompt": "Hi", "max_tokens": 2}
CHAT_OK = {"model": "tinygpt", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def post_raw(server: LiveServer, path: str, body: dict) -> httpx.Response:
    # json.dumps escapes the surrogate as \ud800: valid JSON, as a client could send it (httpx's
    # json= would fail to encode it on our side).
    return httpx.post(
        server.url(path),
        content=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
        timeout=30,
    )


def with_surrogate(base: dict, path: str, value=SURROGATE) -> dict:
    """`base` with the field at dotted `path` set to `value` (list indices as numbers)."""
    body = json.loads(json.dumps(base))
    keys = [int(k) if k.isdigit() else k for k in path.split(".")]
    target = body
    for k in keys[:-1]:
        target = target[k]
    target[keys[-1]] = value
    return body


COMPLETION_FIELDS = [
    ("prompt", SURROGATE, "prompt"),
    ("prompt", ["fine", "x" + SURROGATE], "prompt"),
    ("model", SURROGATE, "model"),
    ("stop", SURROGATE, "stop"),
    ("stop", ["ok", SURROGATE + "z"], "stop"),
    ("user", SURROGATE, "user"),
    ("suffix", SURROGATE, "suffix"),
    ("logit_bias", {SURROGATE: 1}, "logit_bias"),
]
CHAT_FIELDS = [
    ("messages.0.content", SURROGATE, "messages.0.content"),
    ("messages.0.content", [{"type": "text", "text": SURROGATE}], "messages.0.content"),
    ("messages.0.role", SURROGATE, "messages.0.role"),
    ("messages.0.name", SURROGATE, "messages.0.name"),
    ("model", SURROGATE, "model"),
    ("stop", SURROGATE, "stop"),
    ("user", SURROGATE, "user"),
]


def assert_names_bad_unicode(r: httpx.Response, param: str) -> None:
    """A 400 whose `param` is the field (for a list, the field holding it) and whose message
    says what is wrong with it."""
    assert r.status_code == 400, r.text
    r.content.decode("utf-8")  # the body itself is valid UTF-8
    error = error_of(r)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert param in error["message"]
    assert "invalid Unicode" in error["message"] or "unicode" in error["message"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("field", "value", "param"), COMPLETION_FIELDS)
def test_lone_surrogate_in_a_completion_field_is_a_400_naming_it(
    server: LiveServer, field, value, param, stream
):
    body = with_surrogate({**OK, "stream": stream}, field, value)
    assert_names_bad_unicode(post_raw(server, "/v1/completions", body), param)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("field", "value", "param"), CHAT_FIELDS)
def test_lone_surrogate_in_a_chat_field_is_a_400_naming_it(
    server: LiveServer, field, value, param, stream
):
    body = with_surrogate({**CHAT_OK, "stream": stream}, field, value)
    assert_names_bad_unicode(post_raw(server, "/v1/chat/completions", body), param)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"prompt": SURROGATE}, "prompt"),
        ("/tokenize", {"prompt": "x", "model": SURROGATE}, "model"),
        ("/tokenize", {"messages": [{"role": "user", "content": SURROGATE}]}, "messages.0.content"),
        ("/detokenize", {"tokens": [65], "model": SURROGATE}, "model"),
    ],
)
def test_lone_surrogate_in_tokenize_fields_is_a_400_naming_it(
    server: LiveServer, path, body, param
):
    assert_names_bad_unicode(post_raw(server, path, body), param)


def test_error_bodies_echoing_client_text_are_always_encodable(server: LiveServer):
    # A bad path segment and an unknown-field-free 404: echoed text never breaks the body.
    r = httpx.get(server.url("/v1/models/%ED%A0%80x"), timeout=10)
    assert r.status_code == 404 and error_of(r)["code"] == "model_not_found"
    # A dict key with a surrogate that also has a bad value: both errors reported, body valid.
    r = post_raw(server, "/v1/completions", {**OK, "logit_bias": {SURROGATE: "x"}})
    assert r.status_code == 400
    r.content.decode("utf-8")
    assert error_of(r)["param"] == "logit_bias"
    # Surrogates in ignored (unknown) fields reach nothing and are ignored.
    assert (
        post_raw(server, "/v1/completions", {**OK, "x_" + SURROGATE: SURROGATE}).status_code == 200
    )


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"stream": "yes"}, "stream"),
        ({"stream": 1}, "stream"),
        ({"echo": "true"}, "echo"),
        ({"ignore_eos": 0}, "ignore_eos"),
        ({"max_tokens": "5"}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"n": "2"}, "n"),
        ({"seed": "7"}, "seed"),
        ({"logprobs": False}, "logprobs"),
        ({"temperature": "0.5"}, "temperature"),
        ({"top_p": True}, "top_p"),
        ({"prompt": [65, "66"]}, "prompt"),
        ({"best_of": 0}, "best_of"),
        ({"best_of": 2}, "best_of"),
        ({"best_of": 2, "n": 2}, "best_of"),
        ({"repetition_penalty": 1e-300}, "repetition_penalty"),
        ({"repetition_penalty": 1e300}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"top_k": -2}, "top_k"),
        ({"n": MAX_N + 1}, "n"),
        ({"stop": ["s"] * (MAX_STOP_STRINGS + 1)}, "stop"),
    ],
)
def test_loose_types_and_out_of_range_values_are_400(server: LiveServer, change, param):
    r = httpx.post(server.url("/v1/completions"), json={**OK, **change}, timeout=30)
    assert r.status_code == 400, r.text
    assert error_of(r)["param"] == param


def test_chat_strict_types(server: LiveServer):
    for change, param in (
        ({"logprobs": "yes"}, "logprobs"),
        ({"max_completion_tokens": "3"}, "max_completion_tokens"),
        ({"stream": "false"}, "stream"),
    ):
        r = httpx.post(server.url("/v1/chat/completions"), json={**CHAT_OK, **change}, timeout=30)
        assert r.status_code == 400, r.text
        assert error_of(r)["param"] == param


def test_integral_floats_are_integers_and_best_of_1_gives_n_choices(server: LiveServer):
    # JSON has one number type; JSON Schema (and so the OpenAPI document) calls 2.0 an integer.
    r = httpx.post(server.url("/v1/completions"), json={**OK, "max_tokens": 2.0, "n": 2.0})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2
    # vLLM V1's rule: best_of is null or 1, whatever n (LangChain sends best_of 1 with any n).
    r = httpx.post(server.url("/v1/completions"), json={**OK, "n": 3, "best_of": 1}, timeout=30)
    assert r.status_code == 200 and len(r.json()["choices"]) == 3


@pytest.mark.parametrize("temperature", [1e-38, 1e-300, 5e-324, 9e-6])
def test_a_temperature_below_1e5_is_greedy(server: LiveServer, temperature):
    body = {**OK, "prompt": "The cat", "max_tokens": 8, "ignore_eos": True}
    greedy = httpx.post(server.url("/v1/completions"), json={**body, "temperature": 0}, timeout=30)
    tiny = httpx.post(
        server.url("/v1/completions"), json={**body, "temperature": temperature}, timeout=30
    )
    assert tiny.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


def test_openapi_says_400_with_the_error_schema_and_the_limits(server: LiveServer):
    doc = httpx.get(server.url("/openapi.json"), timeout=10).json()
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    assert "ErrorResponse" in doc["components"]["schemas"]
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        responses = doc["paths"][path]["post"]["responses"]
        assert "422" not in responses
        assert responses["400"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorResponse"
        }
    completion = doc["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]
    assert set(completion) == {"application/json", "text/event-stream"}
    props = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert props["n"]["maximum"] == MAX_N
    max_tokens = next(m for m in props["max_tokens"]["anyOf"] if m.get("type") == "integer")
    assert max_tokens["maximum"] == server.client.max_model_len
    assert props["presence_penalty"]["anyOf"][0]["maximum"] == 2
    # A schema-invalid body really is a 400 (what the document now says), not a 422.
    assert httpx.post(server.url("/v1/completions"), json={"n": 1}, timeout=10).status_code == 400


# -- the document's rules: a body is schema-valid exactly when the server takes it ------------


def request_validator(doc: dict, name: str) -> jsonschema.Draft202012Validator:
    """A validator for components/schemas/`name` of the served document ($refs resolved)."""
    schema = {**doc["components"]["schemas"][name], "components": doc["components"]}
    return jsonschema.Draft202012Validator(schema)


DOCUMENT_RULES = [
    # (route, schema, body changes, accepted?, param of the 400)
    ("/v1/completions", "CompletionRequest", {"logit_bias": {"65": 100}}, True, None),
    ("/v1/completions", "CompletionRequest", {"logit_bias": {"65": 100.5}}, False, "logit_bias"),
    ("/v1/completions", "CompletionRequest", {"logit_bias": {"065": 1}}, False, "logit_bias"),
    ("/v1/completions", "CompletionRequest", {"logit_bias": {"+65": 1}}, False, "logit_bias"),
    ("/v1/completions", "CompletionRequest", {"logit_bias": {"99999": 1}}, False, "logit_bias"),
    (
        "/v1/chat/completions",
        "ChatCompletionRequest",
        {"response_format": {"type": "json_schema"}},
        False,
        "response_format",
    ),
    (
        "/v1/chat/completions",
        "ChatCompletionRequest",
        {"response_format": {"type": "text"}},
        True,
        None,
    ),
    ("/v1/completions", "CompletionRequest", {"stream_options": {}}, False, "stream_options"),
    ("/v1/completions", "CompletionRequest", {"stream_options": None}, True, None),
    ("/v1/completions", "CompletionRequest", {"stream": True, "stream_options": {}}, True, None),
    ("/v1/completions", "CompletionRequest", {"echo": True, "logprobs": 1}, True, None),
    ("/v1/completions", "CompletionRequest", {"max_tokens": 0}, False, "max_tokens"),
    ("/v1/completions", "CompletionRequest", {"max_tokens": 0, "echo": True}, True, None),
    ("/v1/completions", "CompletionRequest", {"echo": False, "logprobs": 1}, True, None),
    ("/v1/chat/completions", "ChatCompletionRequest", {"top_logprobs": 2}, False, "top_logprobs"),
    ("/v1/chat/completions", "ChatCompletionRequest", {"top_logprobs": None}, True, None),
    (
        "/v1/chat/completions",
        "ChatCompletionRequest",
        {"top_logprobs": 2, "logprobs": True},
        True,
        None,
    ),
    (
        "/v1/chat/completions",
        "ChatCompletionRequest",
        {"stream_options": {"include_usage": True}, "stream": False},
        False,
        "stream_options",
    ),
]


@pytest.mark.parametrize(("path", "name", "change", "accepted", "param"), DOCUMENT_RULES)
def test_the_document_accepts_a_body_exactly_when_the_server_does(
    server: LiveServer, path, name, change, accepted, param
):
    doc = httpx.get(server.url("/openapi.json"), timeout=10).json()
    body = {**(OK if name == "CompletionRequest" else CHAT_OK), **change}
    assert request_validator(doc, name).is_valid(body) is accepted
    r = httpx.post(server.url(path), json=body, timeout=30)
    if accepted:
        assert r.status_code == 200, r.text
    else:
        assert r.status_code == 400, r.text
        assert param in (error_of(r)["param"] or "") or param in error_of(r)["message"]


def test_best_of_above_1_is_out_of_the_document_and_refused(server: LiveServer):
    doc = httpx.get(server.url("/openapi.json"), timeout=10).json()
    validator = request_validator(doc, "CompletionRequest")
    assert validator.is_valid({**OK, "n": 3, "best_of": 1})
    assert not validator.is_valid({**OK, "n": 2, "best_of": 2})
    r = httpx.post(server.url("/v1/completions"), json={**OK, "n": 2, "best_of": 3}, timeout=30)
    assert r.status_code == 400
    err = error_of(r)
    assert err["param"] == "best_of" and "use n" in err["message"]


def test_rules_no_schema_can_state_are_400s_with_a_documented_code(server: LiveServer):
    """The rules JSON Schema cannot state name themselves in `code`, and the document lists
    those codes on the generation routes' 400 (tools/fuzz_openapi_hooks.py relies on it)."""
    doc = httpx.get(server.url("/openapi.json"), timeout=10).json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        listed = doc["paths"][path]["post"]["responses"]["400"]["x-unstated-rule-codes"]
        assert set(listed) == set(UNSTATED_RULE_CODES)
    limit = server.client.max_model_len
    cases = [
        ("/v1/completions", {**OK, "min_tokens": 3}, "min_tokens", "min_tokens_exceeds_max_tokens"),
        # chat without max_tokens: the bound is what the context leaves after the prompt
        (
            "/v1/chat/completions",
            {**CHAT_OK, "max_tokens": None, "min_tokens": limit},
            "min_tokens",
            "min_tokens_exceeds_max_tokens",
        ),
        (
            "/v1/completions",
            {**OK, "prompt": "x" * limit, "max_tokens": 1},
            "max_tokens",
            "context_length_exceeded",
        ),
        (
            "/v1/completions",
            {**OK, "prompt": ["a"] * 5, "n": MAX_N},
            "n",
            "too_many_choices",
        ),
        (
            "/v1/chat/completions",
            {**CHAT_OK, "guided_grammar": "this is not a grammar ::= ("},
            "guided_grammar",
            "invalid_structured_output",
        ),
        (
            "/v1/completions",
            {**OK, "guided_regex": "a+", "guided_choice": ["a"]},
            "guided_choice",
            "invalid_structured_output",
        ),
    ]
    for path, body, param, code in cases:
        r = httpx.post(server.url(path), json=body, timeout=30)
        assert r.status_code == 400, (body, r.text)
        err = error_of(r)
        assert (err["param"], err["code"]) == (param, code), (body, err)
    # min_tokens == max_tokens is fine.
    r = httpx.post(server.url("/v1/completions"), json={**OK, "min_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text


def test_seeds_are_bounded_where_float64_comparisons_are_exact(server: LiveServer):
    # A validator comparing JSON numbers as float64 (jsonschema-rs, JavaScript) rounds integers
    # above 2**53: a bound up there would let a seed just over it pass the document and fail
    # here. I-JSON's range (|n| <= 2**53 - 1) compares exactly everywhere.
    doc = httpx.get(server.url("/openapi.json"), timeout=10).json()
    seed = doc["components"]["schemas"]["CompletionRequest"]["properties"]["seed"]
    member = next(m for m in seed["anyOf"] if m.get("type") == "integer")
    assert member["maximum"] == MAX_SEED == 2**53 - 1 and member["minimum"] == -MAX_SEED
    for value in (float(MAX_SEED - 1), MAX_SEED, -MAX_SEED):
        r = httpx.post(server.url("/v1/completions"), json={**OK, "seed": value}, timeout=30)
        assert r.status_code == 200, r.text
    for value in (MAX_SEED + 1, -MAX_SEED - 1):
        r = httpx.post(server.url("/v1/completions"), json={**OK, "seed": value}, timeout=30)
        assert r.status_code == 400 and error_of(r)["param"] == "seed"


def test_each_chat_length_field_is_bounded_by_the_context(server: LiveServer):
    # The schema gives max_tokens and max_completion_tokens each a maximum of the context length;
    # one above it is a 400 even when the other is the one that counts.
    limit = server.client.max_model_len
    body = {**CHAT_OK, "max_completion_tokens": 2, "max_tokens": limit + 1}
    r = httpx.post(server.url("/v1/chat/completions"), json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert error_of(r)["param"] == "max_tokens"
