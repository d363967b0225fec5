"""What a chat choice's text becomes: reasoning, content and tool calls, in deltas.

Owns `ChoiceParsers`, one choice's parsers in order: `--reasoning-parser`'s split
(`server.tooling.reasoning`), then the plan's tool-call parser (`server.tooling.parser`), fed
a text delta at a time (a whole output is one delta, final), so streamed chunks, whole chat
messages and the Responses API's items all read the same text the same way; and
`finish_reason`, a choice that made calls ending with "tool_calls".
"""

from __future__ import annotations

from typing import Any

from server.tooling.parser import ToolCallStream
from server.tooling.plan import ToolPlan
from server.tooling.reasoning import ReasoningSplit


class ChoiceParsers:
    """One choice's reasoning split and tool-call parser (either may be absent)."""

    __slots__ = ("reasoning", "tools", "made_calls")

    def __init__(self, plan: ToolPlan | None, reasoning: str | None) -> None:
        self.reasoning = ReasoningSplit(reasoning) if reasoning else None
        self.tools = ToolCallStream(plan.format) if plan is not None else None
        self.made_calls = False

    def feed(self, text: str, final: bool) -> tuple[str, str, list[dict[str, Any]]]:
        """(reasoning, content, tool-call deltas) of the next text delta."""
        reasoning, content = self.reasoning.feed(text, final) if self.reasoning else ("", text)
        calls: list[dict[str, Any]] = []
        if self.tools is not None:
            content, calls = self.tools.feed(content)
            if final:
                rest, more = self.tools.finish()
                content, calls = content + rest, calls + more
            self.made_calls = self.made_calls or bool(self.tools.calls)
        return reasoning, content, calls

    @property
    def calls(self) -> list[dict[str, Any]]:
        """The finished calls, OpenAI's message shape."""
        return self.tools.calls if self.tools is not None else []


def finish_reason(reason: str | None, made_calls: bool) -> str | None:
    # A choice that called tools and stopped by itself (not cut by length) ends in "tool_calls".
    return "tool_calls" if made_calls and reason == "stop" else reason
