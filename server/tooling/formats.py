"""Tool-call formats: one table row per format, read by everything that writes, constrains,
recognises or parses tool calls.

A row holds a format's whole description: the `--tool-call-parser` name; the marks that tell
its chat templates apart (`detect`); what the streaming parser looks for (`server.tooling.parser`:
the trigger that opens the calls region, the glue between calls, a bare opening that starts
the region where the trigger is a special token a detokenizer drops); how one call is written
(its arguments' key, the text around a call and between two, or one JSON array of calls),
which is also the grammar that constrains calls (`server.tooling.plan`) and how generic mode
writes calls and results back into a conversation (`server.tooling.chat_template`).

The formats:

- `hermes`: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` per call (Qwen2.5,
  Hermes, SmolLM3 templates). Generic mode, for a template that renders no tools (SmolLM2's),
  is this format with the tools described in a system prompt.
- `llama3`: `{"name": ..., "parameters": {...}}` calls separated by `; ` (Llama 3.1/3.2 JSON
  tool calling).
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.
- `harmony` (gpt-oss): the output is a sequence of messages in channels, reasoning and answer
  included; a call is a `commentary` message to `functions.NAME` whose body is the arguments
  (`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`). Its
  text is read whole by `server.tooling.harmony` (the row's `reasoning` parser), not by the
  JSON-call scanner, from its special tokens kept in the text (`special_tokens`); its template
  renders one call per assistant message and names a tool result by the call just before it
  (`one_call_per_turn`), and reads an assistant turn's reasoning from `thinking`
  (`reasoning_key`).

A new format is one row in `FORMATS`. Light on imports: `python -m server --help` reads
`PARSER_CHOICES` without torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """One tool-call format (see the module docstring)."""

    name: str  # its `--tool-call-parser` name
    # A chat template that renders tools and holds one of these renders calls in this format
    # (hermes, without marks, is what remains).
    template_marks: tuple[str, ...]
    triggers: tuple[str, ...]  # text that opens the calls region
    glue: tuple[str, ...]  # text between call objects that belongs to the format, not the content
    bare_start: str | None  # opens the region when it is the first thing the model writes
    args_key: str  # the key of a call's arguments: "arguments" or "parameters"
    call_open: str  # text before each call object
    call_close: str  # text after it
    separator: str  # text between two calls
    array: bool = False  # the calls are one JSON array (no open, close or separator)
    # How generic mode writes a tool's result back into the conversation (hermes).
    result_open: str = ""
    result_close: str = ""
    # A format that names the function outside the arguments: the text before a call's
    # arguments, "{name}" standing for the function (the arguments are the JSON itself, no
    # call object; `call_close` follows them).
    call_head: str | None = None
    # Special tokens the format's text is structured by: kept in the text its parser reads
    # (a detokenizer drops them otherwise), written as special tokens in its grammar.
    special_tokens: tuple[str, ...] = ()
    # The `--reasoning-parser` the format implies (its output carries reasoning, content and
    # calls together), taken unless the server names another.
    reasoning: str | None = None
    # The message key the format's templates read an assistant turn's reasoning from.
    reasoning_key: str | None = None
    # Its templates render only the first call of an assistant message and name a tool result
    # by the call rendered just before it: calls go one per message, each followed by its result.
    one_call_per_turn: bool = False


HERMES = ToolFormat(
    name="hermes",
    template_marks=(),
    triggers=("<tool_call>",),
    glue=("<tool_call>", "</tool_call>"),
    bare_start=None,
    args_key="arguments",
    call_open="<tool_call>\n",
    call_close="\n</tool_call>",
    separator="\n",
    result_open="<tool_response>\n",
    result_close="\n</tool_response>",
)
LLAMA3 = ToolFormat(
    name="llama3",
    template_marks=("<|python_tag|>", "<|eom_id|>", "Environment: ipython"),
    triggers=("<|python_tag|>",),
    glue=("<|python_tag|>", ";"),
    bare_start="{",
    args_key="parameters",
    call_open="",
    call_close="",
    separator="; ",
)
MISTRAL = ToolFormat(
    name="mistral",
    template_marks=("[TOOL_CALLS]",),
    triggers=("[TOOL_CALLS]",),
    glue=("[TOOL_CALLS]", "[", ",", "]"),
    bare_start="[",
    args_key="arguments",
    call_open="",
    call_close="",
    separator="",
    array=True,
)
# The harmony special tokens (o200k_harmony: <|return|> 200002, <|constrain|> 200003,
# <|channel|> 200005, <|start|> 200006, <|end|> 200007, <|message|> 200008, <|call|> 200012).
HARMONY_TOKENS = (
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
    "<|return|>",
    "<|call|>",
)
HARMONY = ToolFormat(
    name="harmony",
    template_marks=("<|channel|>",),
    triggers=(),  # (parsed by server.tooling.harmony, channel by channel)
    glue=(),
    bare_start=None,
    args_key="",
    call_open="",
    call_close="<|call|>",
    separator="",
    call_head="<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>",
    special_tokens=HARMONY_TOKENS,
    reasoning="harmony",
    reasoning_key="thinking",
    one_call_per_turn=True,
)

# In the order a template is recognised (`detect`).
FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HARMONY, MISTRAL, LLAMA3, HERMES)}
# The format of generic mode: the tools are described in a system prompt, calls written as hermes.
GENERIC = HERMES
# `--tool-call-parser`: auto (from the chat template), a format, or generic mode.
PARSER_CHOICES = ("auto", *sorted(FORMATS), "generic")


def detect(template: str | None) -> tuple[ToolFormat, bool]:
    """(format, generic) for `--tool-call-parser auto`: the format the template itself renders
    calls in, or generic mode when it renders no tools at all."""
    t = template or ""
    if "tools" not in t:
        return GENERIC, True
    marked = (f for f in FORMATS.values() if any(mark in t for mark in f.template_marks))
    return next(marked, HERMES), False


def resolve(option: str, template: str | None) -> tuple[ToolFormat, bool]:
    """(format, generic) for the server's `--tool-call-parser` and chat template."""
    if option == "auto":
        return detect(template)
    if option == "generic":
        return GENERIC, True
    return FORMATS[option], detect(template)[1]


def implied_reasoning(option: str, template: str | None) -> str | None:
    """The reasoning parser the format of `--tool-call-parser` and the chat template implies
    (harmony's), or None."""
    return resolve(option, template)[0].reasoning


def held_suffix(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that begins one of `markers`: text a streaming
    parser holds back, since it may still become the marker."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), 0, -1):
            if text.endswith(m[:k]):
                best = max(best, k)
                break
    return best
