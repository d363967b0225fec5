"""What a chat request's tools mean before anything reaches the engine.

Owns `plan_tools`, which checks a request's tools in one pass and returns its `ToolPlan` (the
checked tools, `tool_choice` as a mode, the call format, and what follows from them: the
llguidance grammar that constrains the output and, in generic mode, the system prompt that
describes the tools; a small frozen value that pickles, so it can cross a Ray handle, the
grammar compiled where the engine runs) with one grammar spec per tool's parameters for the
server to check. The 400s that need more than one field are raised here: an unknown named
function, two tools with one name, `tool_choice` without tools, parameters that are not an
object schema or nest too deeply.

The formats are `server.tooling.formats`' rows. `tool_choice` "required" and a named function
constrain the output to calls whose arguments match each tool's schema (always, `strict` or not:
a call that does not parse is of no use); "auto" constrains only generic mode (either a reply or
calls); "none" ignores the tools. `parallel_tool_calls: false` allows one call. llama-server's
generic mode wraps a reply in JSON as well (`{"response": ...}`); a reply here stays plain
text, so it streams as it comes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from engine.errors import InvalidRequestError
from engine.grammar import StructuredSpec, check_schema_depth, closed_objects, rebase_refs
from server.errors import APIError
from server.tooling.formats import FORMATS, GENERIC, ToolFormat, resolve

# Calls one answer may hold when parallel calls are allowed: bounds what a grammar lets a model
# ramble into (each call is complete, so the answer parses however many it writes).
MAX_PARALLEL_CALLS = 8
# JSON as models write it, as engine.structured.JSON_OPTIONS (free whitespace lets a small model
# emit newlines forever instead of closing the object).
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """A chat request's tools as the server acts on them. `grammar` and `system_prompt` follow
    from the other fields (left None, they are derived when the plan is made)."""

    tools: tuple[dict[str, Any], ...]  # {"type": "function", "function": {...}} as given
    mode: Literal["auto", "required", "named"]
    named: str | None  # the function `tool_choice` names
    parallel: bool
    format: str  # a `server.tooling.formats.FORMATS` name
    generic: bool  # the template knows no tools: they are described in a system prompt
    grammar: str | None = None  # llguidance Lark text constraining the output, or None
    system_prompt: str | None = None  # generic mode's description of the tools

    def __post_init__(self) -> None:
        if self.grammar is None:
            object.__setattr__(self, "grammar", tool_grammar(self))
        if self.system_prompt is None and self.generic:
            object.__setattr__(self, "system_prompt", generic_system_prompt(self))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t["function"]["name"] for t in self.tools)


def plan_tools(
    req: Any, option: str, template: str | None
) -> tuple[ToolPlan | None, list[StructuredSpec]]:
    """The request's `ToolPlan` (None when it calls no tools: none given, or `tool_choice:
    "none"`), and one `StructuredSpec` per tool whose `parameters` are given, for the server to
    check (out of process) whatever `tool_choice` says. `req` is a
    `server.openai.protocol.ChatCompletionRequest`; `option` the server's `--tool-call-parser`.
    400s name the field."""
    choice = req.tool_choice
    if not req.tools:
        if choice is not None and choice not in ("none", "auto"):
            raise APIError(
                400,
                "tool_choice requires tools: give the functions it may call",
                param="tool_choice",
                code="invalid_tools",
            )
        return None, []
    tools: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, tool in enumerate(req.tools):
        f = tool.function
        if f.name in seen:
            raise APIError(
                400,
                f"two tools are named {f.name!r}",
                param=f"tools[{i}].function.name",
                code="invalid_tools",
            )
        seen.add(f.name)
        param = f"tools[{i}].function.parameters"
        entry: dict[str, Any] = {"name": f.name, "parameters": _checked(f.parameters, param)}
        if f.description is not None:
            entry["description"] = f.description
        if f.strict is not None:
            entry["strict"] = f.strict
        tools.append({"type": "function", "function": entry})
    if choice == "none":
        return None, _parameter_specs(req)
    named = None
    mode: Literal["auto", "required", "named"] = "auto"
    if choice == "required":
        mode = "required"
    elif choice is not None and choice != "auto":
        named = choice.function.name
        if named not in seen:
            raise APIError(
                400,
                f"tool_choice names the function {named!r}, which is not among the tools "
                f"({', '.join(sorted(seen))})",
                param="tool_choice.function.name",
                code="invalid_tools",
            )
        mode = "named"
    fmt, generic = resolve(option, template)
    plan = ToolPlan(tuple(tools), mode, named, req.parallel_tool_calls, fmt.name, generic)
    return plan, _parameter_specs(req)


def _checked(params: dict[str, Any] | None, param: str) -> dict[str, Any]:
    """A tool's `parameters`: a JSON Schema for an object (whether llguidance compiles it is the
    out-of-process check's). Absent: any object (OpenAI's meaning)."""
    if params is None or params == {}:
        return {"type": "object", "properties": {}}
    kind = params.get("type", "object")
    if kind != "object":
        raise APIError(
            400,
            f"a function's parameters must be a JSON Schema of type object, not {kind!r}",
            param=param,
            code="invalid_tools",
        )
    try:
        check_schema_depth(params, param)
    except InvalidRequestError as e:
        raise APIError(400, str(e), param=param, code="invalid_tools") from e
    return params


def _parameter_specs(req: Any) -> list[StructuredSpec]:
    """One spec per tool whose `parameters` are given: the schema as its own root, named by its
    field."""
    specs = []
    for i, tool in enumerate(req.tools):
        if params := tool.function.parameters:
            param = f"tools[{i}].function.parameters"
            try:
                specs.append(StructuredSpec.json_schema(params, param))
            except InvalidRequestError as e:
                raise APIError(400, str(e), param=param, code="invalid_tools") from e
    return specs


# -- the prompt of generic mode ---------------------------------------------------------------------


def generic_system_prompt(plan: ToolPlan) -> str:
    """Tells a model whose template knows no tools what it may call and how (generic mode's
    format). The grammar holds it to that; the prompt is what makes its choices sensible."""
    lines = ["You can call these functions (tools):"]
    for t in plan.tools:
        f = t["function"]
        desc = f" {f['description']}" if f.get("description") else ""
        lines.append(f"- {f['name']}:{desc} Arguments (JSON Schema): {json.dumps(f['parameters'])}")
    call = f'{{"name": "<function name>", "{GENERIC.args_key}": {{<arguments>}}}}'
    example = f"{GENERIC.call_open}{call}{GENERIC.call_close}"
    if plan.mode == "named":
        lines.append(f"Call the function {plan.named} now, answering only with:\n{example}")
    elif plan.mode == "required":
        lines.append(f"Call one of them now, answering only with:\n{example}")
    else:
        lines.append(
            "To call a function, answer only with this (one block per call):\n"
            f"{example}\nOtherwise answer the user directly."
        )
    if not plan.parallel:
        lines.append("Call at most one function.")
    return "\n".join(lines)


# -- grammars ---------------------------------------------------------------------------------------


def _defs_key(plan: ToolPlan, name: str) -> str:
    """Where a tool's parameters sit in a grammar's schema: `#/$defs/<this>`."""
    return f"parameters_{plan.names.index(name)}"


