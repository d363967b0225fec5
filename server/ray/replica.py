"""`EngineReplica`: the engine deployment. Each replica owns a model, an engine and its
`AsyncEngineDriver` (one asyncio task, one step thread), exactly as `python -m server` does.

`generate` is an async generator called through the handle with `stream=True`: it submits the
call's group, yields `Accepted` (or `Refused`), then one `StepItem` per step per request. When
the ingress cancels the call (its HTTP client went away) the generator is cancelled at its
`await`, and `finally` aborts whatever is still open, freeing the blocks before the next step.

`check_health` raises while the engine loop is dead or a step has run past `step_timeout`, so
Serve replaces the replica. `__del__` runs after Serve has drained the replica's in-flight calls
(`graceful_shutdown_timeout_s`) and stops the driver.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from engine import EngineConfig
from engine.errors import EngineError
from engine.structured import GrammarCompiler
from server.engine_client.remote_grammar import compile_pending, has_pending
from server.ray.wire import AbortCall, Accepted, EngineCall, Probe, Refused, StepItem

log = logging.getLogger("server.ray.replica")


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """How each engine replica builds its engine (the same choices as `python -m server`)."""

    model: str
    dtype: str = "float32"
    quantization: str = "auto"  # load_model's, as `python -m server --quantization`
    kv_cache_dtype: str = "auto"
    activation_dtype: str = "auto"  # load_model's `activations`, as `--activation-dtype`
    engine: str = "continuous"
    config: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    max_waiting: int | None = None
    step_timeout: float = 60.0
    num_threads: int = 1
    shutdown_timeout: float = 30.0


class EngineReplica:
    async def __init__(self, spec: EngineSpec) -> None:
        import torch
        from ray import serve

        from engine import make_engine
        from models import load_model
        from models.cpu import in_passing_thread
        from server.engine_client.driver import AsyncEngineDriver

        torch.set_num_threads(spec.num_threads)
        self.spec = spec
        self.replica = serve.get_replica_context().replica_id.unique_id
        # As `python -m server` does: the driver's step thread must own the only OpenMP team.
        lm = in_passing_thread(
            load_model,
            spec.model,
            dtype=spec.dtype,
            quantization=spec.quantization,
            kv_cache_dtype=spec.kv_cache_dtype,
            activations=spec.activation_dtype,
            max_model_len=spec.config.max_model_len,
        )
        self.engine = in_passing_thread(self._build_engine, lm, make_engine)
        self.driver = AsyncEngineDriver(
            self.engine,
            max_waiting=spec.max_waiting,
            step_timeout=spec.step_timeout,
            num_threads=spec.num_threads,
        )
        await self.driver.start()
        # Grammars arrive as specs and are compiled here (server.engine_client.remote_grammar).
        self.grammars = GrammarCompiler(lm.tokenizer)
        self.grammars.prepare()  # the tokenizer's trie, in the background
        self.served = 0
        self.aborted_on_cancel = 0
        log.info("engine replica %s ready: %s, %s engine", self.replica, lm.name, self.engine.name)

    def _build_engine(self, lm: Any, make_engine: Any) -> Any:
        """The engine this replica drives (a disaggregated tier's replica builds its own)."""
        return make_engine(self.spec.engine, lm.model, self.spec.config)

    async def generate(self, call: EngineCall) -> AsyncIterator[Accepted | Refused | StepItem]:
        now = time.monotonic()  # the ingress's clock is another process's (or machine's)
        requests = [dataclasses.replace(r, arrival_time=now) for r in call.requests]
        try:
            if has_pending(requests):  # compile the grammars sent as specs, off the event loop
                requests = await asyncio.to_thread(compile_pending, requests, self.grammars)
            stream = await self.driver.submit(requests)
        except EngineError as e:
            yield Refused.of(e)
            return
        self.served += len(requests)
        yield Accepted(self.replica, self.driver.stats())
        try:
            async for out in stream:
                yield self._item(out)
        except EngineError as e:  # the engine died mid-stream: say so, as data
            yield Refused.of(e)
        finally:
            # Cancelled (the client went away) or ended early: free what is still running.
            open_ids = stream.open_request_ids
            if open_ids:
                self.aborted_on_cancel += len(open_ids)
            for request_id in open_ids:
                self.driver.abort(request_id)
            self._forget(requests)

    def _item(self, out: Any) -> Any:
        """What crosses the handle for one step output (a disaggregated tier sends its own)."""
        return StepItem(out, self.driver.stats())

    def _forget(self, requests: list) -> None:
        """After a call ends: drop anything kept for its requests (nothing here)."""

    async def abort(self, call: AbortCall) -> None:
        self.driver.abort(call.request_id)

    async def probe(self, call: Probe) -> dict:
        """This replica's state (for tests and operators): stats and counters."""
        stats = self.driver.stats()
        return {
            "replica": self.replica,
            "stats": stats,
            "served": self.served,
            "aborted_on_cancel": self.aborted_on_cancel,
            "healthy": self.driver.health().ok,
        }

    async def check_health(self) -> None:
        health = self.driver.health()
        if not health.ok:
            raise RuntimeError(f"engine replica {self.replica} unhealthy: {health.reason}")

    async def __del__(self) -> None:
        await self.driver.stop(timeout=self.spec.shutdown_timeout)
