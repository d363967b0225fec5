"""POST /v1/responses (OpenAI's Responses API), stateless, on top of the chat path.

Owns the Responses request body (`ResponsesRequest`), its translation to a chat request
(`to_chat`: `instructions` and input items to messages, function tools, `tool_choice`,
`text.format`, `max_output_tokens`), and the response: output items (a `message` with
`output_text`, `function_call`s) built by `ResponsesBuilder` from the same updates and parsers
as chat (`server.chat_output`), streamed as the Responses event sequence (`response.created`,
`response.in_progress`, `response.output_item.added`, `response.content_part.added`,
`response.output_text.delta` ... `response.function_call_arguments.delta` ...,
`response.output_item.done`, `response.completed` or `response.incomplete`) or returned whole
(the same builder, its events dropped).

Nothing is stored: `store: true` and `previous_response_id` are 400s (a client that wants
history sends it as input items, as the Agents SDK does without a store).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

from server.chat_output import _ChoiceParsers
from server.errors import APIError, api_error
from server.generation import Generation
from server.protocol import (
    MAX_MESSAGES,
    MAX_SEED,
    ChatCompletionRequest,
    Text,
    _Body,
    int_in,
)
from server.responses import SSEResponse, dumps
from server.tool_protocol import FunctionName
from server.tools import ToolPlan


class InputText(_Body):
    type: Literal["input_text", "output_text", "text"]
    text: Text


class InputMessage(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[InputText]


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: Text = Field(min_length=1)
    name: FunctionName
    arguments: Text
    id: Text | None = None


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: Text = Field(min_length=1)
    output: Text


InputItem = InputMessage | FunctionCallItem | FunctionCallOutputItem


class FunctionTool(_Body):
    type: Literal["function"]
    name: FunctionName
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Body):
    type: Literal["function"]
    name: FunctionName


class TextFormat(_Body):
    model_config = _Body.model_config | {"populate_by_name": True}
    type: Literal["text", "json_object", "json_schema"]
    name: Text | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: Text | None = None


class TextConfig(_Body):
    format: TextFormat | None = None


class ResponsesRequest(_Body):
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
    # Stateless: only store false (or absent) and no previous_response_id (server.openapi says so)
    store: bool | None = None
    previous_response_id: Text | None = None
    metadata: dict[str, Text] | None = None
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
    for item in items:
        if isinstance(item, InputMessage):
            text = (
                item.content
                if isinstance(item.content, str)
                else "".join(p.text for p in item.content)
            )
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": text})
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


class ResponsesBuilder:
    """A Responses object and its stream events, from one choice's text deltas."""

    def __init__(self, req: ResponsesRequest, gen: Generation, plan: ToolPlan | None) -> None:
        self.req = req
        self.gen = gen
        self.id = "resp_" + gen.id.split("-", 1)[-1]
        self.parsers = _ChoiceParsers(plan, None)
        self.output: list[dict[str, Any]] = []
        self.seq = 0
        self.message: dict[str, Any] | None = None  # the open message item
        self.calls: dict[int, dict[str, Any]] = {}  # tool-call index -> its item
        self.status = "in_progress"
        self.incomplete: dict[str, str] | None = None

    def _event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {dumps(body)}\n\n"

    def response(self) -> dict[str, Any]:
        r = self.req
        fmt = r.text.format if r.text is not None and r.text.format is not None else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.gen.created,
            "status": self.status,
            "error": None,
            "incomplete_details": self.incomplete,
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "model": self.gen.model,
            "output": self.output,
            "parallel_tool_calls": r.parallel_tool_calls,
            "previous_response_id": None,
            "store": False,
            "temperature": r.temperature,
            "top_p": r.top_p,
            "text": {
                "format": fmt.model_dump(by_alias=True, exclude_none=True)
                if fmt is not None
                else {"type": "text"}
            },
            "tool_choice": (
                r.tool_choice.model_dump()
                if isinstance(r.tool_choice, NamedFunction)
                else r.tool_choice or "auto"
            ),
            "tools": [t.model_dump(exclude_none=True) for t in r.tools or []],
            "truncation": "disabled",
            "metadata": r.metadata or {},
            "user": r.user,
            "usage": self._usage() if self.status != "in_progress" else None,
        }

    def _usage(self) -> dict[str, Any]:
        u = self.gen.usage()
        return {
            "input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"],
        }

    def start(self) -> list[str]:
        return [
            self._event("response.created", response=self.response()),
            self._event("response.in_progress", response=self.response()),
        ]

    def feed(self, delta: str, finished: bool) -> list[str]:
        events: list[str] = []
        _, content, calls = self.parsers.feed(delta, finished)
        if content:
            events += self._text(content)
        for d in calls:
            events += self._call_delta(d)
        return events

    def finish(self, finish_reason: str | None) -> list[str]:
        events = self._close_message()
        for index in sorted(self.calls):
            item = self.calls.pop(index)
            item["status"] = "completed"
            n = self.output.index(item)
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=n,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
            events.append(self._event("response.output_item.done", output_index=n, item=item))
        if finish_reason in ("length", "abort"):
            self.status = "incomplete"
            reason = "max_output_tokens" if finish_reason == "length" else "interrupted"
            self.incomplete = {"reason": reason}
        else:
            self.status = "completed"
        kind = "response.completed" if self.status == "completed" else "response.incomplete"
        events.append(self._event(kind, response=self.response()))
        return events

    def _text(self, text: str) -> list[str]:
        events = []
        if self.message is None:
            self.message = {
                "id": f"msg_{self.gen.id.split('-', 1)[-1]}_{len(self.output)}",
                "type": "message",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            self.output.append(self.message)
            n = len(self.output) - 1
            events.append(
                self._event(
                    "response.output_item.added",
                    output_index=n,
                    item={**self.message, "content": []},
                )
            )
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self.message["content"].append(part)
            events.append(
                self._event(
                    "response.content_part.added",
                    item_id=self.message["id"],
                    output_index=n,
                    content_index=0,
                    part=dict(part),
                )
            )
        n = self.output.index(self.message)
        self.message["content"][0]["text"] += text
        events.append(
            self._event(
                "response.output_text.delta",
                item_id=self.message["id"],
                output_index=n,
                content_index=0,
                delta=text,
                logprobs=[],
            )
        )
        return events

    def _close_message(self) -> list[str]:
        m = self.message
        if m is None:
            return []
        self.message = None
        n = self.output.index(m)
        part = m["content"][0]
        m["status"] = "completed"
        return [
            self._event(
                "response.output_text.done",
                item_id=m["id"],
                output_index=n,
                content_index=0,
                text=part["text"],
                logprobs=[],
            ),
            self._event(
                "response.content_part.done",
                item_id=m["id"],
                output_index=n,
                content_index=0,
                part=part,
            ),
            self._event("response.output_item.done", output_index=n, item=m),
        ]

    def _call_delta(self, d: dict[str, Any]) -> list[str]:
        events = self._close_message()
        item = self.calls.get(d["index"])
        fragment = d["function"].get("arguments", "")
        if item is None:
            item = {
                "id": "fc_" + d["id"].removeprefix("call_"),
                "type": "function_call",
                "status": "in_progress",
                "call_id": d["id"],
                "name": d["function"]["name"],
                "arguments": "",
            }
            self.calls[d["index"]] = item
            self.output.append(item)
            events.append(
                self._event(
                    "response.output_item.added", output_index=len(self.output) - 1, item=dict(item)
                )
            )
        if fragment:
            item["arguments"] += fragment
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=self.output.index(item),
                    delta=fragment,
                )
            )
        return events


