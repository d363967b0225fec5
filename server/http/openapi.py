"""The OpenAPI document (/openapi.json) as the server really behaves.

FastAPI's generated document says 422 with its own error shape for an invalid body; this server
answers 400 with OpenAI's error object (`server.errors`). It also cannot know that a completion
streams as `text/event-stream`, that /metrics is Prometheus text, or the limits that depend on
the served model. `install_openapi` post-processes the generated document once, so generated
clients and fuzzers (schemathesis) see the statuses, media types and limits the server uses,
and the cross-field rules it can state cheaply: a body the document accepts is one the server
accepts, except for the rules in `UNSTATED_RULE_CODES`, whose 400s say so in their `code`.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from server.openai.embeddings import MAX_INPUTS
from server.openai.protocol import MAX_CHOICES, MAX_PROMPTS, ModelCard

_ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
_ERROR_SCHEMA = {
    "type": "object",
    "title": "ErrorResponse",
    "description": "OpenAI's error object.",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
# Rules the document does not state: no JSON Schema keyword can (a bound that depends on another
# field's value, or on the prompt's length in tokens), or it could only as alternatives that
# multiply with those in `_cross_field_rules` past what schemathesis' generator handles (prompts
# x n, one per value of n; at most one of seven structured-output fields). Their 400s carry
# these `code`s (the document lists them on the generation routes' 400 as
# `x-unstated-rule-codes`), so a client or a fuzzer can tell such a rejection from a schema the
# server does not keep (tools/fuzz_openapi_hooks.py does).
UNSTATED_RULE_CODES = {
    "context_length_exceeded": "the prompt's tokens plus max_tokens exceed the context length",
    "min_tokens_exceeds_max_tokens": "min_tokens is more than max_tokens (or, in chat without "
    "max_tokens, than what the context leaves after the prompt)",
    "too_many_choices": f"the number of prompts times n is more than {MAX_CHOICES}",
    # A string's content, and "at most one of" the seven structured-output fields (JSON Schema
    # could say that, but as alternatives that multiply with the rules in `_cross_field_rules`
    # past what schemathesis' generator can handle).
    "invalid_structured_output": "a grammar, regex or JSON schema (response_format, "
    "structured_outputs, guided_*) that does not parse or compile, that exceeds the server's "
    "limits on compiling and matching a grammar, or that no text can complete (a dead end "
    "reached mid-generation fails the request the same way), or more than one of them",
    # Tool calling (server.tooling.plan): rules between fields and inside a tool's JSON Schema.
    "invalid_tools": "a tool's parameters schema that does not compile or is not an object, two "
    "tools with one name, tool_choice naming a function not among the tools or given without "
    "tools (or with response_format), a tool message that answers no earlier call",
    "invalid_chat_template_kwargs": "chat_template_kwargs setting messages, tools, "
    "add_generation_prompt or chat_template",
    # What one request may make the server compute and send (server.openai.serving, --response-budget)
    "response_too_large": "logprobs (prompt and generated, with their top alternatives, over "
    "every choice) or embedded input tokens beyond the server's response budget",
}
_REASONS = {
    400: "Invalid request: a bad field value, malformed JSON or bad Unicode. Rules this document "
    "does not state name themselves in `code`: "
    + "; ".join(f"`{code}`: {why}" for code, why in UNSTATED_RULE_CODES.items())
    + ".",
    401: "Missing or wrong API key (when the server has one).",
    404: "Unknown model.",
    413: "Request body over the size limit.",
    429: "The engine's queue is full; retry after Retry-After seconds.",
    500: "Internal error; the message names the request id.",
    503: "The engine is unavailable or the server is shutting down.",
}
# Error statuses each route can answer with, beyond what every route can (500).
_ROUTE_ERRORS: dict[str, tuple[int, ...]] = {
    "/v1/completions": (400, 401, 404, 413, 429, 503),
    "/v1/chat/completions": (400, 401, 404, 413, 429, 503),
    "/v1/responses": (400, 401, 404, 413, 429, 503),
    "/v1/embeddings": (400, 401, 404, 413, 429, 503),
    "/tokenize": (400, 401, 404, 413),
    "/detokenize": (400, 401, 404, 413),
    "/v1/models": (401,),
    "/v1/models/{model_id}": (401, 404),
    "/health": (503,),
}
_STREAMING = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
# Each event's data is a chunk object or an error object, and the last is `[DONE]`: no one
# schema fits every event, so none is given.
_SSE = {"schema": {"description": "Server-sent events: chunks, then data: [DONE]"}}


def install_openapi(app: FastAPI, card: ModelCard, vocab_size: int) -> None:
    """Make `app.openapi()` return the corrected document (built once, then cached)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _fix(generate(), card, vocab_size)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _fix(doc: dict[str, Any], card: ModelCard, vocab_size: int) -> dict[str, Any]:
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    schemas["ErrorResponse"] = _ERROR_SCHEMA
    for path, ops in doc.get("paths", {}).items():
        for op in ops.values():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            for status in (*_ROUTE_ERRORS.get(path, ()), 500):
                responses[str(status)] = {
                    "description": _REASONS[status],
                    "content": {"application/json": {"schema": _ERROR_REF}},
                }
            if path in _STREAMING:
                responses["200"]["content"]["text/event-stream"] = _SSE
                responses["400"]["x-unstated-rule-codes"] = sorted(UNSTATED_RULE_CODES)
            if path == "/metrics":
                responses["200"]["content"] = {"text/plain": {"schema": {"type": "string"}}}
    _limits(schemas, card, vocab_size)
    embedding_limits(schemas, card.max_model_len, vocab_size)
    _cross_field_rules(schemas)
    return doc


