"""What a chat choice's text becomes in the response: reasoning, content and tool calls.

Owns `ParsedChatFormat`, the chat `ResponseFormat` used when a request has tools or the server
has a `--reasoning-parser`: each choice's text goes through `ReasoningSplit` (`<think>...</think>`
to `reasoning_content`, as vLLM and llama-server return it) and then `server.tooling.parser`'
parser, in chunks (deltas with `reasoning_content`, `content`, `tool_calls`) and in whole
messages alike; a choice that made calls ends with `finish_reason: "tool_calls"`.

Reasoning parsers: `qwen3` (reasoning only when the output opens with `<think>`) and
`deepseek_r1` (the output starts inside the reasoning: its template opens `<think>` in the
prompt, so everything up to `</think>` is reasoning).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine import TokenLogprob
from server.generation.text import Choice, Generation
from server.openai.formats import ChatFormat, TokenText
from server.tooling.parser import ToolCallStream, _partial_suffix
from server.tooling.plan import ToolPlan

_OPEN, _CLOSE = "<think>", "</think>"


class ReasoningSplit:
    """Text in, (reasoning delta, content delta) out; holds back what may become a tag."""

    def __init__(self, parser: str) -> None:
        self.state = "reasoning" if parser == "deepseek_r1" else "start"
        self.buf = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self.buf += text
        reasoning, content = [], []
        while True:
            if self.state == "start":
                stripped = self.buf.lstrip()
                if stripped.startswith(_OPEN):
                    self.buf, self.state = stripped[len(_OPEN) :], "reasoning"
                elif not final and _OPEN.startswith(stripped):
                    break  # may still open a <think>
                else:
                    self.state = "content"
            elif self.state == "reasoning":
                if self.buf.lstrip().startswith(_OPEN):  # deepseek_r1 output that opens anyway
                    self.buf = self.buf.lstrip()[len(_OPEN) :]
                i = self.buf.find(_CLOSE)
                if i >= 0:
                    reasoning.append(self.buf[:i])
                    self.buf, self.state = self.buf[i + len(_CLOSE) :], "after"
                    continue
                hold = 0 if final else _partial_suffix(self.buf, (_CLOSE, _OPEN))
                reasoning.append(self.buf[: len(self.buf) - hold])
                self.buf = self.buf[len(self.buf) - hold :]
                break
            elif self.state == "after":  # the newlines after </think> are neither
                self.buf = self.buf.lstrip("\n")
                if self.buf:
                    self.state = "content"
                    continue
                break
            else:
                content.append(self.buf)
                self.buf = ""
                break
        return "".join(reasoning), "".join(content)


class _ChoiceParsers:
    __slots__ = ("reasoning", "tools", "made_calls")

    def __init__(self, plan: ToolPlan | None, reasoning: str | None) -> None:
        self.reasoning = ReasoningSplit(reasoning) if reasoning else None
        self.tools = ToolCallStream(plan.format) if plan is not None else None
        self.made_calls = False

    def feed(self, text: str, final: bool) -> tuple[str, str, list[dict[str, Any]]]:
        reasoning, content = self.reasoning.feed(text, final) if self.reasoning else ("", text)
        calls: list[dict[str, Any]] = []
        if self.tools is not None:
            content, calls = self.tools.feed(content)
            if final:
                rest, more = self.tools.finish()
                content, calls = content + rest, calls + more
            self.made_calls = self.made_calls or bool(self.tools.calls)
        return reasoning, content, calls


def finish_reason(reason: str | None, made_calls: bool) -> str | None:
    # A choice that called tools and stopped by itself (not cut by length) ends in "tool_calls".
    return "tool_calls" if made_calls and reason == "stop" else reason


class ParsedChatFormat(ChatFormat):
    def __init__(
        self, gen: Generation, tokens: TokenText, plan: ToolPlan | None, reasoning: str | None
    ) -> None:
        super().__init__(gen, tokens)
        self.plan = plan
        self.reasoning = reasoning
        self.parsers = {c.index: _ChoiceParsers(plan, reasoning) for c in gen.choices}

    def chunk_choice(self, c: Choice, delta: str, lps: Sequence[TokenLogprob]) -> dict[str, Any]:
        p = self.parsers[c.index]
        reasoning, content, calls = p.feed(delta, c.finished)
        d: dict[str, Any] = {}
        if reasoning:
            d["reasoning_content"] = reasoning
        if content:
            d["content"] = content
        if calls:
            d["tool_calls"] = calls
        return {
            "index": c.index,
            "delta": d,
            "logprobs": self._logprobs(lps),
            "finish_reason": finish_reason(c.finish_reason, p.made_calls),
        }

    def full_choice(self, c: Choice) -> dict[str, Any]:
        p = _ChoiceParsers(self.plan, self.reasoning)
        reasoning, content, calls = p.feed(c.text, final=True)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["content"] = content or None
            message["tool_calls"] = p.tools.calls if p.tools is not None else []
        if self.reasoning:
            message["reasoning_content"] = reasoning or None
        return {
            "index": c.index,
            "message": message,
            "logprobs": self._logprobs(c.logprobs),
            "finish_reason": finish_reason(c.finish_reason, p.made_calls),
        }


def parsed_text(text: str, plan: ToolPlan | None, reasoning: str | None):
    """(reasoning, content, calls) of a whole output (for the Responses API)."""
    p = _ChoiceParsers(plan, reasoning)
    r, content, _ = p.feed(text, final=True)
    return r, content, (p.tools.calls if p.tools is not None else [])
