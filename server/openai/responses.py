"""POST /v1/responses (OpenAI's Responses API), stateless, on top of the chat path.

Owns the Responses request body (`ResponsesRequest`), its translation to a chat request
(`to_chat`: `instructions` and input items to messages, function tools, `tool_choice`,
`text.format`, `max_output_tokens`), and `create_response`: the chat path's generation, its
updates fed to `server.openai.responses_events.ResponsesBuilder`, streamed as the Responses event
sequence or returned whole (the same builder, its events dropped).

Nothing is stored: `store: true` and `previous_response_id` are 400s (a client that wants
history sends it as input items, as the Agents SDK does without a store).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError
from starlette.requests import Request as HTTPRequest
from starlette.responses import Response

from server.errors import APIError
from server.generation.text import Generation
from server.openai.body import Body, JSONObject
from server.openai.protocol import (
    MAX_MESSAGES,
    MAX_SEED,
    ChatCompletionRequest,
    Text,
    int_in,
)
from server.openai.responses_events import ResponsesBuilder
from server.openai.tool_protocol import FunctionName
from server.tooling.plan import ToolPlan


class InputText(Body):
    type: Literal["input_text", "output_text", "text"]
    text: Text


class InputMessage(Body):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[InputText]


class FunctionCallItem(Body):
    type: Literal["function_call"]
    call_id: Text = Field(min_length=1)
    name: FunctionName
    arguments: Text
    id: Text | None = None


class FunctionCallOutputItem(Body):
    type: Literal["function_call_output"]
    call_id: Text = Field(min_length=1)
    output: Text


class ReasoningPart(Body):
    type: Literal["reasoning_text", "summary_text"]
    text: Text


class ReasoningItem(Body):
    """A `reasoning` output item sent back as input (as the Agents SDK does): the reasoning of
    the assistant turn after it, which a template may render back (gpt-oss's, before a call)."""

    type: Literal["reasoning"]
    id: Text | None = None
    summary: list[ReasoningPart] = Field(default_factory=list)
    content: list[ReasoningPart] | None = None
    encrypted_content: Text | None = None


InputItem = InputMessage | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


class FunctionTool(Body):
    type: Literal["function"]
    name: FunctionName
    description: Text | None = None
    parameters: JSONObject | None = None
    strict: bool | None = None


class NamedFunction(Body):
    type: Literal["function"]
    name: FunctionName


class TextFormat(Body):
    model_config = Body.model_config | {"populate_by_name": True}
    type: Literal["text", "json_object", "json_schema"]
    name: Text | None = None
    schema_: JSONObject | None = Field(None, alias="schema")
    strict: bool | None = None
    description: Text | None = None


class TextConfig(Body):
    format: TextFormat | None = None


class ResponsesRequest(Body):
    model: Text | None = None
    input: Text | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_MESSAGES)]
    instructions: Text | None = None
    max_output_tokens: int_in(ge=1) | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int_in(ge=-MAX_SEED, le=MAX_SEED) | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    stream: bool = False
    # Stateless: only store false (or absent) and no previous_response_id (server.http.openapi says so)
    store: bool | None = None
    previous_response_id: Text | None = None
    metadata: Annotated[dict[Text, Text], Field(max_length=16)] | None = None
    user: Text | None = None


def to_chat(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request a Responses request means."""
    if req.previous_response_id is not None:
        raise APIError(
            400,
            "previous_response_id is not supported: this server stores no responses; send the "
            "conversation as input items",
            param="previous_response_id",
        )
    if req.store:
        raise APIError(
            400, "store: true is not supported: this server stores no responses", param="store"
        )
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    items = (
        [InputMessage(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    )
    reasoning = ""  # a reasoning item's text, for the assistant turn that follows it
    for item in items:
        if isinstance(item, ReasoningItem):
            reasoning += "".join(p.text for p in item.content or item.summary)
        elif isinstance(item, InputMessage):
            text = (
                item.content
                if isinstance(item.content, str)
                else "".join(p.text for p in item.content)
            )
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": text})
            if role == "assistant" and reasoning:
                messages[-1]["reasoning_content"], reasoning = reasoning, ""
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                if reasoning:
                    messages[-1]["reasoning_content"], reasoning = reasoning, ""
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    if not messages:
        raise APIError(400, "input must not be empty", param="input")
    body: dict[str, Any] = {"messages": messages, "parallel_tool_calls": req.parallel_tool_calls}
    for name in ("model", "temperature", "top_p", "seed", "user", "stream"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    if req.tools:
        body["tools"] = [
            {
                "type": "function",
                "function": t.model_dump(exclude={"type"}, exclude_none=True),
            }
            for t in req.tools
        ]
    choice = req.tool_choice
    if isinstance(choice, NamedFunction):
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None:
        body["tool_choice"] = choice
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        schema = {"name": fmt.name or "output", "schema": fmt.schema_, "strict": fmt.strict}
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:  # the translation is of checked fields: a rule of chat's
        err = e.errors()[0]
        raise APIError(400, f"{err['msg']}", param=".".join(str(p) for p in err["loc"])) from e


async def create_response(serving: Any, req: ResponsesRequest, http: HTTPRequest) -> Response:
    """The route's work: `serving` is the app's `server.openai.serving.OpenAIServing`; the chat
    path prepares the request, with a `ResponsesBuilder` as what it sends back."""
    chat = to_chat(req)

    def render(gen: Generation, plan: ToolPlan | None) -> ResponsesBuilder:
        return ResponsesBuilder(req, gen, plan, serving.reasoning_parser)

    sub = await serving.chat_submission(chat, http, render, prefix="resp")
    return await serving.respond(sub, http)
