"""Tool calling on /v1/chat/completions with real clients against real servers: the OpenAI SDK
(whole and streamed, deltas accumulated), LangChain's tool loop on SmolLM2, sampled calls that
must validate against their schemas (jsonschema is the oracle), and the 400s for bad tools."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from enum import StrEnum

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from server.tooling.plan import ToolPlan, call_schema, tool_defs
from tests.helpers.servers import LiveServer, run_server

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a word up.",
        "parameters": {
            "type": "object",
            "properties": {
                "word": {"type": "string", "maxLength": 8},
                "n": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["word", "n"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, LOOKUP]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def smol(smollm2_lm) -> Iterator[LiveServer]:
    # All 50 sampled requests in one batch (they share the prompt's blocks in the prefix cache).
    options = {"max_batch_size": 50, "kv_cache_memory_gib": 0.25}
    with run_server(smollm2_lm, engine_options=options) as live:
        yield live


def sdk(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.v1, api_key="unused", max_retries=0, timeout=120)


def assert_valid_calls(message, names: set[str], at_most: int | None = None) -> None:
    calls = message.tool_calls or []
    assert calls, f"no tool call in {message}"
    if at_most is not None:
        assert len(calls) <= at_most
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_tool_call_from_smollm2_parses_and_validates(smol, smollm2_lm):
    out = sdk(smol).chat.completions.create(
        model=smollm2_lm.name,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=80,
        temperature=0,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert_valid_calls(choice.message, {"get_weather", "lookup"})


def test_streamed_tool_call_deltas_accumulate_to_the_whole_response(smol, smollm2_lm):
    args = dict(
        model=smollm2_lm.name,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=80,
        temperature=0,
    )
    client = sdk(smol)
    whole = client.chat.completions.create(**args).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    first_delta_of: dict[int, object] = {}
    for chunk in client.chat.completions.create(**args, stream=True):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                first_delta_of.setdefault(d.index, d)
                entry = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
    assert finish == whole.finish_reason == "tool_calls"
    # OpenAI's shape: the first delta of a call carries its id, type and name.
    assert all(d.id and d.type == "function" and d.function.name for d in first_delta_of.values())
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]
    assert whole.message.tool_calls[0].function.name == "get_weather"


def test_parallel_tool_calls_false_allows_one_call(server, tiny_lm):
    out = sdk(server).chat.completions.create(
        model=tiny_lm.name,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        temperature=1,
        seed=3,
        n=4,
    )
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls"
        assert_valid_calls(choice.message, {"get_weather", "lookup"}, at_most=1)


async def _sampled_calls(live: LiveServer, model: str, max_tokens: int) -> None:
    client = openai.AsyncOpenAI(base_url=live.v1, api_key="unused", max_retries=0, timeout=300)
    choices = ["required", {"type": "function", "function": {"name": "lookup"}}]

    async def one(i: int):
        choice = choices[i % 2]
        out = await client.chat.completions.create(
            model=model,
            messages=ASK,
            tools=TOOLS,
            tool_choice=choice,
            temperature=1.0,
            seed=1000 + i,
            max_tokens=max_tokens,
            parallel_tool_calls=i % 5 == 0,
        )
        return choice, out.choices[0]

    results = await asyncio.gather(*(one(i) for i in range(50)))
    for choice, c in results:
        assert c.finish_reason == "tool_calls", c
        names = {"lookup"} if isinstance(choice, dict) else {"get_weather", "lookup"}
        assert_valid_calls(c.message, names, at_most=None if choice == "required" else 1)


def test_fifty_sampled_required_and_named_calls_from_tinygpt_validate(tiny_lm):
    # Random weights at temperature 1: only the grammar makes these calls well formed. All 50
    # in one batch: a random model writes many parallel calls, and waves of 8 take long.
    with run_server(tiny_lm, engine_options={"max_batch_size": 50}) as live:
        asyncio.run(_sampled_calls(live, tiny_lm.name, max_tokens=900))


def test_fifty_sampled_required_and_named_calls_from_smollm2_validate(smol, smollm2_lm):
    asyncio.run(_sampled_calls(smol, smollm2_lm.name, max_tokens=400))


def test_langchain_tool_loop_calls_then_answers_from_the_tool_result(smol, smollm2_lm):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return f"It is sunny and 21 degrees in {city}."

    llm = ChatOpenAI(
        base_url=smol.v1,
        api_key="unused",
        model=smollm2_lm.name,
        temperature=0,
        max_tokens=60,
        max_retries=0,
    )
    messages = [HumanMessage("What is the weather in Paris? Use the tool.")]
    ai = llm.bind_tools([get_weather], tool_choice="required").invoke(messages)
    assert len(ai.tool_calls) >= 1
    call = ai.tool_calls[0]
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    messages.append(ai)
    for c in ai.tool_calls:
        messages.append(ToolMessage(get_weather.invoke(c["args"]), tool_call_id=c["id"]))
    final = llm.bind_tools([get_weather], tool_choice="none").invoke(messages)
    assert not final.tool_calls
    assert isinstance(final.content, str) and final.content.strip()
    assert final.response_metadata["finish_reason"] in ("stop", "length")


def test_auto_in_generic_mode_answers_or_calls_and_either_parses(smol, smollm2_lm):
    out = sdk(smol).chat.completions.create(
        model=smollm2_lm.name,
        messages=[{"role": "user", "content": "Say hello."}],
        tools=TOOLS,
        max_tokens=30,
        temperature=1,
        seed=5,
        n=4,
    )
    for c in out.choices:
        if c.message.tool_calls:
            assert c.finish_reason == "tool_calls"
            assert_valid_calls(c.message, {"get_weather", "lookup"})
        else:
            assert c.message.content and not c.message.content.startswith("<")


def _post(live: LiveServer, body: dict) -> httpx.Response:
    return httpx.post(live.url("/v1/chat/completions"), json=body, timeout=60)


CALLED = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {
            "id": "call_1",
            "type": "function",
            "function": {
                "name": "get_weather",
                "arguments": '{"city": "Paris", "unit": "celsius"}',
            },
        }
    ],
}


@pytest.mark.parametrize(
    ("change", "param"),
    [
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}},
                        },
                    }
                ]
            },
            "tools[0].function.parameters",
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}
                ]
            },
            "tools[0].function.parameters",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        (
            {
                "messages": [
                    *ASK,
                    CALLED,
                    {"role": "tool", "content": "x", "tool_call_id": "call_9"},
                ]
            },
            "messages[2].tool_call_id",
        ),
        ({"messages": [*ASK, {"role": "tool", "content": "x"}]}, "messages[1].tool_call_id"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, None),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
    ],
)
def test_bad_tools_are_400s_naming_the_field(server, change, param):
    r = _post(server, {"messages": ASK, "max_tokens": 4, **change})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error
    else:
        assert "name" in error["message"] or "tools" in (error["param"] or ""), error


def test_a_tool_result_turn_is_accepted_after_its_call(server):
    body = {
        "messages": [*ASK, CALLED, {"role": "tool", "content": "21 C", "tool_call_id": "call_1"}],
        "tools": TOOLS,
        "max_tokens": 4,
    }
    r = _post(server, body)
    assert r.status_code == 200, r.text


def test_a_call_s_arguments_take_only_the_properties_its_schema_lists():
    """Parameters without additionalProperties are closed in the call grammar (as llama.cpp and
    vLLM close them): a small model cannot pad a call with made-up arguments."""
    params = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tool = {"type": "function", "function": {"name": "f", "parameters": params}}
    plan = ToolPlan((tool,), "named", "f", False, "hermes", True, None)
    ref = call_schema(plan, "f")["properties"]["arguments"]["$ref"]
    args = tool_defs(plan, ["f"])[ref.removeprefix("#/$defs/")]
    assert args["additionalProperties"] is False and "additionalProperties" not in params
    assert args["properties"] == params["properties"] and args["required"] == ["city"]


# -- pydantic-typed tools: parameters with $defs (nested models, lists of models, enums, optionals) --


class Unit(StrEnum):
    celsius = "celsius"
    fahrenheit = "fahrenheit"


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str | None = Field(default=None, max_length=24)


class Forecast(BaseModel):
    """The weather forecast for some cities."""

    cities: list[City] = Field(min_length=1, max_length=2)
    unit: Unit
    days: int | None = Field(default=None, ge=1, le=7)


FORECAST_ASK = [{"role": "user", "content": "What will the weather be in Paris and Rome?"}]


def pydantic_tools() -> list[tuple[str, dict]]:
    """The same model as a tool two ways: pydantic's own schema (`$defs`, optionals with
    defaults, `anyOf` null) and the OpenAI SDK's strict one (`pydantic_function_tool`)."""
    plain = {
        "type": "function",
        "function": {
            "name": "forecast",
            "description": "The weather forecast for some cities.",
            "parameters": Forecast.model_json_schema(),
        },
    }
    strict = openai.pydantic_function_tool(Forecast, name="forecast")
    assert (
        "$defs" in plain["function"]["parameters"] and "$defs" in strict["function"]["parameters"]
    )
    return [("model_json_schema", plain), ("pydantic_function_tool", strict)]