def call_schema(plan: ToolPlan, name: str) -> dict[str, Any]:
    """The JSON Schema of one call object of `name`, in the plan's format. Its arguments are a
    reference to the tool's parameters, which `tool_defs` places in the root's `$defs`."""
    args_key = FORMATS[plan.format].args_key
    return {
        "type": "object",
        "properties": {
            "name": {"const": name},
            args_key: {"$ref": f"#/$defs/{_defs_key(plan, name)}"},
        },
        "required": ["name", args_key],
        "additionalProperties": False,
    }


def tool_defs(plan: ToolPlan, names: list[str]) -> dict[str, Any]:
    """The `$defs` of a grammar's schema: each named tool's parameters, kept whole as their own
    document (their `$defs` / `definitions`, and "#" itself, still mean what the client wrote:
    the refs are rebased onto where the parameters sit), objects closed as elsewhere."""
    defs = {}
    for name in names:
        key = _defs_key(plan, name)
        params = next(
            t["function"]["parameters"] for t in plan.tools if t["function"]["name"] == name
        )
        defs[key] = rebase_refs(closed_objects(params), f"/$defs/{key}")
    return defs


def tool_grammar(plan: ToolPlan) -> str | None:
    """The Lark grammar (llguidance's dialect: `%json` embeds a schema) the output must match,
    or None where the output is free (native formats under "auto"). Its shape is the format's
    row: each call between its open and close text, separated by its separator, or all calls
    one JSON array."""
    if plan.mode == "auto" and not plan.generic:
        return None
    fmt = FORMATS[plan.format]
    names = [plan.named] if plan.mode == "named" else list(plan.names)
    if fmt.call_head is not None:
        return _headed_grammar(plan, fmt, names)
    one = {"anyOf": [call_schema(plan, n) for n in names]} if len(names) > 1 else None
    schema = one or call_schema(plan, names[0])
    defs = tool_defs(plan, names)
    schema = {**schema, "$defs": defs, "x-guidance": JSON_STYLE}
    more = MAX_PARALLEL_CALLS - 1 if plan.parallel and plan.mode != "named" else 0
    if fmt.array:
        items = {k: v for k, v in schema.items() if k not in ("$defs", "x-guidance")}
        array = {"type": "array", "items": items, "minItems": 1, "maxItems": more + 1}
        calls = f"calls: %json {_dumps({**array, '$defs': defs, 'x-guidance': JSON_STYLE})}"
        return f"start: calls\n{calls}\n"
    around = [_literal(fmt.call_open)] if fmt.call_open else []
    around += ["%json", _dumps(schema)] + ([_literal(fmt.call_close)] if fmt.call_close else [])
    call = "call: " + " ".join(around)
    sep = _literal(fmt.separator)
    seq = f"calls: call ({sep} call){{0,{more}}}" if more else "calls: call"
    if plan.mode == "auto":  # generic mode: a reply (not starting with a call's "<") or calls
        start = "start: calls | REPLY\nREPLY: /[^<\\s](.|\\n)*/"
    else:
        start = "start: calls"
    return f"{start}\n{seq}\n{call}\n"


