"""What llguidance is given, without torch: grammar specs, their grammar text, the parser's limits,
and the vocabulary as plain data.

Owns `StructuredSpec` (what a request's output must match) and its JSON Schema handling
(`closed_objects`, `rebase_refs`), `grammar_text` (a spec -> llguidance's grammar string),
`PARSER_LIMITS` (the bounds every untrusted grammar is compiled and matched within),
`Vocabulary` (a tokenizer's tokens as llguidance reads them, picklable, so a process without the
model or torch can build the same token trie: the grammar check worker,
`server.grammars.check_worker`) and `client_message` (llguidance's error text as a client may see it).

The step path (masks, constraints) and the compile cache are `engine.structured`'s; this module
imports neither torch nor a tokenizer library, so the check worker starts light.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from engine.errors import InvalidRequestError

SpecKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]

# JSON as models write it (json.dumps' separators, no free whitespace): a small model given
# "any whitespace" tends to emit newlines forever instead of closing the object.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# Bounds on what one untrusted grammar may cost, in llguidance's own terms; hitting one puts the
# matcher in an error state (a 400 at compile time, an error for the choice mid-generation),
# never unbounded work. Per mask: lexer fuel ~14k/ms and Earley items ~20k/ms, so a step's mask
# stays within ~15 ms whatever the grammar (a schema as clients write them needs a fraction of
# a millisecond). Lexer states cost 1-2 kB each and are built lazily as a generation goes: 20k
# keeps one grammar under ~40 MB (llguidance's default, 250k, allows half a gigabyte). Errors
# without the parser's state and grammar text (`verbose_errors`): they go to clients.
PARSER_LIMITS: dict[str, Any] = {
    "max_items_in_row": 2_000,
    "initial_lexer_fuel": 1_000_000,
    "step_lexer_fuel": 200_000,
    "step_max_items": 50_000,
    "max_lexer_states": 20_000,
    "max_grammar_size": 500_000,
    "verbose_errors": False,
}


def parser_limits() -> Any:
    """`PARSER_LIMITS` as llguidance takes them."""
    import llguidance

    return llguidance.LLParserLimits(**PARSER_LIMITS)


# -- JSON Schema ------------------------------------------------------------------------------------

# JSON nesting (objects and arrays) one schema may have. llguidance reads a schema with a nesting
# limit of 128 and the server wraps a tool's parameters a few levels deep; walking deeper
# schemas here would also run out of Python's recursion.
MAX_SCHEMA_DEPTH = 100


def json_depth(value: Any) -> int:
    """How deeply `value` nests objects and arrays (a scalar: 0), without recursion."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def check_schema_depth(schema: Any, param: str) -> None:
    """`InvalidRequestError` for a schema nested deeper than `MAX_SCHEMA_DEPTH`."""
    if json_depth(schema) > MAX_SCHEMA_DEPTH:
        raise InvalidRequestError(
            f"the JSON schema nests too deeply (more than {MAX_SCHEMA_DEPTH} levels of objects "
            "and arrays)",
            param,
        )


# Keywords whose value is a subschema or a list of them (items is either, by draft), or a map of
# names to subschemas.
_SUBSCHEMA = (
    "additionalProperties", "items", "additionalItems", "unevaluatedItems", "contains",
    "propertyNames", "not", "if", "then", "else", "anyOf", "oneOf", "allOf", "prefixItems",
    "unevaluatedProperties",
)  # fmt: skip
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# An object schema with one of these says itself what other properties may hold (or takes part in
# an intersection that does): it is left as it is.
_OPEN_BY_OTHER_MEANS = (
    "additionalProperties", "patternProperties", "unevaluatedProperties", "allOf", "$ref",
)  # fmt: skip


def _map_subschemas(schema: dict[str, Any], fn: Callable[[Any, str], Any]) -> dict[str, Any]:
    """A copy of `schema` with `fn(subschema, keyword)` applied to each direct subschema; other
    values (`const`, `enum`, `default`, ...: data, not schemas) as they are."""
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: fn(sub, key) for name, sub in value.items()}
        elif key in _SUBSCHEMA and isinstance(value, list):
            out[key] = [fn(sub, key) for sub in value]
        elif key in _SUBSCHEMA:
            out[key] = fn(value, key)
        else:
            out[key] = value
    return out