def _limits(schemas: dict[str, Any], card: ModelCard, vocab_size: int) -> None:
    """Limits the request models cannot state statically: the served model's context length and
    vocabulary, the prompt-count limit that applies to lists of text prompts only, and
    /tokenize's "exactly one of prompt or messages"."""
    for name, fields in (
        ("CompletionRequest", ("max_tokens",)),
        ("ChatCompletionRequest", ("max_tokens", "max_completion_tokens")),
    ):
        props = schemas.get(name, {}).get("properties", {})
        for field in fields:
            for member in props.get(field, {}).get("anyOf", []):
                if member.get("type") == "integer":
                    member["maximum"] = card.max_model_len
    prompt = schemas.get("CompletionRequest", {}).get("properties", {}).get("prompt", {})
    for member in prompt.get("anyOf", []):
        if member.get("type") != "array":
            continue
        member["minItems"] = 1  # an empty prompt list, or an empty token-id prompt, is a 400
        items = member.get("items", {})
        if items.get("type") == "integer":
            member["maxItems"] = card.max_model_len
            _token_id(items, vocab_size)
        else:  # text prompts, or token-id prompts
            member["maxItems"] = MAX_PROMPTS
            if items.get("type") == "array":
                items["minItems"] = 1
                _token_id(items.get("items", {}), vocab_size)
    for name, field in (("DetokenizeRequest", "tokens"), ("CompletionRequest", "stop_token_ids")):
        prop = schemas.get(name, {}).get("properties", {}).get(field, {})
        for member in [prop, *prop.get("anyOf", [])]:
            if member.get("type") == "array":
                _token_id(member.get("items", {}), vocab_size)
    for name in ("ChatCompletionRequest",):
        prop = schemas.get(name, {}).get("properties", {}).get("stop_token_ids", {})
        for member in prop.get("anyOf", []):
            if member.get("type") == "array":
                _token_id(member.get("items", {}), vocab_size)
    # Accepted for compatibility but unsupported unless empty: suffix (completions).
    suffix = schemas.get("CompletionRequest", {}).get("properties", {}).get("suffix")
    if suffix is not None:
        suffix["anyOf"] = [m for m in suffix.get("anyOf", []) if m.get("type") == "null"]
    # logit_bias keys are token ids written in decimal (server.openai.sampling_params.TOKEN_ID_KEY), its
    # values biases in [-100, 100] (OpenAI's range; engine.SamplingParams checks it).
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        bias = schemas.get(name, {}).get("properties", {}).get("logit_bias", {})
        for member in bias.get("anyOf", []):
            if member.get("type") == "object":
                member["propertyNames"] = {"pattern": token_id_pattern(vocab_size - 1)}
                member["additionalProperties"] = {"type": "number", "minimum": -100, "maximum": 100}
    # response_format: type "json_schema" needs its json_schema object.
    response_format = schemas.get("ResponseFormatParam")
    if response_format is not None:
        json_schema = response_format.get("properties", {}).get("json_schema", {})
        given = [m for m in json_schema.get("anyOf", []) if m.get("type") != "null"]
        response_format["anyOf"] = [
            {"properties": {"type": {"enum": ["text", "json_object"]}}},
            {"required": ["json_schema"], "properties": {"json_schema": given[0]}},
        ]
    # The Responses API is stateless (server.openai.responses): no store, no previous response.
    responses = schemas.get("ResponsesRequest", {}).get("properties", {})
    if "store" in responses:
        responses["store"] = {"anyOf": [{"const": False}, {"type": "null"}], "title": "Store"}
    if "previous_response_id" in responses:
        responses["previous_response_id"] = {"type": "null", "title": "Previous Response Id"}
    tokenize = schemas.get("TokenizeRequest")
    if tokenize is not None:  # exactly one of the two is given and not null
        tokenize["oneOf"] = [
            {"required": [field], "properties": {field: {"type": kind}}}
            for field, kind in (("prompt", "string"), ("messages", "array"))
        ]


