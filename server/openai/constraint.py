"""The one grammar that constrains a request's output, from its fields.

Owns the mapping from a request's `response_format` ({"type": "json_object"} or {"type":
"json_schema", "json_schema": {"schema": ...}}), vLLM's `structured_outputs` ({"json" | "regex" |
"choice" | "grammar" | "json_object"}) and its older `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar` to one `engine.structured.StructuredSpec` (at most one may be
given: two are a 400), and `constraint_spec`, the one place a chat request's tool grammar
(`server.tooling.plan`) and its structured output meet: a plan with a grammar takes the place of
structured output, and asking for both is a 400. The spec is checked and compiled by
`server.grammars.compiler`.
"""

from __future__ import annotations

import json

from engine.errors import InvalidRequestError
from engine.grammar import StructuredSpec
from server.errors import APIError, grammar_error_code
from server.openai.protocol import SamplingFields
from server.tooling.plan import ToolPlan


def constraint_spec(req: SamplingFields, plan: ToolPlan | None = None) -> StructuredSpec | None:
    """The grammar of the request's output: its tool plan's, else the structured output it asks
    for, else None. A 400 naming the field for a spec that cannot be made, or for a request with
    a tool grammar that also asks for structured output of its own."""
    if plan is None or plan.grammar is None:
        try:
            return structured_spec(req)
        except InvalidRequestError as e:
            raise APIError(400, str(e), param=e.param, code=grammar_error_code(e.param)) from e
    if structured_spec(req) is not None:
        raise APIError(
            400,
            "response_format (or another structured-output field) cannot be combined with "
            f"tool_choice {plan.mode!r}" + (" in generic tool mode" if plan.mode == "auto" else ""),
            param="tool_choice",
            code="invalid_tools",
        )
    return StructuredSpec("grammar", plan.grammar, "tools")


def structured_spec(req: SamplingFields) -> StructuredSpec | None:
    """The one grammar a request asks for, or None."""
    found: list[StructuredSpec] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(StructuredSpec("json_object"))
    elif rf is not None and rf.type == "json_schema":
        schema = rf.json_schema.schema_ if rf.json_schema is not None else None
        if schema is None:  # a named format without a schema: any JSON object
            found.append(StructuredSpec("json_object"))
        else:
            found.append(StructuredSpec.json_schema(schema, "response_format"))
    so = req.structured_outputs
    if so is not None:
        if so.json_ is not None:
            found.append(StructuredSpec.json_schema(so.json_, "structured_outputs"))
        if so.regex is not None:
            found.append(StructuredSpec("regex", so.regex, "structured_outputs"))
        if so.choice is not None:
            found.append(StructuredSpec("choice", json.dumps(so.choice), "structured_outputs"))
        if so.grammar is not None:
            found.append(StructuredSpec("grammar", so.grammar, "structured_outputs"))
        if so.json_object:
            found.append(StructuredSpec("json_object", "", "structured_outputs"))
    if req.guided_json is not None:
        found.append(StructuredSpec.json_schema(req.guided_json, "guided_json"))
    if req.guided_regex is not None:
        found.append(StructuredSpec("regex", req.guided_regex, "guided_regex"))
    if req.guided_choice is not None:
        found.append(StructuredSpec("choice", json.dumps(req.guided_choice), "guided_choice"))
    if req.guided_grammar is not None:
        found.append(StructuredSpec("grammar", req.guided_grammar, "guided_grammar"))
    if len(found) > 1:
        raise InvalidRequestError(
            "give at most one of response_format (json_object / json_schema), "
            "structured_outputs and guided_json / guided_regex / guided_choice / guided_grammar",
            found[1].param,
        )
    return found[0] if found else None
