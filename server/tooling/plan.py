"""What a chat request's tools mean before anything reaches the engine.

Owns `ToolPlan` (a request's checked tools, its `tool_choice` as a mode, the call format and
parser, and the grammar that constrains the output: a small frozen value that pickles, so it can
cross a Ray handle, the grammar compiled where the engine runs), the 400s that need more than
one field (an unknown named function, a schema that does not compile, two tools with one
name, `tool_choice` without tools), the system prompt of generic mode, and the llguidance
grammars.

Formats (the `--tool-call-parser` names; `auto` picks one from the chat template):

- `hermes`: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` per call (Qwen2.5,
  Hermes, SmolLM3 templates).
- `llama3`: `{"name": ..., "parameters": {...}}` calls separated by `; ` (Llama 3.1/3.2 JSON
  tool calling).
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.
- generic mode, for a template that knows no tools (SmolLM2's): the tools are described in a
  system prompt (`generic_system_prompt`) and the model answers in the `hermes` format, with the
  output constrained to either a reply or calls. llama-server's generic mode wraps the reply in
  JSON as well (`{"response": ...}`); a reply here stays plain text, so it streams as it comes.

`tool_choice` "required" and a named function constrain the output to calls whose arguments
match each tool's schema (always, `strict` or not: a call that does not parse is of no use);
"auto" constrains only generic mode (either a reply or calls); "none" ignores the tools.
`parallel_tool_calls: false` allows one call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from engine.errors import InvalidRequestError
from engine.grammar import StructuredSpec, check_schema_depth, closed_objects, rebase_refs
from server.errors import APIError

ToolFormat = Literal["hermes", "llama3", "mistral"]
# Calls one answer may hold when parallel calls are allowed: bounds what a grammar lets a model
# ramble into (each call is complete, so the answer parses however many it writes).
MAX_PARALLEL_CALLS = 8
# JSON as models write it, as engine.structured.JSON_OPTIONS (free whitespace lets a small model
# emit newlines forever instead of closing the object).
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """A chat request's tools as the server acts on them."""

    tools: tuple[dict[str, Any], ...]  # {"type": "function", "function": {...}} as given
    mode: Literal["auto", "required", "named"]
    named: str | None  # the function `tool_choice` names
    parallel: bool
    format: ToolFormat
    generic: bool  # the template knows no tools: they are described in a system prompt
    grammar: str | None  # llguidance Lark text constraining the output, or None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t["function"]["name"] for t in self.tools)


def template_format(template: str | None) -> tuple[ToolFormat, bool]:
    """(format, generic) for `--tool-call-parser auto`: the format the template itself renders
    calls in, or hermes in generic mode when it renders no tools at all."""
    t = template or ""
    if "tools" not in t:
        return "hermes", True
    if "[TOOL_CALLS]" in t:
        return "mistral", False
    if "<|python_tag|>" in t or "<|eom_id|>" in t or "Environment: ipython" in t:
        return "llama3", False
    return "hermes", False


def resolve_format(option: str, template: str | None) -> tuple[ToolFormat, bool]:
    if option == "auto":
        return template_format(template)
    if option == "generic":
        return "hermes", True
    return option, template_format(template)[1]  # type: ignore[return-value]


def plan_tools(req: Any, option: str, template: str | None) -> ToolPlan | None:
    """The request's `ToolPlan`, or None when it calls no tools (none given, or
    `tool_choice: "none"`). `req` is a `server.openai.protocol.ChatCompletionRequest`; `option` the
    server's `--tool-call-parser`. 400s name the field. The tools are checked whatever
    `tool_choice` says; their schemas compile in `parameter_specs`' checks."""
    choice = req.tool_choice
    if not req.tools:
        if choice is not None and choice not in ("none", "auto"):
            raise APIError(
                400,
                "tool_choice requires tools: give the functions it may call",
                param="tool_choice",
                code="invalid_tools",
            )
        return None
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
        params = _check_parameters(f.parameters, f"tools[{i}].function.parameters")
        entry: dict[str, Any] = {"name": f.name, "parameters": params}
        if f.description is not None:
            entry["description"] = f.description
        if f.strict is not None:
            entry["strict"] = f.strict
        tools.append({"type": "function", "function": entry})
    if choice == "none":
        return None
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
    fmt, generic = resolve_format(option, template)
    plan = ToolPlan(tuple(tools), mode, named, req.parallel_tool_calls, fmt, generic, None)
    grammar = tool_grammar(plan)
    return ToolPlan(tuple(tools), mode, named, req.parallel_tool_calls, fmt, generic, grammar)