def closed_objects(schema: Any, in_all_of: bool = False) -> Any:
    """A copy of `schema` in which every object schema that lists its properties and says nothing
    of others allows no others (`"additionalProperties": false`), as llama.cpp's and vLLM's
    (xgrammar's strict mode) grammars read such a schema. JSON Schema itself would allow any
    other property, and a small model given that room writes made-up keys, repeats them, and runs
    out of tokens before it closes the object. A schema that wants other properties says so
    (`"additionalProperties": true` or a schema); members of an allOf are left open (closing one
    would forbid the properties another lists)."""
    if not isinstance(schema, dict):
        return schema
    out = _map_subschemas(schema, lambda sub, key: closed_objects(sub, in_all_of=key == "allOf"))
    props = schema.get("properties")
    if (
        not in_all_of
        and isinstance(props, dict)
        and props
        and not any(key in schema for key in _OPEN_BY_OTHER_MEANS)
    ):
        out["additionalProperties"] = False
    return out


def rebase_refs(schema: Any, base: str) -> Any:
    """A copy of `schema` whose local `$ref`s ("#", "#/$defs/X", any "#/pointer") point into the
    same document placed at JSON pointer `base` of a larger one ("#/$defs/X" with base
    "/$defs/t0" becomes "#/$defs/t0/$defs/X"). So a schema embedded in another (a tool's
    parameters inside a call's schema) keeps meaning what its author wrote: its `$defs` and its
    root are its own. Anchors ("#name") and other documents' refs are left as they are."""
    if not isinstance(schema, dict):
        return schema
    out = _map_subschemas(schema, lambda sub, key: rebase_refs(sub, base))
    ref = schema.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = "#" + base + ref[1:]
    return out


@dataclass(frozen=True, slots=True)
class StructuredSpec:
    """What a request's output must match. `value`: the schema (JSON text, in the client's key
    order: properties are generated in that order), the
    regex, the choices (a JSON list), or the grammar text; unused for json_object."""

    kind: SpecKind
    value: str = ""
    param: str = "response_format"  # the request field named in a 400

    @classmethod
    def json_schema(cls, schema: Any, param: str = "response_format") -> StructuredSpec:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise InvalidRequestError(f"the JSON schema is not valid JSON: {e}", param) from e
        if not isinstance(schema, dict | bool):
            raise InvalidRequestError("a JSON schema must be an object", param)
        check_schema_depth(schema, param)
        try:
            text = json.dumps(closed_objects(schema), allow_nan=False)
        except ValueError as e:  # NaN or infinity: not JSON
            raise InvalidRequestError(
                "the JSON schema holds a number JSON cannot carry", param
            ) from e
        return cls("json_schema", text, param)

    @property
    def what(self) -> str:
        """The spec's kind in a client's words ("JSON schema", "regex", ...)."""
        return {
            "json_schema": "JSON schema",
            "json_object": "JSON object format",
            "regex": "regex",
            "choice": "choice list",
            "grammar": "grammar",
        }[self.kind]


def grammar_text(spec: StructuredSpec) -> str:
    """llguidance's grammar for `spec` (not compiled: `LLMatcher` does that).
    `InvalidRequestError` for a spec that does not even convert (bad JSON, bad GBNF)."""
    import llguidance

    M = llguidance.LLMatcher
    try:
        if spec.kind == "json_schema":
            return M.grammar_from_json_schema(spec.value, overrides=JSON_OPTIONS)
        if spec.kind == "json_object":
            return M.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
        if spec.kind == "regex":
            return M.grammar_from_regex(spec.value)
        if spec.kind == "choice":
            choices = json.loads(spec.value)
            return M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
        return llguidance.grammar_from("grammar", spec.value)  # Lark or GBNF
    except (ValueError, TypeError, RecursionError) as e:
        raise InvalidRequestError(
            f"invalid {spec.what}: {client_message(str(e))}", spec.param
        ) from e


# -- error text -------------------------------------------------------------------------------------

# What a Rust panic or a backtrace looks like: never shown to a client.
_INTERNALS = re.compile(
    r"panic|backtrace|RUST_BACKTRACE|<unknown>|\.rs:\d+|^\s*\d+: 0x[0-9a-f]+", re.M | re.I
)
_DUMPS = re.compile(r"<(state|grammar)>.*?(</\1>|$)|<non-verbose/>", re.S)


def client_message(text: str, limit: int = 300) -> str:
    """llguidance's error `text` as a 400 may carry it: its first statement without the parser
    state or grammar dumps, on one line, capped; a panic or backtrace becomes a plain sentence."""
    if _INTERNALS.search(text):
        return "the grammar library could not process it"
    text = " ".join(_DUMPS.sub(" ", text).split())
    if len(text) > limit:
        text = text[: limit - 3].rstrip() + "..."
    return text or "rejected"


