"""Structured output: grammars that constrain which tokens a request may sample.

Two halves, split by where they run:

- Off the step path (the HTTP side, in a worker thread): `GrammarCompiler` turns a
  `StructuredSpec` (a JSON schema, "any JSON object", a regex, a list of choices, a Lark/GBNF
  grammar) into a compiled grammar with llguidance, caches it by spec, and hands out one fresh
  `GrammarConstraint` (an `llguidance.LLMatcher`, copied from the cached one) per choice. A bad
  spec raises `InvalidRequestError` there, before anything reaches the engine.
- On the step path (the sampler and the engine): a `Request` carries its constraint; each step
  `apply_constraints` asks every constrained row for its allowed-token bitmask and sets the rest
  of that row's logits to -inf (other rows are not touched), and `EngineBase._append_token` feeds
  the sampled token back (`accept`), ending the request when the grammar is complete.

Why llguidance (not xgrammar): one 3 MB abi3 wheel with no dependencies, where xgrammar pulls in
triton and apache-tvm-ffi; it builds its token trie from our own tokenizers (a `tokenizers`
JSON for SmolLM2's converted GGUF tokenizer, each token's raw bytes for TinyGPT's byte tokenizer
and Gemma's SentencePiece one); grammars
compile lazily in about a millisecond, so there is nothing to precompute per schema; and a mask
for SmolLM2's 49k vocabulary takes well under a millisecond on one core. vLLM, SGLang and
llama.cpp's server use it as a backend too.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch

from engine.errors import InvalidRequestError

if TYPE_CHECKING:
    from engine.request import RequestState
    from models.tokenizer import Tokenizer

SpecKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]

# JSON as models write it (json.dumps' separators, no free whitespace): a small model given
# "any whitespace" tends to emit newlines forever instead of closing the object.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


# Keywords whose value is a subschema or a list of them (items is either, by draft), or a map of
# names to subschemas.
_SUBSCHEMA = (
    "additionalProperties", "items", "additionalItems", "unevaluatedItems", "contains",
    "propertyNames", "not", "if", "then", "else", "anyOf", "oneOf", "allOf", "prefixItems",
)  # fmt: skip
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# An object schema with one of these says itself what other properties may hold (or takes part in
# an intersection that does): it is left as it is.
_OPEN_BY_OTHER_MEANS = (
    "additionalProperties", "patternProperties", "unevaluatedProperties", "allOf", "$ref",
)  # fmt: skip


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
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: closed_objects(sub) for name, sub in value.items()}
        elif key in _SUBSCHEMA and isinstance(value, list):
            out[key] = [closed_objects(sub, in_all_of=key == "allOf") for sub in value]
        elif key in _SUBSCHEMA:
            out[key] = closed_objects(value)  # a non-schema value comes back as it is
        else:
            out[key] = value
    props = schema.get("properties")
    if (
        not in_all_of
        and isinstance(props, dict)
        and props
        and not any(key in schema for key in _OPEN_BY_OTHER_MEANS)
    ):
        out["additionalProperties"] = False
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
        try:
            text = json.dumps(closed_objects(schema))
        except RecursionError as e:  # far deeper than a grammar compiles (llguidance stops at 128)
            raise InvalidRequestError("the JSON schema nests too deeply", param) from e
        return cls("json_schema", text, param)


class TokenConstraint(Protocol):
    """Per-request grammar state, as the sampler and engine use it."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-token bits into `bitmask[row]` (int32, 32 tokens a word)."""
        ...

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the grammar rejects it."""
        ...

    @property
    def is_finished(self) -> bool:
        """The grammar is complete: nothing but end-of-sequence may follow."""
        ...


# -- the step path ---------------------------------------------------------------------------------

# Bit k of a 32-bit word; bit 31 wraps to -2**31 in int32, which is the bit pattern we need.
_BITS = (1 << torch.arange(32, dtype=torch.int64)).to(torch.int32)


def disallowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """(R, ceil(V/32)) int32 bits -> (R, vocab) bool, True where a token is NOT allowed; tokens
    past the mask are not allowed."""
    rows, words = bitmask.shape
    off = ((bitmask.unsqueeze(-1) & _BITS) == 0).view(rows, words * 32)
    if words * 32 >= vocab:
        return off[:, :vocab]
    return torch.cat([off, torch.ones(rows, vocab - words * 32, dtype=torch.bool)], dim=1)


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """(R, ceil(V/32)) int32 bits -> (R, vocab) bool, True where a token is allowed."""
    return ~disallowed_tokens(bitmask, vocab)


def apply_constraints(logits: torch.Tensor, states: Sequence[RequestState]) -> torch.Tensor | None:
    """Mask each constrained row's disallowed tokens to -inf, in place; unconstrained rows are
    not touched. Returns the disallowed-token mask of the constrained rows, in row order (None
    if there are none), so the sampler can fall back to it if later processing masks every
    allowed token."""
    rows = [i for i, s in enumerate(states) if s.constraint is not None]
    if not rows:
        return None
    vocab = logits.shape[1]
    bitmask = torch.zeros(len(rows), (vocab + 31) // 32, dtype=torch.int32)
    for j, i in enumerate(rows):
        states[i].constraint.fill_bitmask(bitmask, j)
    off = disallowed_tokens(bitmask, vocab)
    # Row by row on views, in place: gathering and scattering logits[rows] costs 10x more.
    for j, i in enumerate(rows):
        logits[i].masked_fill_(off[j], float("-inf"))
    return off


# -- off the step path: compiling -----------------------------------------------------------------


class GrammarConstraint:
    """One request's grammar state: an llguidance matcher."""

    __slots__ = ("matcher", "words")

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self.matcher = matcher
        self.words = (vocab_size + 31) // 32  # the mask llguidance writes: the tokenizer's vocab

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        v = bitmask[row]
        if v.numel() < self.words:
            raise ValueError(f"bitmask row of {v.numel()} words, the grammar needs {self.words}")
        # Writes the row's words in place (llguidance releases the GIL meanwhile); words past
        # the tokenizer's vocabulary (a padded output layer) stay 0: never allowed.
        self.matcher.unsafe_compute_mask_ptr(v.data_ptr(), self.words * 4)

    def accept(self, token_id: int) -> bool:
        return self.matcher.consume_token(token_id)

    @property
    def is_finished(self) -> bool:
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()


