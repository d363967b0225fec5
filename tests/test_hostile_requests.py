"""Requests that would crash or exhaust a server without its limits, against a real one (TinyGPT
on loopback): each is a clear OpenAI-shaped 4xx (or an error event once a stream has begun),
never a dead process, a 5xx, a cut connection or runaway memory, and the server serves the next
request.

- Grammars: a $ref chain through thousands of definitions (a stack overflow in llguidance's
  native code), the same chain as a tool's parameters, a Lark grammar of chained rules, an allOf
  of regex intersections that grows without bound, a grammar no text can match, a dead end
  reached mid-generation, a choice list whose compile panics in the library.
- /v1/responses: lone surrogates and NaN anywhere in a body, tools checked under every
  tool_choice, a failure after the stream began.
- Big bodies: refused by their size before they are tokenized; tokenizing happens off the
  event loop.
- Amplification: prompt logprobs x n x length, embeddings inputs x length, over the response
  budget.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import httpx
import pytest

from engine.grammar import client_message
from server.grammars.check_worker import CheckBudget
from server.http.app import ServerSettings
from tests.helpers.servers import FailingStep, LiveServer, error_of, run_server, sse_events

# A short check budget keeps the runaway cases quick; the response budget is small so that
# TinyGPT's 2048-token context can exceed it.
BUDGET = CheckBudget(seconds=2.0, memory_mib=512)
SETTINGS = ServerSettings(grammar_budget=BUDGET, response_budget=50_000)
CHAT = "/v1/chat/completions"
ASK = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def live(tiny_lm) -> Iterator[LiveServer]:
    with run_server(tiny_lm, settings=SETTINGS) as server:
        yield server


def post(live: LiveServer, path: str, body: dict, timeout: float = 60) -> httpx.Response:
    # allow_nan: the hostile bodies carry NaN, which Python's JSON writes and the server reads
    data = json.dumps(body, allow_nan=True).encode()
    headers = {"Content-Type": "application/json"}
    return httpx.post(live.url(path), content=data, headers=headers, timeout=timeout)


def still_serves(live: LiveServer) -> None:
    assert httpx.get(live.url("/health"), timeout=10).status_code == 200
    r = post(live, CHAT, {"messages": ASK, "max_tokens": 2})
    assert r.status_code == 200, r.text


def worker(live: LiveServer):
    return live.app.state.serving.structured.worker


def worker_children(live: LiveServer) -> list[int]:
    proc = worker(live)._proc
    if proc is None:
        return []
    try:
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except FileNotFoundError:
        return []


def ref_chain(n: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


RUNAWAY = {"type": "string", "allOf": [{"pattern": f"^(.*a.*){{{i}}}$"} for i in range(1, 30)]}


# -- grammars ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        (
            "response_format",
            {"type": "json_schema", "json_schema": {"name": "x", "schema": ref_chain(3000)}},
            "response_format",
        ),
        (
            "guided_grammar",
            "start: r0\n" + "\n".join(f"r{i}: r{i + 1}" for i in range(3000)) + '\nr3000: "x"',
            "guided_grammar",
        ),
    ],
)
def test_a_grammar_that_overflows_the_compiler_s_stack_is_a_400_and_the_server_lives(
    live, field, value, param
):
    r = post(live, CHAT, {"messages": ASK, "max_tokens": 4, field: value})
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert (err["param"], err["code"]) == (param, "invalid_structured_output")
    assert "nests or chains too deeply" in err["message"]
    still_serves(live)


@pytest.mark.parametrize("tool_choice", ["auto", "none", "required"])
def test_a_tool_whose_parameters_overflow_the_compiler_is_a_400_under_every_tool_choice(
    live, tool_choice
):
    chain = ref_chain(3000)
    params = {
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/d0"}},
        "$defs": chain["$defs"],
    }
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    body = {"messages": ASK, "max_tokens": 4, "tools": tools, "tool_choice": tool_choice}
    r = post(live, CHAT, body)
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert (err["param"], err["code"]) == ("tools[0].function.parameters", "invalid_tools")
    still_serves(live)


def deeply_nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
    return schema


@pytest.mark.parametrize("tool_choice", ["required", "none"])
def test_a_schema_nested_too_deeply_to_walk_is_a_400_as_a_tool_and_as_a_format(live, tool_choice):
    # 400 levels of objects: 800 of JSON, within what the body parser takes.
    params = deeply_nested(400)
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    r = post(live, CHAT, {"messages": ASK, "tools": tools, "tool_choice": tool_choice})
    assert r.status_code == 400, r.text
    assert error_of(r)["param"] == "tools[0].function.parameters"
    assert "nests too deeply" in error_of(r)["message"]
    r = post(live, CHAT, {"messages": ASK, "guided_json": params})
    assert r.status_code == 400 and "nests too deeply" in error_of(r)["message"]


def test_a_grammar_whose_compile_runs_away_is_a_400_at_its_budget_and_its_check_is_gone(live):
    r = post(live, CHAT, {"messages": ASK, "max_tokens": 4, "guided_json": RUNAWAY})
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["param"] == "guided_json" and err["code"] == "invalid_structured_output"
    assert f"limit of {BUDGET.seconds:g} s" in err["message"]
    assert worker_children(live) == []  # the check's process was killed, not left running
    # The verdict is kept: the same schema again is refused without a second check.
    checks = worker(live).checks
    again = post(live, CHAT, {"messages": ASK, "max_tokens": 4, "guided_json": RUNAWAY})
    assert again.status_code == 400 and error_of(again)["message"] == err["message"]
    assert worker(live).checks == checks
    still_serves(live)


def wait_until(condition, seconds: float) -> bool:
    """Poll `condition` until it holds or `seconds` pass (a process's children have no event)."""
    gate = threading.Event()
    for _ in range(int(seconds / 0.01)):
        if condition():
            return True
        gate.wait(0.01)
    return condition()


def test_a_check_is_cancelled_when_its_client_goes_away(live):
    schema = {**RUNAWAY, "allOf": [{"pattern": f"^(.*b.*){{{i}}}$"} for i in range(1, 30)]}
    outcome: list[BaseException] = []

    def give_up_after_a_second() -> None:
        try:
            post(live, CHAT, {"messages": ASK, "guided_json": schema}, timeout=1.0)
        except httpx.ReadTimeout as e:
            outcome.append(e)

    client = threading.Thread(target=give_up_after_a_second)
    client.start()
    assert wait_until(lambda: worker_children(live) != [], 1.0)  # its check is running
    client.join(10)
    assert outcome  # the client went away while the check ran
    # The server notices and kills the check well before its 2 s budget would.
    assert wait_until(lambda: worker_children(live) == [], 0.5)
    still_serves(live)


def test_a_killed_check_worker_is_started_again(live):
    old = worker(live)._proc
    old.kill()
    old.wait(10)
    r = post(live, CHAT, {"messages": ASK, "max_tokens": 4, "guided_regex": "[a-c]{1,3}x"})
    assert r.status_code == 200, r.text
    assert worker(live)._proc is not old


def test_a_grammar_no_text_can_match_is_a_400(live):
    r = post(live, CHAT, {"messages": ASK, "max_tokens": 4, "guided_grammar": "start: a\na: a"})
    assert r.status_code == 400, r.text
    assert "no text can match it" in error_of(r)["message"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("guided_grammar", 'start: "b" start'),  # "b", then it can only expand into itself
        (
            "guided_json",  # every object must hold another: no finite instance
            {"type": "object", "properties": {"c": {"$ref": "#"}}, "required": ["c"]},
        ),
    ],
)
def test_a_grammar_that_only_expands_into_itself_is_a_400_not_a_runaway(live, field, value):
    r = post(live, CHAT, {"messages": ASK, "max_tokens": 8, field: value})
    assert r.status_code == 400, r.text
    assert "only ever expands into itself" in error_of(r)["message"]
    still_serves(live)


