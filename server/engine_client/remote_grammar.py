"""Grammars for engines in another process (Ray Serve replicas): the spec crosses, the grammar
is compiled where the engine runs.

Owns `GrammarToCompile`, the picklable stand-in a `Request` carries instead of a compiled
grammar (an `llguidance.LLMatcher` does not pickle, and compiling on the ingress would only be
thrown away), and `compile_pending`, which a replica runs on a call's requests before they
reach its engine (in a worker thread: the first compile builds the tokenizer's trie). The
ingress (`server.grammars.compiler.StructuredOutputs.constraints`) checks the spec in its
grammar check worker and compiles it once itself (cached), so a
bad schema, regex or grammar, or one that would crash or exhaust a process, is a 400 there
before anything is sent; a replica compiles within the same parser limits.

An engine client says where grammars are compiled with its `grammar_placement` attribute:
"local" (the default: the in-process driver), "replica" (`RayEngineClient`), or None where a
deployment cannot carry them (the disaggregated tiers: the grammar state would have to follow
the request from the prefill tier to the decode tier).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from engine import Request
from engine.structured import GrammarCompiler, StructuredSpec


@dataclass(frozen=True, slots=True)
class GrammarToCompile:
    """A request's grammar, not compiled yet. It is no `TokenConstraint`: an engine that gets
    one fails loudly rather than sampling unconstrained."""

    spec: StructuredSpec

    def fill_bitmask(self, bitmask, row: int) -> None:
        raise RuntimeError("a grammar reached the engine uncompiled (compile_pending not run)")

    def accept(self, token_id: int) -> bool:
        raise RuntimeError("a grammar reached the engine uncompiled (compile_pending not run)")

    @property
    def is_finished(self) -> bool:
        raise RuntimeError("a grammar reached the engine uncompiled (compile_pending not run)")

    @property
    def error(self) -> str | None:
        raise RuntimeError("a grammar reached the engine uncompiled (compile_pending not run)")


def has_pending(requests: Sequence[Request]) -> bool:
    return any(isinstance(r.constraint, GrammarToCompile) for r in requests)


def compile_pending(requests: Sequence[Request], compiler: GrammarCompiler) -> list[Request]:
    """`requests` with each `GrammarToCompile` replaced by a fresh compiled constraint.
    `InvalidRequestError` for a spec the compiler rejects."""
    return [
        dataclasses.replace(r, constraint=compiler.constraint(r.constraint.spec))
        if isinstance(r.constraint, GrammarToCompile)
        else r
        for r in requests
    ]