def _headed_grammar(plan: ToolPlan, fmt: ToolFormat, names: list[str]) -> str:
    """The grammar of a format that names the function outside its arguments (harmony): one
    call, its head naming one of `names`, then the arguments as that tool's parameters, then
    the format's close. One call only: the close of a call ends the turn (harmony's <|call|> is
    a stop token), so parallel calls come one turn at a time."""
    alternatives = []
    for name in names:
        key = _defs_key(plan, name)
        schema = {
            "$ref": f"#/$defs/{key}",
            "$defs": tool_defs(plan, [name]),
            "x-guidance": JSON_STYLE,
        }
        head = _tokens(fmt.call_head.format(name=name), fmt)  # type: ignore[union-attr]
        alternatives.append(f"{head} %json {_dumps(schema)} {_tokens(fmt.call_close, fmt)}")
    rules = "\n".join(f"call_{i}: {a}" for i, a in enumerate(alternatives))
    return f"start: {' | '.join(f'call_{i}' for i in range(len(names)))}\n{rules}\n"


def _tokens(text: str, fmt: ToolFormat) -> str:
    """`text` as Lark items: the format's special tokens bare (llguidance matches the token
    itself, `<|channel|>`), the rest as string literals."""
    if not fmt.special_tokens:
        return _literal(text)
    pattern = "(" + "|".join(re.escape(t) for t in fmt.special_tokens) + ")"
    parts = [p for p in re.split(pattern, text) if p]
    return " ".join(p if p in fmt.special_tokens else _literal(p) for p in parts)


def _literal(text: str) -> str:
    """A Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text)


def _dumps(schema: dict[str, Any]) -> str:
    return json.dumps(schema, allow_nan=False)