def _ll_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> Any:
    """llguidance's view of one of our tokenizers."""
    import llguidance

    eos = list(tokenizer.eos_token_ids)
    hf = getattr(tokenizer, "hf", None)
    if hf is not None:  # models.hf_tokenizer.HFTokenizer: a fast transformers tokenizer
        import llguidance.hf

        return llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=eos)
    if tokenizer.token_bytes(0) is None:
        # a vocabulary without bytes of its own: llguidance reads the Rust tokenizer itself
        # (models.saved_tokenizer.SavedTokenizer), a second copy of it in memory
        serialized = getattr(tokenizer, "serialized", None)
        if serialized is None:
            raise InvalidRequestError(
                "structured output needs a tokenizer whose tokens have known bytes",
                "response_format",
            )
        return llguidance.LLTokenizer(serialized(), n_vocab=vocab_size, eos_token=eos)
    # Tokens with bytes of their own (byte-level BPE, TinyGPT's bytes, SentencePiece pieces):
    # llguidance keeps only these and its trie, and calls back to encode. Ids without bytes are
    # special, which llguidance spells as a 0xFF byte before the token's name.
    tokens: list[bytes] = []
    specials: list[int] = []
    names: set[bytes] = set()
    for i in range(vocab_size):
        piece = tokenizer.token_bytes(i)
        if not piece:
            specials.append(i)
            piece = _special_name(tokenizer, i, names)
        tokens.append(piece)

    class _Vocab:
        eos_token_id = eos[0]
        bos_token_id = tokenizer.bos_token_id
        special_token_ids = specials

        def __init__(self) -> None:
            self.tokens = tokens

        def __call__(self, text: str | bytes) -> list[int]:
            if isinstance(text, bytes):
                text = text.decode("utf-8", errors="replace")
            return tokenizer.encode(text, add_special_tokens=False)

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocab()), eos_token=eos)


