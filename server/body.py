"""What every request body model shares: `Text`, a string that can become UTF-8, and `_Body`,
the strict pydantic base (OpenAI's types, unknown fields ignored). `server.protocol` and
`server.tool_protocol` build their bodies from these.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict


def _valid_unicode(value: str) -> str:
    """JSON may carry a lone surrogate escape ("\\ud800"): valid JSON, but not text. It cannot be
    encoded to UTF-8, so it would fail in the tokenizer, the log, or the error body echoing it."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"contains invalid Unicode (a lone surrogate at position {e.start})"
        ) from None
    return value


# Every client string that can reach a tokenizer, a log line or an error body is `Text`.
Text = Annotated[str, AfterValidator(_valid_unicode)]


class _Body(BaseModel):
    # strict: booleans and integers must be JSON booleans and integers, as OpenAI requires
    # ("stream": "yes" and "max_tokens": "5" are 400s, not coerced); an integer is still a
    # valid float. No NaN or infinity (Python's JSON parser accepts them).
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