DEAD_END = 'start: "x" b\nb: b "y"'  # "x" is allowed, then nothing can complete it


def test_a_dead_end_mid_generation_is_an_error_not_stop(live):
    body = {"messages": ASK, "max_tokens": 8, "guided_grammar": DEAD_END}
    r = post(live, CHAT, body)
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert (err["param"], err["code"]) == ("guided_grammar", "invalid_structured_output")
    assert "choice 0" in err["message"] and "no further output" in err["message"]

    r = post(live, CHAT, {**body, "stream": True})
    assert r.status_code == 200  # the stream had begun: the error arrives in it
    payloads = sse_events(r.text)
    assert payloads[-1] == "[DONE]"
    error = json.loads(payloads[-2])["error"]
    assert error["code"] == "invalid_structured_output" and "no further output" in error["message"]
    assert not any('"finish_reason":"stop"' in p for p in payloads)
    still_serves(live)


def test_library_panics_and_backtraces_never_reach_a_client(live):
    panic = (
        "panic: assertion failed: grammar.symbols.len() < u16::MAX as usize - 10 <backtrace> "
        "0: <unknown> 1: <unknown> 16: type_call at /tmp/python-build/Python-3.11/Objects/x.c"
    )
    assert client_message(panic) == "the grammar library could not process it"
    choices = [f"choice number {i}" for i in range(100_000)]
    r = post(live, CHAT, {"messages": ASK, "max_tokens": 4, "guided_choice": choices})
    assert r.status_code == 400, r.text
    message = error_of(r)["message"]
    assert not any(w in message for w in ("panic", "backtrace", ".rs:", "<unknown>")), message
    still_serves(live)