def _either(*branches: tuple[str, Any, bool]) -> dict[str, Any]:
    """A body that satisfies one of `branches`, each "field has this schema" (`required`: and
    is present)."""
    return {
        "anyOf": [
            {"properties": {field: schema}, **({"required": [field]} if required else {})}
            for field, schema, required in branches
        ]
    }


def _cross_field_rules(schemas: dict[str, Any]) -> None:
    """The request models' cross-field rules, so that a schema-valid body is one the server
    accepts (schemathesis' positive_data_acceptance):

    - `stream_options` needs `stream: true` (OpenAI and vLLM reject it otherwise);
    - chat `top_logprobs` needs `logprobs: true` (as vLLM);
    - completions `max_tokens: 0` needs `echo: true` (the prompt's logprobs alone).

    Each is an `anyOf` of two plain branches ("null or absent" / "the other field set") rather
    than `if`/`then`: the same set of bodies, but with no `not` (the implied `else` of an `if`),
    which schemathesis' generator can rarely satisfy; each rule doubles the branches it
    canonicalises, and past about 32 it gives up on the operation ("Schemathesis does not
    support this part of it"), so a rule is only written here when it is cheap.
    """
    null = {"type": "null"}
    stream_rule = _either(("stream_options", null, False), ("stream", {"const": True}, True))
    rules = {
        "CompletionRequest": [
            stream_rule,
            _either(("max_tokens", {"minimum": 1}, False), ("echo", {"const": True}, True)),
        ],
        "ChatCompletionRequest": [
            stream_rule,
            _either(("top_logprobs", null, False), ("logprobs", {"const": True}, True)),
        ],
    }
    for name, conditions in rules.items():
        if name in schemas:
            schemas[name].setdefault("allOf", []).extend(conditions)


def token_id_pattern(largest: int) -> str:
    """A regular expression for the decimal numbers 0..`largest`, without leading zeros."""
    top = str(largest)
    alternatives = []
    if len(top) > 1:
        alternatives.append("[0-9]")
    alternatives += [f"[1-9][0-9]{{{k - 1}}}" for k in range(2, len(top))]
    for i, digit in enumerate(top):  # numbers of top's length, below it from digit i on
        low = 1 if i == 0 and len(top) > 1 else 0
        high = int(digit) - 1
        if high >= low:
            rest = len(top) - i - 1
            alternatives.append(top[:i] + f"[{low}-{high}]" + (f"[0-9]{{{rest}}}" if rest else ""))
    alternatives.append(top)
    return "^(?:" + "|".join(alternatives) + ")$"


def embedding_limits(schemas: dict[str, Any], max_model_len: int, vocab_size: int) -> None:
    """The served model's limits on /v1/embeddings' `input`."""
    prop = schemas.get("EmbeddingRequest", {}).get("properties", {}).get("input", {})
    for member in prop.get("anyOf", []):
        if member.get("type") != "array":
            continue
        member["minItems"] = 1
        items = member.get("items", {})
        if items.get("type") == "integer":
            member["maxItems"] = max_model_len
            _token_id(items, vocab_size)
        else:
            member["maxItems"] = MAX_INPUTS
            if items.get("type") == "array":
                items["minItems"] = 1
                items["maxItems"] = max_model_len
                _token_id(items.get("items", {}), vocab_size)


def _token_id(schema: dict[str, Any], vocab_size: int) -> None:
    schema["minimum"] = 0
    schema["maximum"] = vocab_size - 1