async def create_response(serving: Any, req: ResponsesRequest, http: HTTPRequest) -> Response:
    """The route's work: `serving` is the app's `server.serving.OpenAIServing`."""
    chat = to_chat(req)
    gen, requests, plan = await serving.chat_requests(chat, http, prefix="resp")
    builder = ResponsesBuilder(req, gen, plan)
    if req.stream:
        await serving._submit(gen, requests)
        return SSEResponse(
            _events(serving, gen, builder),
            lambda: serving._finish(gen),
            stall_timeout=serving.stall_timeout,
        )

    async def whole() -> Response:
        await serving._submit(gen, requests)
        async for _ in _events(serving, gen, builder):
            pass
        return JSONResponse(builder.response())

    return await serving._until_disconnect(http, whole())


async def _events(serving: Any, gen: Generation, builder: ResponsesBuilder) -> AsyncIterator[str]:
    for event in builder.start():
        yield event
    reason = None
    try:
        async for c, delta, _, _ in serving._updates(gen):
            for event in builder.feed(delta, c.finished):
                yield event
            if c.finished:
                reason = c.finish_reason
        for event in builder.finish(reason):
            yield event
    except Exception as e:
        body = api_error(e, gen.id).body()["error"]
        yield builder._event(
            "error", code=body["code"], message=body["message"], param=body["param"]
        )
