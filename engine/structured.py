"""Structured output: grammars that constrain which tokens a request may sample.

Two halves, split by where they run:

- Off the step path (the HTTP side, in a worker thread): `GrammarCompiler` turns a
  `StructuredSpec` (a JSON schema, "any JSON object", a regex, a list of choices, a Lark/GBNF
  grammar) into a compiled grammar with llguidance, caches it by spec, and hands out one fresh
  `GrammarConstraint` (an `llguidance.LLMatcher`, copied from the cached one) per choice. A bad
  spec raises `InvalidRequestError` there, before anything reaches the engine. The spec's text
  and the parser limits are `engine.grammar`'s; an untrusted spec is checked out of process
  before it gets here (`server.grammars.check_worker`).
- On the step path (the sampler and the engine): a `Request` carries its constraint; each step
  `apply_constraints` asks every constrained row for its allowed-token bitmask and sets the rest
  of that row's logits to -inf (other rows are not touched), and `EngineBase._append_token` feeds
  the sampled token back (`accept`), ending the request when the grammar is complete, or with
  the constraint's `error` when its mask reached a dead end or one of the parser limits (each
  mask's work is bounded by them, so a hostile grammar cannot stall the step).

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
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from engine.errors import InvalidRequestError
from engine.grammar import (  # noqa: F401 (StructuredSpec, closed_objects: this module's names too)
    StructuredSpec,
    Vocabulary,
    client_message,
    closed_objects,
    constraint_error,
    grammar_text,
    parser_limits,
    vocabulary,
)
from engine.request import RequestState, TokenConstraint  # noqa: F401 (TokenConstraint: this module's name too)

if TYPE_CHECKING:
    from models.tokenizer import Tokenizer


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
    def error(self) -> str | None:
        if not self.matcher.is_error():
            return None
        return constraint_error(self.matcher)


def _ll_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> Any:
    """llguidance's view of one of our tokenizers (its forced tokens split as the model's own
    tokenizer splits text)."""
    return vocabulary(tokenizer, vocab_size).ll_tokenizer(
        lambda text: tokenizer.encode(text, add_special_tokens=False)
    )


class GrammarCompiler:
    """Compiles specs for one tokenizer and caches the result (a template matcher per spec, an
    LRU of `cache_size`). Thread-safe; meant to run in a worker thread, not on the event loop or
    the engine's step thread (the tokenizer's trie takes 1-4 s to build, once: `prepare` starts
    that at server startup; a new schema about a millisecond; a cached one microseconds).

    Every grammar is compiled and matched within `engine.grammar.PARSER_LIMITS`. A cached
    template shares its lazily built lexer states with the constraints copied from it (each is at
    most `max_lexer_states`), which is why the cache is small."""

    def __init__(self, tokenizer: Tokenizer, cache_size: int = 64) -> None:
        self.tokenizer = tokenizer
        self.cache_size = cache_size
        self._vocab: Vocabulary | None = None
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
    def vocabulary(self) -> Vocabulary:
        """The tokenizer as plain data (what a grammar check worker builds its trie from)."""
        with self._build_lock:
            if self._vocab is None:
                self._vocab = vocabulary(self.tokenizer, self.tokenizer.vocab_size)
            return self._vocab

    @property
    def ll_tokenizer(self) -> Any:
        with self._build_lock:
            if self._ll_tok is None:
                self._ll_tok = _ll_tokenizer(self.tokenizer, self.tokenizer.vocab_size)
            return self._ll_tok

    def cached(self, spec: StructuredSpec) -> bool:
        """`spec` is compiled already (a constraint for it costs a copy)."""
        with self._lock:
            return (spec.kind, spec.value) in self._cache

    def constraint(self, spec: StructuredSpec, grammar: str | None = None) -> GrammarConstraint:
        """A fresh constraint for one choice. `grammar`: the spec's llguidance grammar when it
        is already known (a check worker converted it), else converted here.
        `InvalidRequestError` (param: the request field) for a schema, regex or grammar
        llguidance rejects, or that exceeds the parser's limits."""
        key = (spec.kind, spec.value)
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                self.hits += 1
        if template is None:
            template = self._compile(spec, grammar)
            with self._lock:
                self.misses += 1
                self._cache[key] = template
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        return GrammarConstraint(template.deep_copy(), self.ll_tokenizer.vocab_size)

    def _compile(self, spec: StructuredSpec, grammar: str | None) -> Any:
        import llguidance

        if grammar is None:
            grammar = grammar_text(spec)
        matcher = llguidance.LLMatcher(
            self.ll_tokenizer, grammar, log_level=0, limits=parser_limits()
        )
        if matcher.is_error():
            raise InvalidRequestError(
                f"invalid {spec.what}: {client_message(matcher.get_error())}", spec.param
            )
        return matcher
