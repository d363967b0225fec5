"""`<think>` reasoning split out of a choice's text, as vLLM and llama-server return it
(`reasoning_content`), for `--reasoning-parser`.

Owns `ReasoningSplit`: text in, (reasoning delta, content delta) out, holding back what may still
become a tag. The parsers (`REASONING_PARSERS`): `qwen3` (reasoning only when the output opens
with `<think>`) and `deepseek_r1` (the output starts inside the reasoning: its template opens
`<think>` in the prompt, so everything up to `</think>` is reasoning); and `harmony` (gpt-oss:
the `analysis` channel is the reasoning), whose channels also carry the answer and the tool
calls, so it is read whole by `server.tooling.harmony` instead of this split, and is what a
harmony chat template implies (`server.tooling.formats.implied_reasoning`). Light on imports:
`python -m server --help` reads the names.
"""

from __future__ import annotations

from server.tooling.formats import held_suffix

REASONING_PARSERS = ("deepseek_r1", "harmony", "qwen3")
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
                hold = 0 if final else held_suffix(self.buf, (_CLOSE, _OPEN))
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