def test_tool_parameters_with_a_recursive_root_ref_call_themselves_not_the_wrapper(live):
    params = {
        "type": "object",
        "properties": {
            "v": {"type": "integer", "minimum": 0, "maximum": 9},
            "child": {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
        },
        "required": ["v", "child"],
    }
    tools = [{"type": "function", "function": {"name": "tree", "parameters": params}}]
    body = {"messages": ASK, "max_tokens": 200, "tools": tools, "tool_choice": "required"}
    r = post(live, CHAT, {**body, "temperature": 0})
    assert r.status_code == 200, r.text
    call = r.json()["choices"][0]["message"]["tool_calls"][0]["function"]
    import jsonschema

    jsonschema.validate(json.loads(call["arguments"]), params)  # "#" is the parameters' root


# -- /v1/responses and chat: every field checked ------------------------------------------------------

BOGUS_TOOL = {"type": "function", "name": "f", "parameters": {"type": "bogus"}}


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"metadata": {"\ud800": "x"}}, "metadata"),
        ({"metadata": {"k": "\ud800"}}, "metadata.k"),
        (
            {"tool_choice": "none", "tools": [{**BOGUS_TOOL, "parameters": {"a": float("nan")}}]},
            "tools.0.parameters",
        ),
        (
            {
                "tool_choice": "none",
                "tools": [{**BOGUS_TOOL, "parameters": {"properties": {"\udfff": {}}}}],
            },
            "tools.0.parameters",
        ),
        ({"tool_choice": "none", "tools": [BOGUS_TOOL]}, "tools[0].function.parameters"),
        (
            {"text": {"format": {"type": "json_schema", "schema": {"maximum": float("inf")}}}},
            "text.format.schema",
        ),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_responses_fields_are_checked_as_chat_s_are(live, change, param, stream):
    r = post(
        live, "/v1/responses", {"input": "Hi", "max_output_tokens": 2, "stream": stream, **change}
    )
    assert r.status_code == 400, r.text
    assert error_of(r)["param"] == param


def test_chat_checks_tools_under_tool_choice_none(live):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}]
    r = post(live, CHAT, {"messages": ASK, "tools": tools, "tool_choice": "none"})
    assert r.status_code == 400 and error_of(r)["code"] == "invalid_tools"


