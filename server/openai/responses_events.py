"""The Responses API's output: items and the stream of events, built from a choice's text.

Owns `ResponsesBuilder`, the `server.generation.submission.Render` of /v1/responses: one
choice's text deltas, through the same parsers as chat (`server.tooling.output`:
`--reasoning-parser`, then tool calls), become output items (a `reasoning` item, a `message`
with one `output_text` part, `function_call`s), each opened, grown and closed with OpenAI's
events (`response.output_item.added`, `response.content_part.added`,
`response.output_text.delta`, `response.reasoning_text.delta`,
`response.function_call_arguments.delta`, their `.done`s), numbered by `sequence_number`, and
the Response object itself (`response.created` ... `response.completed` or
`response.incomplete`; a failure once streaming has begun: `error`, then `response.failed`).
Returned whole, it is the same builder with its events dropped. The request side is
`server.openai.responses`'s.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from server.errors import api_error
from server.generation.sse import dumps
from server.generation.text import Generation, Update
from server.tooling.output import ChoiceParsers
from server.tooling.plan import ToolPlan


class ResponsesBuilder:
    """A Responses object and its stream events, from one choice's text deltas."""

    def __init__(
        self,
        req: Any,  # the `server.openai.responses.ResponsesRequest`
        gen: Generation,
        plan: ToolPlan | None,
        reasoning_parser: str | None = None,
    ) -> None:
        self.req = req
        self.gen = gen
        self.id = "resp_" + gen.id.split("-", 1)[-1]
        self.parsers = ChoiceParsers(plan, reasoning_parser)
        self.reasoning: dict[str, Any] | None = None  # the open reasoning item
        self.output: list[dict[str, Any]] = []
        self.seq = 0
        self.message: dict[str, Any] | None = None  # the open message item
        self.calls: dict[int, dict[str, Any]] = {}  # tool-call index -> its item
        self.status = "in_progress"
        self.incomplete: dict[str, str] | None = None
        self.error: dict[str, str] | None = None  # a failed response's {code, message}

    async def stream(self, updates: AsyncIterator[Update]) -> AsyncIterator[str]:
        """The Responses event stream. Whatever fails once it has started (the grammar reaching
        a dead end, the engine stopping, a bug) ends it cleanly: an `error` event and
        `response.failed`, never a cut connection."""
        try:
            for event in self.start():
                yield event
            reason = None
            async for c, delta, _, _ in updates:
                for event in self.feed(delta, c.finished):
                    yield event
                if c.finished:
                    reason = c.finish_reason
            for event in self.finish(reason):
                yield event
        except Exception as e:
            for event in self.fail(api_error(e, self.gen.id)):
                yield event

    async def whole(self, updates: AsyncIterator[Update]) -> dict[str, Any]:
        """The Response object once the run ends (a failure: `response.failed`'s object)."""
        async for _ in self.stream(updates):
            pass
        return self.response()

    def _event(self, kind: str, **fields: Any) -> str:
        data = dumps({"type": kind, "sequence_number": self.seq, **fields})
        self.seq += 1  # after: an event that cannot be sent takes no number
        return f"event: {kind}\ndata: {data}\n\n"

    def response(self) -> dict[str, Any]:
        r = self.req
        fmt = r.text.format if r.text is not None and r.text.format is not None else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.gen.created,
            "status": self.status,
            "error": self.error,
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
                if not isinstance(r.tool_choice, str | None)  # a named function
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
        reasoning, content, calls = self.parsers.feed(delta, finished)
        if reasoning:
            events += self._reasoning(reasoning)
        if content:
            events += self._text(content)
        for d in calls:
            events += self._call_delta(d)
        return events

    def finish(self, finish_reason: str | None) -> list[str]:
        events = self._close_reasoning() + self._close_message()
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

    def fail(self, err: Any) -> list[str]:
        """The end of a stream that failed after it started (`err`: a `server.errors.APIError`):
        an `error` event, then `response.failed` carrying it."""
        body = err.body()["error"]
        self.status = "failed"
        self.error = {"code": body["code"] or body["type"], "message": body["message"]}
        events = [
            self._event("error", code=body["code"], message=body["message"], param=body["param"])
        ]
        try:
            events.append(self._event("response.failed", response=self.response()))
        except (TypeError, ValueError):  # the response itself cannot be sent: its bare bones
            bare = {"id": self.id, "object": "response", "status": "failed", "error": self.error}
            events.append(self._event("response.failed", response=bare))
        return events

    def _reasoning(self, text: str) -> list[str]:
        """`--reasoning-parser`'s <think> text as a `reasoning` item (before the answer)."""
        events = []
        if self.reasoning is None:
            self.reasoning = {
                "id": f"rs_{self.gen.id.split('-', 1)[-1]}_{len(self.output)}",
                "type": "reasoning",
                "status": "in_progress",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": ""}],
            }
            self.output.append(self.reasoning)
            events.append(
                self._event(
                    "response.output_item.added",
                    output_index=len(self.output) - 1,
                    item={**self.reasoning, "content": []},
                )
            )
        self.reasoning["content"][0]["text"] += text
        events.append(
            self._event(
                "response.reasoning_text.delta",
                item_id=self.reasoning["id"],
                output_index=self.output.index(self.reasoning),
                content_index=0,
                delta=text,
            )
        )
        return events

    def _close_reasoning(self) -> list[str]:
        r = self.reasoning
        if r is None:
            return []
        self.reasoning = None
        r["status"] = "completed"
        n = self.output.index(r)
        text = r["content"][0]["text"]
        return [
            self._event(
                "response.reasoning_text.done",
                item_id=r["id"],
                output_index=n,
                content_index=0,
                text=text,
            ),
            self._event("response.output_item.done", output_index=n, item=r),
        ]

    def _text(self, text: str) -> list[str]:
        events = self._close_reasoning()
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
        events = self._close_reasoning() + self._close_message()
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
