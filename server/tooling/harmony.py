"""gpt-oss's harmony output read as messages: reasoning, content and tool calls, in deltas.

Owns `HarmonyStream`, the `harmony` reasoning parser (`server.tooling.formats.HARMONY` implies
it): text in, with harmony's special tokens kept in it (`special_ids` says which ids the
detokenizer keeps), (reasoning delta, content delta, OpenAI tool-call deltas) out. The text
after the prompt's `<|start|>assistant` is a sequence of messages, each a header up to
`<|message|>` (` to=RECIPIENT`, `<|channel|>CHANNEL`, ` <|constrain|>json` in either order) and
a body up to `<|end|>` (the turn goes on: `<|start|>assistant` opens the next message),
`<|call|>` or `<|return|>` (the turn ends; as stop tokens they are cut from the text, so the
end of the text ends the message too). A message's body goes, as it arrives, to:

- a tool call, when it is addressed to `functions.NAME` (and the request has tools): its id,
  type and name in the first delta, then fragments of the arguments text, which join to the
  call's `arguments`;
- reasoning, from the `analysis` channel (or addressed to a built-in tool, which is the
  model's own work, not the user's answer);
- content, from `final` and from `commentary` without a recipient (a preamble the user sees).

Special tokens never reach content or reasoning: a header is consumed whole, a stray marker in
a body is dropped. Text that may still become a marker is held back. An output that never
writes a header (no harmony at all) is content once it ends. This reads text, so a marker the
model spells out of ordinary tokens reads as one; the published tokenizer encodes each marker
as one special token, which is what the model writes.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from server.tooling.formats import HARMONY_TOKENS, held_suffix
from server.tooling.parser import new_call_id

if TYPE_CHECKING:
    from models import Tokenizer

START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL = HARMONY_TOKENS
FUNCTIONS = "functions."
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
# What ends a message's body; a <|start|> or <|channel|> the model writes without closing the
# message first opens the next one (it belongs to that header, so it is not consumed).
_BODY_ENDS = (END, RETURN, CALL)
_NEXT_HEADER = (START, CHANNEL)


def special_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """The ids of harmony's special tokens in `tokenizer` (each encodes to one id), for the
    detokenizer to keep their text; empty for a vocabulary without them."""
    ids = []
    for marker in HARMONY_TOKENS:
        encoded = tokenizer.encode(marker)
        if len(encoded) == 1:
            ids.append(encoded[0])
    return frozenset(ids) if len(ids) == len(HARMONY_TOKENS) else frozenset()


class _Call:
    __slots__ = ("index", "id", "name", "args")

    def __init__(self, index: int, name: str) -> None:
        self.index = index
        self.id = new_call_id()
        self.name = name
        self.args = ""


class HarmonyStream:
    """One choice's harmony parser. `feed` each text delta (`final` with the last)."""

    def __init__(self, tools: bool) -> None:
        self.tools = tools  # the request has tools: calls are calls (else their text is reasoning)
        self.buf = ""
        self.in_body = False
        self.kind = "content"  # where the open message's body goes: reasoning, content or call
        self.call: _Call | None = None
        self.started = False  # the open message has written body text
        self.wrote = {"reasoning": False, "content": False}
        self.calls: list[dict[str, Any]] = []  # finished calls, OpenAI's message shape

    def feed(self, text: str, final: bool = False) -> tuple[str, str, list[dict[str, Any]]]:
        self.buf += text
        out: dict[str, list[str]] = {"reasoning": [], "content": []}
        deltas: list[dict[str, Any]] = []
        while True:
            if not self.in_body:
                i = self.buf.find(MESSAGE)
                if i < 0:
                    if final:
                        self._unfinished_header(out)
                    break
                self._open(self.buf[:i], deltas)
                self.buf = self.buf[i + len(MESSAGE) :]
                self.in_body = True
                continue
            hits = [(self.buf.find(m), m) for m in _BODY_ENDS + _NEXT_HEADER if m in self.buf]
            if hits:
                i, marker = min(hits)
                self._body(self.buf[:i], out, deltas)
                self._close()
                self.buf = self.buf[i + (0 if marker in _NEXT_HEADER else len(marker)) :]
                continue
            hold = 0 if final else held_suffix(self.buf, HARMONY_TOKENS)
            self._body(self.buf[: len(self.buf) - hold], out, deltas)
            self.buf = self.buf[len(self.buf) - hold :]
            if final:
                self._close()
            break
        return "".join(out["reasoning"]), "".join(out["content"]), deltas

    # -- messages --------------------------------------------------------------------------------

    def _open(self, header: str, deltas: list[dict[str, Any]]) -> None:
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL.search(header)
        to = recipient.group(1) if recipient else None
        self.started = False
        if to is not None and to.startswith(FUNCTIONS) and self.tools:
            self.kind = "call"
            self.call = _Call(len(self.calls), to[len(FUNCTIONS) :])
            deltas.append(
                {
                    "index": self.call.index,
                    "id": self.call.id,
                    "type": "function",
                    "function": {"name": self.call.name, "arguments": ""},
                }
            )
        elif to is not None or (channel is not None and channel.group(1) == "analysis"):
            self.kind = "reasoning"
        else:  # final, a commentary preamble, or a channel harmony does not name
            self.kind = "content"

    def _body(self, text: str, out: dict[str, list[str]], deltas: list[dict[str, Any]]) -> None:
        for marker in (MESSAGE, CONSTRAIN):  # stray structure: never part of the text
            text = text.replace(marker, "")
        if not self.started:
            text = text.lstrip() if self.kind == "call" else text
            if not text:
                return
            self.started = True
            if self.kind != "call" and self.wrote[self.kind]:
                text = "\n" + text  # a second message of the same kind: a line between them
        if not text:
            return
        if self.kind == "call":
            assert self.call is not None
            self.call.args += text
            deltas.append({"index": self.call.index, "function": {"arguments": text}})
            return
        out[self.kind].append(text)
        self.wrote[self.kind] = True

    def _close(self) -> None:
        c = self.call
        if c is not None:
            self.calls.append(
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.args}}
            )
        self.call = None
        self.in_body = False
        self.kind = "content"

    def _unfinished_header(self, out: dict[str, list[str]]) -> None:
        """The end of the text before a header closed: a header cut off (by max_tokens) is
        dropped; text without any harmony marker is the model answering outside the format,
        and is content."""
        rest, self.buf = self.buf, ""
        if rest and not any(m in rest for m in HARMONY_TOKENS):
            out["content"].append(rest)
            self.wrote["content"] = True
