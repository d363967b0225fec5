"""Grammars compiled off the engine's step path, for the engine that takes them.

Owns `StructuredOutputs`, the server's grammar compiler and check worker, and `constraints`,
a request's one pass through them: each spec it has not seen is checked in the grammar check
worker (`server.grammars.checker`: out of process, within a time and memory budget): first the
specs that are only checked (a chat request's tool parameters, whatever its `tool_choice`),
then the request's grammar, which is then compiled (cached) in a worker thread into one fresh
grammar state per choice, or, for an engine client that compiles where its engine runs, sent
as specs to compile there (`server.engine_client.remote_grammar`). A schema, regex or grammar
the library rejects, or that blows the budget, is a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Sequence
from typing import Any

from engine.errors import InvalidRequestError
from engine.structured import GrammarCompiler, StructuredSpec, TokenConstraint
from models import Tokenizer
from server.engine_client.remote_grammar import GrammarToCompile
from server.errors import APIError, grammar_error_code
from server.generation.sse import until_disconnect
from server.grammars.check_worker import CheckBudget
from server.grammars.checker import GrammarWorker, WorkerUnavailable

log = logging.getLogger("server.structured")


class StructuredOutputs:
    """The server's grammar compiler and check worker: one per tokenizer, their caches shared by
    all requests. `prepare`: start the check worker and build the tokenizer's trie now, in the
    background (server startup)."""

    def __init__(
        self, tokenizer: Tokenizer, prepare: bool = True, budget: CheckBudget | None = None
    ) -> None:
        self.compiler = GrammarCompiler(tokenizer)
        self.worker = GrammarWorker(lambda: self.compiler.vocabulary, budget)
        if prepare:
            threading.Thread(target=self._prepare, name="grammar-prepare", daemon=True).start()

    def _prepare(self) -> None:
        # Failures come back to the request that needs the worker or the trie.
        with contextlib.suppress(Exception):
            self.worker.start()
        self.compiler.prepare()

    def close(self) -> None:
        self.worker.close()

    async def check(self, spec: StructuredSpec, http: Any = None) -> str | None:
        """Check `spec` out of harm's way (see `server.grammars.checker`): its grammar text when it
        is new and passes, None when it passed before, `InvalidRequestError` when it fails.
        With `http` (the client's request), a client that disconnects cancels the check."""
        for attempt in range(2):
            try:
                work = self.worker.check(spec)
                return await (work if http is None else until_disconnect(http, work))
            except WorkerUnavailable as e:  # the worker itself died: once more, in a new one
                if attempt:
                    log.error("grammar check worker unavailable: %s", e)
                    raise APIError(
                        503,
                        "structured output is unavailable: the grammar check worker failed",
                        type="server_error",
                        param=spec.param,
                        code="grammar_worker_unavailable",
                    ) from e
        raise AssertionError("unreachable")

    async def constraints(
        self,
        spec: StructuredSpec | None,
        count: int,
        http: Any = None,
        *,
        placement: str | None = "local",
        checks: Sequence[StructuredSpec] = (),
    ) -> list[TokenConstraint | GrammarToCompile] | None:
        """A request's grammars in one pass: each of `checks` checked, then `count` grammar
        states for `spec` (None without one) as the engine client takes them (its
        `grammar_placement`): compiled here ("local"), or checked and compiled here and sent as
        specs ("replica": a replica compiles only specs that passed here), or refused (None: a
        deployment that cannot carry grammars). Any failure is a 400 naming its field (the
        tools' code for a tool's, structured output's otherwise); `http`: the client's request,
        whose disconnect cancels a check."""
        try:
            for extra in checks:
                await self.check(extra, http)
            if spec is None:
                return None
            if placement is None:
                raise InvalidRequestError(
                    "structured output and tool grammars are not supported by this deployment "
                    "(disaggregated prefill and decode tiers)",
                    spec.param,
                )
            if placement == "replica":
                await self._compiled(spec, 1, http)  # a bad spec is a 400 here, not there
                return [GrammarToCompile(spec) for _ in range(count)]
            return await self._compiled(spec, count, http)
        except InvalidRequestError as e:
            # A grammar, regex or JSON schema that does not parse or compile: a rule the
            # OpenAPI document does not state (server.http.openapi.UNSTATED_RULE_CODES says
            # why), so the 400 names itself.
            raise APIError(400, str(e), param=e.param, code=grammar_error_code(e.param)) from e

    async def _compiled(self, spec: StructuredSpec, count: int, http: Any) -> list[TokenConstraint]:
        """`count` fresh grammar states for `spec`: checked first unless it is compiled already,
        then compiled in a worker thread, so neither the event loop nor the engine's step waits
        for a compile (a request that comes before the trie built at startup is done waits for
        it)."""
        grammar = None if self.compiler.cached(spec) else await self.check(spec, http)
        return await asyncio.to_thread(
            lambda: [self.compiler.constraint(spec, grammar) for _ in range(count)]
        )
