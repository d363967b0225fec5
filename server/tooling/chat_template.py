"""Chat messages to prompt text: the chat template (the model's, or `--chat-template`), the
tools and `chat_template_kwargs` it is rendered with, and a conversation's tool turns.

Owns `ChatTemplate.render`: message dicts as templates expect them (an assistant turn's
`tool_calls` with their arguments as objects, a `tool` turn with its `tool_call_id`), the
request's tools passed to the template as `tools` (as transformers and vLLM pass them), and in
generic mode (the template knows no tools) the plan's system prompt added to the conversation,
calls written back and results wrapped as generic mode's format writes them
(`server.tooling.formats.GENERIC`: `<tool_call>` blocks, `<tool_response>` turns). Also the
check that every tool turn answers a call made before it (a 400 naming the field).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2

from models import Tokenizer
from models.tokenizer import render_chat_template
from server.errors import APIError
from server.tooling.formats import GENERIC, ToolFormat, detect
from server.tooling.plan import ToolPlan

# Template variables a request's chat_template_kwargs may not replace (the server sets them).
_RESERVED_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "chat_template"})


def load_chat_template(value: str) -> str:
    """`--chat-template`: a file's text, or the template text itself (it has a Jinja tag)."""
    path = Path(value)
    if "{" not in value:
        if not path.is_file():
            raise ValueError(f"--chat-template: no such file: {value}")
        return path.read_text(encoding="utf-8")
    return value