def test_a_responses_stream_that_fails_after_it_began_ends_with_response_failed(tiny_lm):
    with run_server(tiny_lm) as server:
        FailingStep(server.engine, fail_at=4)
        body = {"input": "Hi", "max_output_tokens": 50, "stream": True}
        with httpx.Client(timeout=30) as client:
            r = client.post(server.url("/v1/responses"), json=body)  # reads the whole body
        assert r.status_code == 200
        assert r.text.endswith("\n\n")  # a complete last event: the body was not cut
        events = [e for e in r.text.split("\n\n") if e]
        kinds = [e.split("\n", 1)[0].removeprefix("event: ") for e in events]
        assert kinds[0] == "response.created" and kinds[-2:] == ["error", "response.failed"]
        assert "response.output_text.delta" in kinds  # it failed after output had begun
        failed = json.loads(events[-1].split("data: ", 1)[1])["response"]
        assert failed["status"] == "failed"
        assert failed["error"]["code"] == "engine_unavailable"
        numbers = [json.loads(e.split("data: ", 1)[1])["sequence_number"] for e in events]
        assert numbers == list(range(len(events)))


# -- big bodies ---------------------------------------------------------------------------------------


def test_a_body_too_big_for_the_context_is_a_400_before_it_is_tokenized(live):
    serving = live.app.state.serving
    calls: list[int] = []
    encode = serving.prompts.encode_now
    serving.prompts.encode_now = lambda text, special: (
        calls.append(len(text)) or encode(text, special)
    )
    try:
        big = "word " * 760_000  # 3.8 MB
        for path, body, param in [
            (CHAT, {"messages": [{"role": "user", "content": big}]}, "messages"),
            ("/v1/completions", {"prompt": big}, "prompt"),
            ("/tokenize", {"prompt": big}, "prompt"),
            ("/v1/embeddings", {"input": [big]}, "input"),
        ]:
            r = post(live, path, body)
            assert r.status_code == 400, r.text
            err = error_of(r)
            assert (err["param"], err["code"]) == (param, "context_length_exceeded")
        assert calls == []  # nothing that large reached the tokenizer
    finally:
        serving.prompts.encode_now = encode


def test_health_answers_while_a_prompt_is_being_tokenized(live):
    """Tokenizing runs in the tokenizer's threads: with one held mid-way, the loop still answers."""
    serving = live.app.state.serving
    entered, release = threading.Event(), threading.Event()
    encode = serving.prompts.encode_now

    def held(text: str, special: bool) -> list[int]:
        entered.set()
        release.wait(30)
        return encode(text, special)

    serving.prompts.encode_now = held
    result: list[httpx.Response] = []
    t = threading.Thread(
        target=lambda: result.append(post(live, CHAT, {"messages": ASK, "max_tokens": 2}))
    )
    try:
        t.start()
        assert entered.wait(30)
        assert httpx.get(live.url("/health"), timeout=5).status_code == 200
        assert not result  # the chat request is still waiting for its tokens
    finally:
        release.set()
        serving.prompts.encode_now = encode
        t.join(30)
    assert result and result[0].status_code == 200


# -- amplification ------------------------------------------------------------------------------------


def test_prompt_logprobs_times_n_times_length_over_the_budget_is_a_400(live):
    body = {"prompt": "hello " * 300, "max_tokens": 1, "n": 16, "prompt_logprobs": 20}
    r = post(live, "/v1/completions", body)
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["code"] == "response_too_large" and "50000" in err["message"]
    # Within the budget it runs.
    r = post(live, "/v1/completions", {**body, "n": 1, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text


def test_chat_logprobs_over_the_budget_are_a_400(live):
    body = {"messages": ASK, "logprobs": True, "top_logprobs": 20, "n": 4, "max_tokens": 1000}
    r = post(live, CHAT, body)
    assert r.status_code == 400 and error_of(r)["code"] == "response_too_large"


def test_embeddings_inputs_times_length_over_the_budget_are_a_400(live):
    r = post(live, "/v1/embeddings", {"input": ["word " * 300] * 60})  # 60 x 1500 tokens
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert (err["param"], err["code"]) == ("input", "response_too_large")


def test_the_response_budget_is_a_flag():
    from server.cli import build_parser
    from server.http.options import settings_fields

    args = build_parser().parse_args(
        [
            "--response-budget",
            "1234",
            "--grammar-check-timeout",
            "3",
            "--grammar-check-memory",
            "256",
        ]
    )
    fields = settings_fields(args)
    assert fields["response_budget"] == 1234
    assert fields["grammar_budget"] == CheckBudget(seconds=3.0, memory_mib=256)
