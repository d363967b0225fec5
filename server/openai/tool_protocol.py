"""The request bodies of tool calling (pydantic, at the HTTP boundary): function tools, the
`tool_choice` field, and the tool calls an assistant message carries back.

Owns what `tools`, `tool_choice` and a message's `tool_calls` may look like on the wire (OpenAI's
chat shapes). What they mean (which tool may be called, the prompt, the grammar, the 400s that
need more than one field) is `server.tooling.plan`'. `server.openai.protocol` imports these types into its
chat request; this module imports nothing of the server, so that it can.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from server.openai.body import Body, JSONObject, Text

# OpenAI's rule for function names: what a template, a prompt and a grammar literal can carry.
FUNCTION_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
MAX_TOOLS = 128  # OpenAI's limit on tools in one request


FunctionName = Annotated[str, Field(pattern=FUNCTION_NAME_PATTERN)]


class FunctionDefinition(Body):
    name: FunctionName
    description: Text | None = None
    # A JSON Schema for the arguments object; absent: any object. Checked by server.tooling.plan.
    parameters: JSONObject | None = None
    strict: bool | None = None


class ToolDefinition(Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionRef(Body):
    name: FunctionName


class NamedToolChoice(Body):
    """`{"type": "function", "function": {"name": ...}}`: call this function."""

    type: Literal["function"]
    function: FunctionRef


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolCallFunction(Body):
    name: Text
    arguments: Text  # a JSON text, as the model wrote it


class ToolCallParam(Body):
    """A call in an assistant message of the conversation so far."""

    id: Text = Field(min_length=1)
    type: Literal["function"] = "function"
    function: ToolCallFunction


Tools = Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)]