class ChatTemplate:
    """Renders chats for one tokenizer, with its template or an override."""

    def __init__(self, tokenizer: Tokenizer, override: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.source: str | None = override or tokenizer.chat_template
        self.override = override
        # The format the template itself renders calls in: how its tool turns are shaped.
        self.format, generic = detect(self.source)
        self.knows_tools = not generic

    def render(
        self,
        messages: list[Any],
        add_generation_prompt: bool,
        plan: ToolPlan | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> str:
        """`messages`: `server.openai.protocol.ChatMessage`s."""
        if not self.source:
            raise APIError(
                400, "this model has no chat template; use /v1/completions", param="messages"
            )
        check_tool_turns(messages)
        extra = dict(kwargs or {})
        bad = sorted(_RESERVED_KWARGS & extra.keys())
        if bad:
            raise APIError(
                400,
                f"chat_template_kwargs may not set {', '.join(bad)}",
                param="chat_template_kwargs",
                code="invalid_chat_template_kwargs",
            )
        generic = plan.generic if plan is not None else not self.knows_tools
        dicts = [_message_dict(m, generic, self.format) for m in messages]
        if not generic and self.format.one_call_per_turn:
            dicts = one_call_per_turn(dicts)
        tools = None
        if plan is not None and generic:
            dicts = _with_system(dicts, plan.system_prompt or "")
        elif plan is not None:
            tools = list(plan.tools)
        try:
            return self._apply(dicts, add_generation_prompt, tools, extra)
        except jinja2.TemplateError as e:  # raise_exception() in a template: roles out of order
            if generic and any(d["role"] == "tool" for d in dicts):
                # A template that refuses a "tool" role: the results as user turns instead.
                dicts = [{**d, "role": "user"} if d["role"] == "tool" else d for d in dicts]
                try:
                    return self._apply(dicts, add_generation_prompt, tools, extra)
                except jinja2.TemplateError:
                    pass
            raise APIError(
                400, f"the chat template rejected the messages: {e}", param="messages"
            ) from e
        except (TypeError, ValueError) as e:  # a kwarg or message the template cannot use
            raise APIError(
                400, f"the chat template could not render the messages: {e}", param="messages"
            ) from e

    def _apply(
        self, dicts: list[dict], add_generation_prompt: bool, tools: list | None, extra: dict
    ) -> str:
        if self.override is None and tools is None and not extra:
            return self.tokenizer.apply_chat_template(dicts, add_generation_prompt)
        hf = getattr(self.tokenizer, "hf", None)  # models.hf_tokenizer.HFTokenizer's
        if hf is not None:
            # transformers' renderer: the same globals (bos_token, raise_exception, ...) as the
            # tokenizer's own path, with the override, the tools and the kwargs.
            return hf.apply_chat_template(
                dicts,
                tools=tools,
                chat_template=self.source,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **extra,
            )
        # The tokenizer's own names for its special tokens (bos_token, ...), as its path passes them.
        names = getattr(self.tokenizer, "template_tokens", dict)()
        return render_chat_template(
            self.source, dicts, add_generation_prompt, tools=tools, **{**names, **extra}
        )


def check_tool_turns(messages: list[Any]) -> None:
    """Each `tool` message answers a call an earlier assistant message made (by id)."""
    called: set[str] = set()
    for i, m in enumerate(messages):
        if m.tool_calls:
            if m.role != "assistant":
                raise APIError(
                    400,
                    "only assistant messages carry tool_calls",
                    param=f"messages[{i}].tool_calls",
                    code="invalid_tools",
                )
            called.update(c.id for c in m.tool_calls)
        if m.role == "tool":
            if m.tool_call_id is None:
                raise APIError(
                    400,
                    "a tool message needs the tool_call_id of the call it answers",
                    param=f"messages[{i}].tool_call_id",
                    code="invalid_tools",
                )
            if m.tool_call_id not in called:
                raise APIError(
                    400,
                    f"tool_call_id {m.tool_call_id!r} matches no tool call of an earlier "
                    "assistant message",
                    param=f"messages[{i}].tool_call_id",
                    code="invalid_tools",
                )


def _arguments(text: str) -> Any:
    # Templates write arguments with `| tojson`: give them the object, not its JSON text.
    try:
        return json.loads(text)
    except ValueError:
        return text


def _message_dict(m: Any, generic: bool, fmt: ToolFormat) -> dict[str, Any]:
    d: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.name is not None:
        d["name"] = m.name
    if fmt.reasoning_key and m.reasoning_content and m.role == "assistant" and not generic:
        d[fmt.reasoning_key] = m.reasoning_content
        if m.tool_calls:
            # gpt-oss's template refuses a call turn with both: its reasoning is what it renders
            # (the analysis message before the call), a preamble has no place beside it.
            d["content"] = ""
    if generic:
        if m.tool_calls:
            blocks = [
                GENERIC.call_open
                + json.dumps(
                    {"name": c.function.name, GENERIC.args_key: _arguments(c.function.arguments)}
                )
                + GENERIC.call_close
                for c in m.tool_calls
            ]
            d["content"] = "\n".join(([d["content"]] if d["content"] else []) + blocks)
        if m.role == "tool":
            d["content"] = f"{GENERIC.result_open}{d['content']}{GENERIC.result_close}"
        return d
    if m.tool_calls:
        d["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {
                    "name": c.function.name,
                    "arguments": _arguments(c.function.arguments),
                },
            }
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    return d


def one_call_per_turn(dicts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For templates that render one call per assistant message and name a tool result by the
    call just before it (harmony): an assistant message with several calls becomes one message
    per call (its text and reasoning with the first), each followed by the result that answers
    it among the tool messages after it; results that answer none keep their place after."""
    out: list[dict[str, Any]] = []
    i = 0
    while i < len(dicts):
        d = dicts[i]
        calls = d.get("tool_calls") or []
        if len(calls) < 2:
            out.append(d)
            i += 1
            continue
        j = i + 1
        while j < len(dicts) and dicts[j]["role"] == "tool":
            j += 1
        results = dicts[i + 1 : j]
        for k, call in enumerate(calls):
            first = {**d, "tool_calls": [call]}
            out.append(
                first if k == 0 else {"role": "assistant", "content": "", "tool_calls": [call]}
            )
            answer = next((r for r in results if r.get("tool_call_id") == call["id"]), None)
            if answer is not None:
                out.append(answer)
                results = [r for r in results if r is not answer]
        out.extend(results)
        i = j
    return out


def _with_system(dicts: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """`text` added to the conversation's system message (a new one first if it has none)."""
    if dicts and dicts[0]["role"] in ("system", "developer"):
        first = dicts[0]
        joined = f"{first['content']}\n\n{text}" if first["content"] else text
        return [{**first, "content": joined}, *dicts[1:]]
    return [{"role": "system", "content": text}, *dicts]
