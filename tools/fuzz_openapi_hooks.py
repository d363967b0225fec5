"""Schemathesis hooks for tools/fuzz_openapi.sh (loaded through SCHEMATHESIS_HOOKS).

Schemathesis' `positive_data_acceptance` check fails on any schema-valid request the server
rejects. Two of the server's rules cannot be written as JSON Schema: a prompt's length in tokens
plus max_tokens within the context, and min_tokens <= max_tokens (one field bounded by another's
value; in chat without max_tokens, by what the prompt leaves of the context). Schemathesis has
no per-response way to mark such a rejection as expected; its only knob
(`expected-statuses`) would accept every 400 of an operation and hide real failures.

So the fuzz script runs this check instead of the built-in one: the built-in check itself, except
that a 400 whose OpenAI error `code` is one the operation's document lists under its 400
response as `x-unstated-rule-codes` (server.http.openapi.UNSTATED_RULE_CODES) counts as an expected
rejection. Any other 400 (or a 400 without such a code) is still a failure.
"""

from __future__ import annotations

import json
from typing import Any

import schemathesis
from schemathesis.specs.openapi.checks import positive_data_acceptance as _builtin


def _rule_codes(case: Any) -> set[str]:
    responses = case.operation.definition.raw.get("responses", {})
    return set(responses.get("400", {}).get("x-unstated-rule-codes", ()))


def _error_code(content: bytes) -> str | None:
    try:
        error = json.loads(content)["error"]
    except (ValueError, KeyError, TypeError):
        return None
    return error.get("code") if isinstance(error, dict) else None


@schemathesis.check
def positive_data_acceptance_unless_documented_rule(ctx, response, case):
    """The built-in positive_data_acceptance, but a 400 naming a documented unstated rule passes."""
    if response.status_code == 400 and _error_code(response.content) in _rule_codes(case):
        return None
    return _builtin(ctx, response, case)