def _special_name(tokenizer: Tokenizer, token_id: int, taken: set[bytes]) -> bytes:
    """A special token as llguidance names it: 0xFF and its text (so a Lark grammar can name
    `<|im_end|>`), or `<special_N>` for one without text of its own or whose text is taken."""
    try:
        text = tokenizer.decode([token_id], skip_special_tokens=False).encode()
    except (IndexError, OverflowError, TypeError, ValueError):
        text = b""
    if not text or text in taken:
        text = b"<special_%d>" % token_id
    taken.add(text)
    return b"\xff" + text


class GrammarCompiler:
    """Compiles specs for one tokenizer and caches the result (a template matcher per spec, an
    LRU of `cache_size`). Thread-safe; meant to run in a worker thread, not on the event loop or
    the engine's step thread (the tokenizer's trie takes 1-4 s to build, once: `prepare` starts
    that at server startup; a new schema about a millisecond; a cached one microseconds)."""

    def __init__(self, tokenizer: Tokenizer, cache_size: int = 256) -> None:
        self.tokenizer = tokenizer
        self.cache_size = cache_size
        self._ll_tok: Any = None
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()  # the cache and counters
        self._build_lock = threading.Lock()  # the tokenizer's trie: built once, by one thread
        self._preparing: threading.Thread | None = None
        self.hits = 0
        self.misses = 0

    def prepare(self) -> threading.Thread | None:
        """Start building llguidance's tokenizer in a daemon thread, so the first structured
        request does not pay for it (a request that comes first waits for it to finish).

        Meant for server startup, before traffic: llguidance holds the GIL while it builds
        (~4 s for a 262k vocabulary), so built lazily it would stall every stream in the
        middle of serving instead."""
        with self._lock:
            if self._ll_tok is not None or self._preparing is not None:
                return self._preparing
            self._preparing = threading.Thread(
                target=self._prepare, name="grammar-tokenizer", daemon=True
            )
        self._preparing.start()
        return self._preparing

    def _prepare(self) -> None:
        # A failure is raised again, to a request, by its own access.
        with contextlib.suppress(Exception):
            _ = self.ll_tokenizer

    @property
    def ll_tokenizer(self) -> Any:
        with self._build_lock:
            if self._ll_tok is None:
                self._ll_tok = _ll_tokenizer(self.tokenizer, self.tokenizer.vocab_size)
            return self._ll_tok

    def constraint(self, spec: StructuredSpec) -> GrammarConstraint:
        """A fresh constraint for one choice. `InvalidRequestError` (param: the request field)
        for a schema, regex or grammar llguidance rejects."""
        key = (spec.kind, spec.value)
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                self.hits += 1
        if template is None:
            template = self._compile(spec)
            with self._lock:
                self.misses += 1
                self._cache[key] = template
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        return GrammarConstraint(template.deep_copy(), self.ll_tokenizer.vocab_size)

    def _compile(self, spec: StructuredSpec) -> Any:
        import llguidance

        M = llguidance.LLMatcher
        try:
            if spec.kind == "json_schema":
                grammar = M.grammar_from_json_schema(spec.value, overrides=JSON_OPTIONS)
            elif spec.kind == "json_object":
                grammar = M.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
            elif spec.kind == "regex":
                grammar = M.grammar_from_regex(spec.value)
            elif spec.kind == "choice":
                choices = json.loads(spec.value)
                grammar = M.grammar_from_lark(
                    "start: " + " | ".join(json.dumps(c) for c in choices)
                )
            else:
                grammar = llguidance.grammar_from("grammar", spec.value)  # Lark or GBNF
        except ValueError as e:
            raise InvalidRequestError(
                f"invalid {spec.kind.replace('_', ' ')}: {e}", spec.param
            ) from e
        matcher = M(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            # llguidance's message spans lines (with a caret under the fault): keep it, capped.
            message = " ".join(matcher.get_error().split())[:500] or "rejected"
            raise InvalidRequestError(
                f"invalid {spec.kind.replace('_', ' ')}: {message}", spec.param
            )
        return matcher
