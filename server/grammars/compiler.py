"""Structured output at the HTTP edge: which request field asks for which grammar, and compiling
it off the engine's step path.

Owns the mapping from a request's `response_format` ({"type": "json_object"} or {"type":
"json_schema", "json_schema": {"schema": ...}}), vLLM's `structured_outputs` ({"json" | "regex" |
"choice" | "grammar" | "json_object"}) and its older `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar` to one `engine.structured.StructuredSpec` (at most one may be
given: two are a 400), and `StructuredOutputs`, which checks a spec it has not seen in the
grammar check worker (`server.grammars.check_worker`: out of process, within a time and memory budget),
then compiles it (cached) in a worker thread and returns one fresh grammar state per choice. A
schema, regex or grammar the library rejects, or that blows the budget, is an
`InvalidRequestError`, which `server.errors` makes a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from typing import Any

from engine.errors import InvalidRequestError
from engine.structured import GrammarCompiler, StructuredSpec, TokenConstraint
from models import Tokenizer
from server.errors import APIError
from server.grammars.check_worker import CheckBudget, GrammarWorker, WorkerUnavailable
from server.openai.formats import until_disconnect
from server.openai.protocol import SamplingFields

log = logging.getLogger("server.structured")


def structured_spec(req: SamplingFields) -> StructuredSpec | None:
    """The one grammar a request asks for, or None."""
    found: list[StructuredSpec] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(StructuredSpec("json_object"))
    elif rf is not None and rf.type == "json_schema":
        schema = rf.json_schema.schema_ if rf.json_schema is not None else None
        if schema is None:  # a named format without a schema: any JSON object
            found.append(StructuredSpec("json_object"))
        else:
            found.append(StructuredSpec.json_schema(schema, "response_format"))
    so = req.structured_outputs
    if so is not None:
        if so.json_ is not None:
            found.append(StructuredSpec.json_schema(so.json_, "structured_outputs"))
        if so.regex is not None:
            found.append(StructuredSpec("regex", so.regex, "structured_outputs"))
        if so.choice is not None:
            found.append(StructuredSpec("choice", json.dumps(so.choice), "structured_outputs"))
        if so.grammar is not None:
            found.append(StructuredSpec("grammar", so.grammar, "structured_outputs"))
        if so.json_object:
            found.append(StructuredSpec("json_object", "", "structured_outputs"))
    if req.guided_json is not None:
        found.append(StructuredSpec.json_schema(req.guided_json, "guided_json"))
    if req.guided_regex is not None:
        found.append(StructuredSpec("regex", req.guided_regex, "guided_regex"))
    if req.guided_choice is not None:
        found.append(StructuredSpec("choice", json.dumps(req.guided_choice), "guided_choice"))
    if req.guided_grammar is not None:
        found.append(StructuredSpec("grammar", req.guided_grammar, "guided_grammar"))
    if len(found) > 1:
        raise InvalidRequestError(
            "give at most one of response_format (json_object / json_schema), "
            "structured_outputs and guided_json / guided_regex / guided_choice / guided_grammar",
            found[1].param,
        )
    return found[0] if found else None


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
        """Check `spec` out of harm's way (see `server.grammars.check_worker`): its grammar text when it
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