@pytest.mark.parametrize(
    ("how", "tool"), pydantic_tools(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_pydantic_tool_calls_whole_and_streamed_parse_into_the_model(smol, smollm2_lm, how, tool):
    args = dict(
        model=smollm2_lm.name,
        messages=FORECAST_ASK,
        tools=[tool],
        tool_choice="required",
        max_tokens=150,
        temperature=0,
    )
    client = sdk(smol)

    def stream() -> dict[int, str]:
        streamed: dict[int, str] = {}
        for chunk in client.chat.completions.create(**args, stream=True):
            for choice in chunk.choices:
                for d in choice.delta.tool_calls or []:
                    streamed[d.index] = streamed.get(d.index, "") + (d.function.arguments or "")
        return streamed

    # Both at once: the server batches them (greedy output does not depend on the batch).
    with ThreadPoolExecutor(2) as pool:
        streaming = pool.submit(stream)
        whole = client.chat.completions.create(**args).choices[0]
        streamed = streaming.result()
    assert whole.finish_reason == "tool_calls", whole
    for call in whole.message.tool_calls:
        assert call.function.name == "forecast"
        # nested models, a list of them, an enum, optionals: all parse into the model
        Forecast.model_validate_json(call.function.arguments)
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    assert list(streamed.values()) == [c.function.arguments for c in whole.message.tool_calls]


def test_pydantic_tool_call_through_the_sdk_s_parse_helper(smol, smollm2_lm):
    out = sdk(smol).chat.completions.parse(
        model=smollm2_lm.name,
        messages=FORECAST_ASK,
        tools=[openai.pydantic_function_tool(Forecast, name="forecast")],
        tool_choice="required",
        max_tokens=150,
        temperature=0,
    )
    parsed = out.choices[0].message.tool_calls[0].function.parsed_arguments
    assert isinstance(parsed, Forecast) and parsed.cities


def test_pydantic_tool_call_on_responses(smol, smollm2_lm):
    tool = {
        "type": "function",
        "name": "forecast",
        "description": "The weather forecast for some cities.",
        "parameters": Forecast.model_json_schema(),
    }
    r = sdk(smol).responses.create(
        model=smollm2_lm.name,
        input=FORECAST_ASK[0]["content"],
        tools=[tool],
        tool_choice="required",
        max_output_tokens=150,
        temperature=0,
    )
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "forecast"
    Forecast.model_validate_json(calls[0].arguments)


AGENT_SCRIPT = r"""
import asyncio, json, sys
from enum import StrEnum
from openai import AsyncOpenAI
from pydantic import BaseModel, Field
from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool
from agents import set_tracing_disabled

set_tracing_disabled(True)  # nothing leaves the machine
base_url, model = sys.argv[1], sys.argv[2]

class Unit(StrEnum):
    celsius = "celsius"
    fahrenheit = "fahrenheit"

class City(BaseModel):
    name: str = Field(max_length=24)
    country: str | None = Field(default=None, max_length=24)

class Forecast(BaseModel):
    cities: list[City] = Field(min_length=1, max_length=2)
    unit: Unit
    days: int | None = Field(default=None, ge=1, le=7)

calls = []

@function_tool
def forecast(request: Forecast) -> str:
    "The weather forecast for some cities."
    calls.append(request.model_dump(mode="json"))
    return "sunny"

client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
agent = Agent(
    name="weather",
    instructions="Answer weather questions with the forecast tool.",
    tools=[forecast],
    model=OpenAIResponsesModel(model=model, openai_client=client),
    model_settings=ModelSettings(
        tool_choice="required", temperature=0, max_tokens=150, parallel_tool_calls=False
    ),
    tool_use_behavior="stop_on_first_tool",
)
result = asyncio.run(Runner.run(agent, "What will the weather be in Paris and Rome?"))
print(json.dumps({"calls": calls, "final": result.final_output}))
"""


def test_an_openai_agents_sdk_agent_calls_a_pydantic_typed_tool(smol, smollm2_lm, tmp_path):
    """The Agents SDK (its Responses model) runs an agent whose function tool takes a pydantic
    model; the call reaches the tool parsed. In a child process: importing the SDK imports
    sse-starlette, which patches uvicorn process-wide."""
    pytest.importorskip("agents")
    script = tmp_path / "agent.py"
    script.write_text(AGENT_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), smol.v1, smollm2_lm.name],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(out["calls"]) == 1 and out["final"] == "sunny"
    Forecast.model_validate(out["calls"][0])