def constraint_error(matcher: Any, what: str = "grammar") -> str:
    """An `llguidance.LLMatcher`'s error state in a client's words (`what`: "grammar", "JSON
    schema", ...): it matches nothing from here (a dead end: every way on was ruled out), or it
    needs more than the server's limits allow, or what llguidance says."""
    reason = matcher.stop_reason()
    text = matcher.get_error()
    if reason in ("NoExtension", "NoExtensionBias") or "NoExtension" in text:
        return f"the {what} allows no further output here (no text can complete it)"
    if reason in ("LexerTooComplex", "ParserTooComplex") or _LIMIT_HIT.search(text):
        return (
            f"the {what} needs more work per token than the server's parser limits allow (a "
            "rule or $ref that only ever expands into itself does this)"
        )
    return f"the {what} failed: {client_message(text)}"


_LIMIT_HIT = re.compile(r"too many|fuel|too complex|TooComplex|limit", re.I)


# -- the vocabulary ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Vocabulary:
    """A tokenizer as llguidance reads it, as plain data: each token's bytes (a special token as
    0xFF and its name, so a Lark grammar can name `<|im_end|>`), or, for a vocabulary without
    bytes of its own, the `tokenizers` JSON llguidance parses itself."""

    size: int
    eos: tuple[int, ...]
    bos: int | None = None
    tokens: tuple[bytes, ...] | None = None
    specials: tuple[int, ...] = ()
    serialized: str | None = None

    def ll_tokenizer(self, encode: Callable[[str], list[int]] | None = None) -> Any:
        """llguidance's tokenizer. `encode` tokenizes text as the model does (llguidance calls
        it for forced tokens); without one, llguidance's greedy tokenization over the same
        tokens stands in (the check worker: masks are the same, only forced-token splits may
        differ)."""
        import llguidance

        if self.tokens is None:
            return llguidance.LLTokenizer(
                self.serialized, n_vocab=self.size, eos_token=list(self.eos)
            )
        built: list[Any] = []
        vocab = self

        def tokenize(text: str | bytes) -> list[int]:
            if isinstance(text, bytes):
                text = text.decode("utf-8", errors="replace")
            if encode is not None:
                return encode(text)
            return built[0].greedy_tokenize(text) if built else []

        class _Vocab:
            eos_token_id = vocab.eos[0]
            bos_token_id = vocab.bos
            special_token_ids = list(vocab.specials)
            tokens = list(vocab.tokens)

            def __call__(self, text: str | bytes) -> list[int]:
                return tokenize(text)

        tok = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_Vocab()), eos_token=list(self.eos)
        )
        built.append(tok)
        return tok


def vocabulary(tokenizer: Any, vocab_size: int) -> Vocabulary:
    """The `Vocabulary` of one of our tokenizers (`models.tokenizer.Tokenizer`)."""
    eos = tuple(tokenizer.eos_token_ids)
    hf = getattr(tokenizer, "hf", None)
    if hf is not None:  # models.hf_tokenizer.HFTokenizer: a fast transformers tokenizer
        from copy import copy

        backend = copy(hf.backend_tokenizer)  # as llguidance.hf.from_tokenizer reads it
        backend.no_padding()
        backend.no_truncation()
        return Vocabulary(vocab_size, eos, serialized=backend.to_str())
    if tokenizer.token_bytes(0) is None:
        serialized = getattr(tokenizer, "serialized", None)
        if serialized is None:
            raise InvalidRequestError(
                "structured output needs a tokenizer whose tokens have known bytes",
                "response_format",
            )
        return Vocabulary(vocab_size, eos, serialized=serialized())
    # Tokens with bytes of their own (byte-level BPE, TinyGPT's bytes, SentencePiece pieces):
    # llguidance keeps only these and its trie. Ids without bytes are special.
    tokens: list[bytes] = []
    specials: list[int] = []
    names: set[bytes] = set()
    for i in range(vocab_size):
        piece = tokenizer.token_bytes(i)
        if not piece:
            specials.append(i)
            piece = _special_name(tokenizer, i, names)
        tokens.append(piece)
    return Vocabulary(vocab_size, eos, tokenizer.bos_token_id, tuple(tokens), tuple(specials), None)


def _special_name(tokenizer: Any, token_id: int, taken: set[bytes]) -> bytes:
    """A special token as llguidance names it: 0xFF and its text, or `<special_N>` for one
    without text of its own or whose text is taken."""
    try:
        text = tokenizer.decode([token_id], skip_special_tokens=False).encode()
    except (IndexError, OverflowError, TypeError, ValueError):
        text = b""
    if not text or text in taken:
        text = b"<special_%d>" % token_id
    taken.add(text)
    return b"\xff" + text
