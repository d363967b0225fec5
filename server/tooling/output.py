"""What a chat choice's text becomes: reasoning, content and tool calls, in deltas.

Owns `ChoiceParsers`, one choice's parsers in order: `--reasoning-parser`'s split
(`server.tooling.reasoning`), then the plan's tool-call parser (`server.tooling.parser`), fed
a text delta at a time (a whole output is one delta, final), so streamed chunks, whole chat
messages and the Responses API's items all read the same text the same way; the `harmony`
parser (`server.tooling.harmony`) reads all three at once from its channels. Also
`finish_reason`, a choice that made calls ending with "tool_calls", and `kept_token_ids`, the
special tokens a choice's text keeps for its parsers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from server.tooling.harmony import HarmonyStream, special_ids
from server.tooling.parser import ToolCallStream
from server.tooling.plan import ToolPlan
from server.tooling.reasoning import ReasoningSplit

if TYPE_CHECKING:
    from models import Tokenizer


class ChoiceParsers:
    """One choice's reasoning split and tool-call parser (either may be absent)."""

    __slots__ = ("reasoning", "tools", "harmony", "made_calls")

    def __init__(self, plan: ToolPlan | None, reasoning: str | None) -> None:
        self.harmony = HarmonyStream(plan is not None) if reasoning == "harmony" else None
        harmony = self.harmony is not None
        self.reasoning = ReasoningSplit(reasoning) if reasoning and not harmony else None
        self.tools = ToolCallStream(plan.format) if plan is not None and not harmony else None
        self.made_calls = False

    def feed(self, text: str, final: bool) -> tuple[str, str, list[dict[str, Any]]]:
        """(reasoning, content, tool-call deltas) of the next text delta."""
        if self.harmony is not None:
            reasoning, content, calls = self.harmony.feed(text, final)
            self.made_calls = self.made_calls or bool(self.harmony.calls)
            return reasoning, content, calls
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
        if self.harmony is not None:
            return self.harmony.calls
        return self.tools.calls if self.tools is not None else []


def kept_token_ids(reasoning: str | None, tokenizer: Tokenizer) -> frozenset[int]:
    """The special tokens a choice's text keeps for `reasoning`'s parser (harmony's markers;
    none for the others, which read plain text)."""
    return special_ids(tokenizer) if reasoning == "harmony" else frozenset()


def finish_reason(reason: str | None, made_calls: bool) -> str | None:
    # A choice that called tools and stopped by itself (not cut by length) ends in "tool_calls".
    return "tool_calls" if made_calls and reason == "stop" else reason
