"""Tool calls parsed out of generated text, incrementally: one parser serves streamed and whole
responses (a whole response is the text fed at once), so both always agree.

Owns `ToolCallStream`: text in, (content delta, OpenAI tool-call deltas) out. Content streams
until a format's trigger starts the calls region (its row in `server.tooling.formats`:
`<tool_call>` for hermes, `[TOOL_CALLS]` for mistral, `<|python_tag|>` for llama3; for llama3
and mistral also output that opens with a JSON object or array, since their trigger is a
special token a detokenizer drops); the text that may still become a trigger is held back. In
the region each call object is streamed as OpenAI does: its id, type and name in the first
delta once `"name": "..."` is complete, then fragments of the arguments' raw JSON text as they
arrive, so the fragments join to exactly the `arguments` string of the whole response. A call
whose keys come in another order is sent whole when its object closes; an object that is not a
call goes back out as content. An object cut off (by max_tokens) before its name is whole is
dropped, not sent as content, where it follows a trigger or another call: it is the start of a
call, as a cut-off call's arguments so far are a call.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from server.tooling.formats import FORMATS, held_suffix

_HEAD = re.compile(
    r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)'
)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def json_value_end(text: str, start: int) -> int | None:
    """The index just past the JSON value (object, array, string or scalar) starting at
    `start`, or None while it is incomplete. Brackets are matched outside strings only."""
    if start >= len(text):
        return None
    first = text[start]
    if first not in '{["':
        m = re.compile(r"-?[0-9.eE+-]+|true|false|null").match(text, start)
        # A scalar is complete only once something follows it.
        return m.end() if m and m.end() < len(text) else None
    depth, in_str, esc = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
                if depth == 0:
                    return i + 1
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


class _Call:
    __slots__ = ("index", "id", "name", "args_start", "args_sent", "args", "header_sent")

    def __init__(self, index: int) -> None:
        self.index = index
        self.id = new_call_id()
        self.name: str | None = None
        self.args_start: int | None = None
        self.args_sent = 0  # absolute index in the buffer the arguments are sent up to
        self.args: str | None = None  # the whole arguments text, once it closed
        self.header_sent = False


class ToolCallStream:
    """One choice's parser. `feed` each text delta, then `finish` once."""

    def __init__(self, fmt: str) -> None:
        row = FORMATS[fmt]
        self.triggers = row.triggers
        self.glue = row.glue
        self.bare_start = row.bare_start
        self.buf = ""
        self.pos = 0  # everything before it is sent (as content or as calls)
        self.in_calls = False
        self.region = (0, 0)  # where the calls region began (its trigger), calls before it
        self.region_trigger = False  # the region began with a trigger, not a bare opening
        self.wrote_content = False
        self.current: _Call | None = None
        self.obj_start = 0
        self.calls: list[dict[str, Any]] = []  # finished calls, OpenAI's message shape

    # -- public ----------------------------------------------------------------------------------

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self.buf += text
        return self._advance(final=False)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        return self._advance(final=True)

    def parse(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """A whole output: (content, calls)."""
        content, _ = self.feed(text)
        rest, _ = self.finish()
        return content + rest, self.calls

    # -- the scanner -----------------------------------------------------------------------------

    def _advance(self, final: bool) -> tuple[str, list[dict[str, Any]]]:
        content: list[str] = []
        deltas: list[dict[str, Any]] = []
        while True:
            before = (self.pos, self.in_calls, self.current)
            if self.in_calls:
                self._scan_calls(final, content, deltas)
            else:
                self._scan_text(final, content)
            if (self.pos, self.in_calls, self.current) == before:
                break
        if final and self.pos < len(self.buf):  # an unfinished region: its text is content
            content.append(self.buf[self.pos :])
            self.pos = len(self.buf)
        text = "".join(content)
        if text:
            self.wrote_content = True
        return text, _merge(deltas)

    def _scan_text(self, final: bool, content: list[str]) -> None:
        rest = self.buf[self.pos :]
        bare = self.bare_start
        if bare and not self.wrote_content and not content:
            stripped = rest.lstrip()
            if not stripped and not final:
                return  # only whitespace so far: it may still open with the bare start
            if stripped.startswith(bare):
                self.pos += len(rest) - len(stripped)
                self._enter(self.pos, trigger=False)
                return
        hits = [(rest.find(t), t) for t in self.triggers if t in rest]
        if hits:
            i, trigger = min(hits)
            content.append(rest[:i])
            self._enter(self.pos + i, trigger=True)
            self.pos += i + len(trigger)
            return
        hold = 0 if final else held_suffix(rest, self.triggers)
        if len(rest) - hold > 0:
            content.append(rest[: len(rest) - hold])
            self.pos += len(rest) - hold

    def _scan_calls(self, final: bool, content: list[str], deltas: list[dict]) -> None:
        if self.current is None:
            i = self.pos
            while i < len(self.buf) and self.buf[i].isspace():
                i += 1
            rest = self.buf[i:]
            if not final and any(len(g) > len(rest) and g.startswith(rest) for g in self.glue):
                return  # a glue token may still be being written
            for g in self.glue:
                if rest.startswith(g):
                    self.pos = i + len(g)
                    return
            if final and self.calls and any(g.startswith(rest) for g in self.glue):
                self.pos = len(self.buf)  # a closing tag cut off by max_tokens: not content
                return
            if not rest:
                self.pos = i
                return
            if rest[0] != "{":
                self._leave(i, content)  # text after the calls: content again
                return
            self.pos = i
            self.obj_start = i
            self.current = _Call(len(self.calls))
        c = self.current
        if c.name is None:
            m = _HEAD.match(self.buf, self.obj_start)
            if m is not None:
                c.name = json.loads(f'"{m.group(1)}"')
                c.args_start = c.args_sent = m.end()
        if c.args_start is not None:
            if not c.header_sent:
                deltas.append(
                    {
                        "index": c.index,
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.name, "arguments": ""},
                    }
                )
                c.header_sent = True
            end = json_value_end(self.buf, c.args_start)
            upto = len(self.buf) if end is None else end
            if upto > c.args_sent:
                deltas.append(
                    {"index": c.index, "function": {"arguments": self.buf[c.args_sent : upto]}}
                )
                c.args_sent = upto
            if end is not None:
                c.args = self.buf[c.args_start : end]
        obj_end = json_value_end(self.buf, self.obj_start)
        if obj_end is None and not final:
            return
        if c.header_sent:
            self._close(c, c.args if c.args is not None else self.buf[c.args_start : c.args_sent])
            self.pos = obj_end if obj_end is not None else len(self.buf)
            return
        whole = self.buf[self.obj_start : obj_end] if obj_end is not None else None
        call = _as_call(whole)
        if call is None and whole is None and (self.region_trigger or c.index > self.region[1]):
            self.current = None  # the start of a call, cut off before its name was whole
            self.pos = len(self.buf)
            return
        if call is None:  # not a call: it was content after all
            self.current = None
            self._leave(obj_end or len(self.buf), content, self.obj_start)
            return
        c.name, args = call
        deltas.append(
            {
                "index": c.index,
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": args},
            }
        )
        self._close(c, args)
        self.pos = obj_end  # type: ignore[assignment]

    def _enter(self, at: int, trigger: bool) -> None:
        self.in_calls = True
        self.region = (at, len(self.calls))
        self.region_trigger = trigger

    def _leave(self, at: int, content: list[str], upto: int | None = None) -> None:
        """Back to content at `at`. A region that held no call was content all along: its
        trigger and glue go out as text too (up to `at`, which text scanning takes next)."""
        start, calls_before = self.region
        if len(self.calls) == calls_before:
            content.append(self.buf[start:at])
        elif upto is not None:
            content.append(self.buf[upto:at])
        self.in_calls = False
        self.pos = at

    def _close(self, c: _Call, args: str) -> None:
        self.calls.append(
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": args}}
        )
        self.current = None


def _as_call(text: str | None) -> tuple[str, str] | None:
    """(name, arguments JSON) of a whole call object in any key order, else None."""
    if text is None:
        return None
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters"))
    if args is None:
        return None
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def _merge(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One delta per call index per chunk: later argument fragments join the first."""
    out: list[dict[str, Any]] = []
    for d in deltas:
        if out and out[-1]["index"] == d["index"]:
            out[-1]["function"]["arguments"] += d["function"].get("arguments", "")
        else:
            out.append({**d, "function": dict(d["function"])})
    return out
