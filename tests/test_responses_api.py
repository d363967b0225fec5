"""POST /v1/responses with the official OpenAI SDK against real servers: text, instructions,
function tools (a call, then its output as an input item), text.format json_schema, the
streamed event sequence (`responses.stream`), and the 400s of a stateless server."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.helpers.servers import LiveServer, run_server

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 16}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def smol(smollm2_lm) -> LiveServer:
    with run_server(smollm2_lm, engine_options={"kv_cache_memory_gib": 0.1}) as live:
        yield live


def sdk(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.v1, api_key="unused", max_retries=0, timeout=120)


def test_text_response_has_a_message_item_and_usage(smol, smollm2_lm):
    r = sdk(smol).responses.create(
        model=smollm2_lm.name,
        input="Say hello.",
        instructions="Answer in one short sentence.",
        max_output_tokens=200,
        temperature=0,
    )
    assert r.object == "response" and r.status == "completed"
    assert [o.type for o in r.output] == ["message"]
    assert r.output_text.strip()
    assert r.usage.output_tokens > 0 and r.usage.total_tokens == (
        r.usage.input_tokens + r.usage.output_tokens
    )


def test_max_output_tokens_makes_the_response_incomplete(server, tiny_lm):
    r = sdk(server).responses.create(model=tiny_lm.name, input="Hi", max_output_tokens=3)
    assert r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3


def test_function_call_then_its_output_gives_an_answer(smol, smollm2_lm):
    client = sdk(smol)
    first = client.responses.create(
        model=smollm2_lm.name,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=60,
        temperature=0,
    )
    assert [o.type for o in first.output] == ["function_call"]
    call = first.output[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    second = client.responses.create(
        model=smollm2_lm.name,
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C."},
        ],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=200,
        temperature=0,
    )
    assert second.status == "completed" and second.output_text.strip()


def test_json_schema_text_format_validates(smol, smollm2_lm):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    }
    r = sdk(smol).responses.create(
        model=smollm2_lm.name,
        input="Name a city in France.",
        max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "city", "schema": schema}},
        temperature=0,
    )
    jsonschema.validate(json.loads(r.output_text), schema)


def test_stream_sends_the_event_sequence_and_a_final_response(smol, smollm2_lm):
    with sdk(smol).responses.stream(
        model=smollm2_lm.name, input="Say hello.", max_output_tokens=200, temperature=0
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text and deltas.strip()
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_streamed_function_call_arguments_join_to_the_call(smol, smollm2_lm):
    with sdk(smol).responses.stream(
        model=smollm2_lm.name,
        input="Weather in Paris?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=60,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    call = final.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(fragments) > 1 and "".join(fragments) == call.arguments
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, None),
        (
            {"tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]},
            "tool_choice.function.name",
        ),
        (
            {"input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]},
            "messages[0].tool_call_id",
        ),
    ],
)
def test_unsupported_or_bad_fields_are_400s(server, change, param):
    r = httpx.post(server.url("/v1/responses"), json={"input": "Hi", **change}, timeout=60)
    assert r.status_code == 400, r.text
    if param is not None:
        assert r.json()["error"]["param"] == param