def _check_parameters(params: dict[str, Any] | None, param: str) -> dict[str, Any]:
    """A tool's `parameters`: a JSON Schema for an object (whether llguidance compiles it is
    `parameter_specs`' check). Absent: any object (OpenAI's meaning)."""
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


def parameter_specs(req: Any) -> list[StructuredSpec]:
    """One spec per tool whose `parameters` are given: the schema as its own root, named by its
    field, for the server to check (out of process: `server.grammars.compiler`) and compile, whatever
    `tool_choice` says."""
    specs = []
    for i, tool in enumerate(req.tools or ()):
        params = tool.function.parameters
        if params:
            param = f"tools[{i}].function.parameters"
            try:
                specs.append(StructuredSpec.json_schema(params, param))
            except InvalidRequestError as e:
                raise APIError(400, str(e), param=param, code="invalid_tools") from e
    return specs


# -- the prompt of generic mode ---------------------------------------------------------------------


def generic_system_prompt(plan: ToolPlan) -> str:
    """Tells a model whose template knows no tools what it may call and how (the hermes
    format). The grammar holds it to that; the prompt is what makes its choices sensible."""
    lines = ["You can call these functions (tools):"]
    for t in plan.tools:
        f = t["function"]
        desc = f" {f['description']}" if f.get("description") else ""
        lines.append(f"- {f['name']}:{desc} Arguments (JSON Schema): {json.dumps(f['parameters'])}")
    example = '<tool_call>\n{"name": "<function name>", "arguments": {<arguments>}}\n</tool_call>'
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
    args_key = "parameters" if plan.format == "llama3" else "arguments"
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
    or None where the output is free (native formats under "auto")."""
    if plan.mode == "auto" and not plan.generic:
        return None
    names = [plan.named] if plan.mode == "named" else list(plan.names)
    one = {"anyOf": [call_schema(plan, n) for n in names]} if len(names) > 1 else None
    schema = one or call_schema(plan, names[0])
    defs = tool_defs(plan, names)
    schema = {**schema, "$defs": defs, "x-guidance": _JSON_STYLE}
    more = MAX_PARALLEL_CALLS - 1 if plan.parallel and plan.mode != "named" else 0
    if plan.format == "mistral":
        items = {k: v for k, v in schema.items() if k not in ("$defs", "x-guidance")}
        array = {"type": "array", "items": items, "minItems": 1, "maxItems": more + 1}
        calls = f"calls: %json {_dumps({**array, '$defs': defs, 'x-guidance': _JSON_STYLE})}"
        return f"start: calls\n{calls}\n"
    if plan.format == "llama3":
        call = f"call: %json {_dumps(schema)}"
        sep = '"; "'
    else:
        call = f'call: "<tool_call>\\n" %json {_dumps(schema)} "\\n</tool_call>"'
        sep = '"\\n"'
    seq = f"calls: call ({sep} call){{0,{more}}}" if more else "calls: call"
    if plan.mode == "auto":  # generic mode: a reply (not starting with a call's "<") or calls
        start = "start: calls | REPLY\nREPLY: /[^<\\s](.|\\n)*/"
    else:
        start = "start: calls"
    return f"{start}\n{seq}\n{call}\n"


def _dumps(schema: dict[str, Any]) -> str:
    return json.dumps(schema, allow_nan=False)


def tool_structured_spec(plan: ToolPlan | None, req: Any) -> Any:
    """The `engine.structured.StructuredSpec` of a plan's grammar (None: no grammar). A request
    that also asks for structured output of its own cannot have both: a 400."""
    if plan is None or plan.grammar is None:
        return None
    from server.grammars.compiler import structured_spec

    if structured_spec(req) is not None:
        raise APIError(
            400,
            "response_format (or another structured-output field) cannot be combined with "
            f"tool_choice {plan.mode!r}" + (" in generic tool mode" if plan.mode == "auto" else ""),
            param="tool_choice",
            code="invalid_tools",
        )
    return StructuredSpec("grammar", plan.grammar, "tools")
