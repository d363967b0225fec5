"""What every request body model shares: `Text`, a string that can become UTF-8, `JSONObject`, a
free-form JSON object (a schema, template arguments) whose every key and value can be sent back,
and `Body`, the strict pydantic base (OpenAI's types, unknown fields ignored).
`server.openai.protocol`, `server.openai.tool_protocol` and `server.openai.responses` build their bodies from
these.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict


def _valid_unicode(value: str) -> str:
    """JSON may carry a lone surrogate escape ("\\ud800"): valid JSON, but not text. It cannot be
    encoded to UTF-8, so it would fail in the tokenizer, the log, or the error body echoing it."""
    if value.isascii():  # the common case, and a 4 MB prompt's check in a tenth of the time
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"contains invalid Unicode (a lone surrogate at position {e.start})"
        ) from None
    return value


# Every client string that can reach a tokenizer, a log line or an error body is `Text`.
Text = Annotated[str, AfterValidator(_valid_unicode)]


def _valid_json(value: Any) -> Any:
    """Free-form JSON as the server can use and send back: no lone surrogate in any key or
    string (they cannot be encoded), no NaN or infinity (Python's JSON parser takes them; JSON
    has none). Walked without recursion: nesting is as deep as the body parser allowed."""
    stack = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, dict):
            for key, sub in item.items():
                where = f"{path}.{key}" if path else str(key)
                if isinstance(key, str):
                    _check_text(key, path or "the object", "a key")
                stack.append((sub, where))
        elif isinstance(item, list):
            stack.extend((sub, f"{path}[{i}]") for i, sub in enumerate(item))
        elif isinstance(item, str):
            _check_text(item, path or "the object", "a string")
        elif isinstance(item, float) and not math.isfinite(item):
            raise ValueError(f"{path or 'a value'}: {item} is not a JSON number")
    return value


def _check_text(text: str, where: str, what: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{what} in {where} contains invalid Unicode (a lone surrogate at position {e.start})"
        ) from None


# A free-form JSON object from a client (a JSON Schema, tool parameters, template arguments).
JSONObject = Annotated[dict[str, Any], AfterValidator(_valid_json)]


class Body(BaseModel):
    # strict: booleans and integers must be JSON booleans and integers, as OpenAI requires
    # ("stream": "yes" and "max_tokens": "5" are 400s, not coerced); an integer is still a
    # valid float. No NaN or infinity (Python's JSON parser accepts them).
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
