"""Property-based fuzzing of the request models (hypothesis): random JSON-ish bodies for
/v1/completions, /v1/chat/completions, /v1/embeddings and /tokenize, mixing plausible and hostile values (wrong
types, NaN, huge integers, lone surrogates, unknown fields, non-JSON bytes), never get a 5xx and
always get an OpenAI-shaped body: an error object for a 4xx, choices (or an SSE stream ending in
`[DONE]`) for a 200.

The app runs in process through FastAPI's TestClient over a real TinyGPT engine whose context is
short (64 tokens), so the accepted requests generate a few tokens and the whole run takes
seconds. Derandomized: CI runs the same examples every time; set HYPOTHESIS_SEED=random (or
raise FUZZ_EXAMPLES) to explore locally.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import make_engine
from server.engine_client.driver import AsyncEngineDriver
from server.http.app import create_app
from server.openai.protocol import ModelCard

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "60"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=os.environ.get("HYPOTHESIS_SEED") != "random",
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

# Text with the awkward cases: lone surrogates, NUL, non-BMP, control characters.
text = st.text(st.characters(codec=None), max_size=12) | st.sampled_from(
    ["", "\ud800", "a\udfffb", "\x00", "😀", "Hi", "tinygpt"]
)
numbers = (
    st.integers(-3, 40)
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([0, 1, 1e-38, 1e-300, 2.0, -0.0, 1e308])
)
scalars = st.none() | st.booleans() | numbers | text
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=8,
)
token_ids = st.lists(st.integers(-2, 300), max_size=5)


# A function tool whose arguments are short: TinyGPT fills them within a few tokens.
TOOL = {
    "type": "function",
    "function": {
        "name": "f",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
    },
}
NAMED = {"type": "function", "function": {"name": "f"}}

# Values a well-behaved client sends: most bodies built from these alone are accepted (200).
words = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=8)
valid_ids = st.lists(st.integers(0, 259), min_size=1, max_size=5)  # TinyGPT's vocabulary: 260
VALID_COMMON = {
    "model": st.sampled_from(["tinygpt", None]),
    "n": st.integers(1, 3),
    "temperature": st.floats(0, 2) | st.sampled_from([0, 1e-38, 1e-6]),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1),
    "stop": words | st.lists(words, max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 259), max_size=3),
    "seed": st.integers(0, 2**40),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "logit_bias": st.dictionaries(st.integers(0, 259).map(str), st.floats(-100, 100), max_size=2),
    "ignore_eos": st.booleans(),
    "user": words,
    "stream": st.booleans(),
    "max_tokens": st.integers(1, 6),
}
VALID_COMPLETION = {
    **VALID_COMMON,
    "prompt": words | st.lists(words, min_size=1, max_size=3) | valid_ids,
    "echo": st.booleans(),
    "logprobs": st.integers(0, 5),
    "prompt_logprobs": st.integers(0, 5),
}
VALID_CHAT = {
    **VALID_COMMON,
    "messages": st.lists(
        st.fixed_dictionaries(
            {"role": st.just("user"), "content": words | st.just([{"type": "text", "text": "x"}])}
        ),
        min_size=1,
        max_size=2,
    ),
    "max_completion_tokens": st.integers(1, 6),
    "tools": st.just([TOOL]),
    "tool_choice": st.sampled_from(["none", "auto", "required", NAMED]),
    "parallel_tool_calls": st.booleans(),
}
VALID_RESPONSES = {
    "model": VALID_COMMON["model"],
    "input": words
    | st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": words}), min_size=1),
    "instructions": words,
    "max_output_tokens": st.integers(1, 6),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "stream": st.booleans(),
    "tools": st.just([{"type": "function", **TOOL["function"]}]),
    "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function", "name": "f"}]),
}
VALID_TOKENIZE = {"model": VALID_COMMON["model"], "prompt": words}
VALID_EMBEDDING = {
    "model": VALID_COMMON["model"],
    "input": words | st.lists(words, min_size=1, max_size=4) | valid_ids,
    "encoding_format": st.sampled_from(["float", "base64"]),
    "user": words,
}


def field(plausible: st.SearchStrategy) -> st.SearchStrategy:
    return plausible | json_values


# The same fields with hostile values mixed in (wrong types, NaN, surrogates, huge numbers).
COMMON = {
    "model": field(st.sampled_from(["tinygpt", "gpt-4"]) | text),
    "n": field(st.integers(-1, 20)),
    "temperature": field(numbers),
    "top_p": field(numbers),
    "top_k": field(st.integers(-3, 300)),
    "min_p": field(numbers),
    "stop": field(text | st.lists(text, max_size=3)),
    "stop_token_ids": field(token_ids),
    "seed": field(st.integers(-(2**64), 2**64)),
    "presence_penalty": field(numbers),
    "frequency_penalty": field(numbers),
    "repetition_penalty": field(numbers),
    "logit_bias": field(st.dictionaries(st.integers(-2, 300).map(str) | text, numbers, max_size=3)),
    "ignore_eos": field(st.booleans()),
    "min_tokens": field(st.integers(-1, 8)),
    "user": field(text),
    "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({}, optional={"include_usage": st.booleans()})),
    "max_tokens": field(st.integers(-1, 80)),
}
COMPLETION = {
    **COMMON,
    "prompt": field(
        text | st.lists(text, max_size=3) | token_ids | st.lists(token_ids, max_size=3)
    ),
    "echo": field(st.booleans()),
    "logprobs": field(st.integers(-1, 25)),
    "prompt_logprobs": field(st.integers(-1, 25)),
    "best_of": field(st.integers(-1, 4)),
    "suffix": field(text),
}
part = st.fixed_dictionaries(
    {}, optional={"type": field(st.sampled_from(["text", "image_url"])), "text": field(text)}
)
message = st.fixed_dictionaries(
    {},
    optional={
        "role": field(st.sampled_from(["user", "system", "assistant"])),
        "content": field(text | st.lists(part, max_size=2)),
        "name": field(text),
    },
)
CHAT = {
    **COMMON,
    "messages": field(st.lists(message, max_size=3)),
    "max_completion_tokens": field(st.integers(-1, 80)),
    "logprobs": field(st.booleans()),
    "top_logprobs": field(st.integers(-1, 25)),
    "tools": field(st.lists(json_values, max_size=1) | st.just([TOOL])),
    "tool_choice": field(st.sampled_from(["none", "auto", "required", NAMED]) | text),
    "parallel_tool_calls": field(st.booleans()),
    "chat_template_kwargs": field(st.dictionaries(text, json_values, max_size=2)),
}
item = st.fixed_dictionaries(
    {},
    optional={
        "type": field(st.sampled_from(["message", "function_call", "function_call_output"])),
        "role": field(st.sampled_from(["user", "assistant", "developer"])),
        "content": field(text),
        "call_id": field(text),
        "name": field(st.just("f") | text),
        "arguments": field(st.just("{}") | text),
        "output": field(text),
    },
)
RESPONSES = {
    "model": COMMON["model"],
    "input": field(text | st.lists(item, max_size=3)),
    "instructions": field(text),
    "max_output_tokens": field(st.integers(-1, 80)),
    "temperature": field(numbers),
    "top_p": field(numbers),
    "stream": field(st.booleans()),
    "store": field(st.booleans()),
    "previous_response_id": field(text),
    "tools": field(st.lists(json_values, max_size=1)),
    "tool_choice": field(text),
    "text": field(st.fixed_dictionaries({"format": json_values})),
}
TOKENIZE = {
    "model": COMMON["model"],
    "prompt": field(text),
    "messages": CHAT["messages"],
    "add_special_tokens": field(st.booleans()),
}
EMBEDDING = {
    "model": COMMON["model"],
    "input": COMPLETION["prompt"],
    "encoding_format": field(st.sampled_from(["float", "base64", "int8"])),
    "dimensions": field(st.integers(-1, 300)),
    "user": field(text),
}


def bodies(
    valid: dict[str, st.SearchStrategy], required: str, hostile: dict[str, st.SearchStrategy]
) -> st.SearchStrategy[bytes]:
    """Encoded request bodies: a valid one; a valid one with one field replaced by any JSON
    value; any subset of the fields with plausible or hostile values plus unknown fields; any
    JSON value; bytes that are not JSON at all."""
    good = st.fixed_dictionaries(
        {required: valid[required]}, optional={k: v for k, v in valid.items() if k != required}
    )
    one_bad = st.tuples(good, st.sampled_from(sorted(valid)), json_values).map(
        lambda t: {**t[0], t[1]: t[2]}
    )
    wild = st.fixed_dictionaries({}, optional=hostile).flatmap(
        lambda d: st.dictionaries(text, json_values, max_size=2).map(lambda extra: {**extra, **d})
    )
    # json.dumps escapes lone surrogates as \udXXX (valid JSON) and writes NaN as NaN (which
    # Python's parser accepts): both reach the server as a client could send them.
    as_json = (good | one_bad | wild | json_values).map(lambda v: json.dumps(v).encode())
    return as_json | st.binary(max_size=30)


@pytest.fixture(scope="module")
def client(tiny_lm) -> Iterator[TestClient]:
    engine = make_engine(
        "continuous", tiny_lm.model, max_batch_size=8, kv_cache_memory_gib=0.02, max_model_len=64
    )
    driver = AsyncEngineDriver(engine, num_threads=1)
    card = ModelCard(
        names=("tinygpt",),
        max_model_len=driver.max_model_len,
        parameter_count=tiny_lm.num_parameters(),
        engine=driver.engine_name,
    )
    app = create_app(tiny_lm.tokenizer, card, driver)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def check_response(path: str, body: bytes, r) -> None:
    assert r.status_code < 500, f"{path} {body!r} -> {r.status_code} {r.text[:500]}"
    if r.status_code >= 400:
        error = r.json()["error"]  # OpenAI's error object, always JSON
        assert isinstance(error["message"], str) and error["message"]
        assert isinstance(error["type"], str)
        assert error["param"] is None or isinstance(error["param"], str)
        assert error["code"] is None or isinstance(error["code"], str)
        return
    assert r.status_code == 200, r.text[:500]
    if path == "/v1/responses":
        if r.headers["content-type"].startswith("text/event-stream"):
            events = [e for e in r.text.split("\n\n") if e]
            kinds = [json.loads(e.split("data: ", 1)[1])["type"] for e in events]
            assert kinds[0] == "response.created", kinds
            assert kinds[-1] in ("response.completed", "response.incomplete", "error"), kinds
        else:
            assert r.json()["object"] == "response"
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [e for e in r.text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]", r.text[-500:]
        for e in events[:-1]:
            assert e.startswith("data: ")
            chunk = json.loads(e.removeprefix("data: "))
            assert "choices" in chunk or "error" in chunk, chunk
    elif path == "/tokenize":
        assert isinstance(r.json()["tokens"], list)
    elif path == "/v1/embeddings":
        assert isinstance(r.json()["data"], list) and r.json()["data"]
    else:
        assert isinstance(r.json()["choices"], list) and r.json()["choices"]


def post(client: TestClient, path: str, body: bytes):
    return client.post(path, content=body, headers={"content-type": "application/json"})


@FUZZ
@given(body=bodies(VALID_COMPLETION, "prompt", COMPLETION))
def test_fuzzed_completions_never_5xx(client, body):
    check_response("/v1/completions", body, post(client, "/v1/completions", body))


@FUZZ
@given(body=bodies(VALID_CHAT, "messages", CHAT))
def test_fuzzed_chat_completions_never_5xx(client, body):
    check_response("/v1/chat/completions", body, post(client, "/v1/chat/completions", body))


@FUZZ
@given(body=bodies(VALID_TOKENIZE, "prompt", TOKENIZE))
def test_fuzzed_tokenize_never_5xx(client, body):
    check_response("/tokenize", body, post(client, "/tokenize", body))


@FUZZ
@given(body=bodies(VALID_RESPONSES, "input", RESPONSES))
def test_fuzzed_responses_never_5xx(client, body):
    check_response("/v1/responses", body, post(client, "/v1/responses", body))


@FUZZ
@given(body=bodies(VALID_EMBEDDING, "input", EMBEDDING))
def test_fuzzed_embeddings_never_5xx(client, body):
    check_response("/v1/embeddings", body, post(client, "/v1/embeddings", body))
