"""Grammars compiled off the engine's step path, for the engine that takes them.

Owns `StructuredOutputs`, the server's grammar compiler and check worker: it checks a spec it
has not seen in the grammar check worker (`server.grammars.checker`: out of process, within a
time and memory budget), then compiles it (cached) in a worker thread and returns one fresh
grammar state per choice, or, for an engine client that compiles where its engine runs, specs
to compile there (`for_engine`). A schema, regex or grammar the library rejects, or that blows
the budget, is a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from typing import Any

from engine.structured import GrammarCompiler, StructuredSpec, TokenConstraint
from models import Tokenizer
from server.errors import APIError
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
        self, spec: StructuredSpec, count: int, http: Any = None
    ) -> list[TokenConstraint]:
        """`count` fresh grammar states for `spec`: checked first unless it is compiled already,
        then compiled in a worker thread, so neither the event loop nor the engine's step waits
        for a compile (a request that comes before the trie built at startup is done waits for
        it)."""
        grammar = None if self.compiler.cached(spec) else await self.check(spec, http)
        return await asyncio.to_thread(
            lambda: [self.compiler.constraint(spec, grammar) for _ in range(count)]
        )
