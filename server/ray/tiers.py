"""The engines of the disaggregated tiers: `PrefillEngine` and `DecodeEngine` (no Ray here).

A request's life across processes (`python -m server.ray --disaggregated`):

1. A prefill replica's `PrefillEngine` computes the prompt in its own KV pool (chunked, batched,
   with its prefix cache, exactly as the continuous engine does) and samples the first token.
   In that same step the request leaves the pool with its blocks (`detach`), its K/V is packed
   into bytes (`engine.kv_connector.pack_blocks`, whole blocks) and the blocks are freed
   (`release`; named ones stay in the prefill pool's prefix cache). What a decode pool needs to
   continue the request is a `Handoff`: the packed K/V plus a `RequestSnapshot` (tokens so far,
   computed-token count, the state of the request's random generator, prefix-cache keys).
2. The snapshot and the bytes travel to a decode replica (Ray's object store carries the bytes:
   `server.ray.disagg`).
3. The decode replica's `DecodeEngine` is told to `expect` the request, then gets it through the
   ordinary `add_request` (so the driver's queueing, abort and backpressure paths are the usual
   ones). At the start of its next step it admits the request into its pool (`admit_running`),
   writes the K/V into the blocks it allocated (`KVConnector.receive`) and decodes it with the
   others. A request waits in arrival order while the pool has no free slot or blocks.

Equality with one process: the decode pool sees the same tokens, the same K/V values for them
(bytes, bit for bit), the same sampling parameters and a generator in the same state, so it
samples the same tokens as a single engine would have. The first token and its logprobs were
emitted by the prefill tier.

Both engines are driven by `server.driver.AsyncEngineDriver` like any engine: adds and aborts
between steps on the event loop, steps in one worker thread.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, fields

import torch

from engine.core import ContinuousBatchEngine, EngineBase
from engine.errors import InvalidRequestError, RequestTooLongError
from engine.interface import EngineConfig, EngineStats
from engine.kv_connector import KVConnector, pack_blocks
from engine.request import Request, RequestState, StepOutput
from models.base import CausalLM, LoadedModel


@dataclass(frozen=True, slots=True)
class RequestSnapshot:
    """What a decode pool needs, besides the K/V bytes, to continue a prefilled request."""

    request: Request
    token_ids: tuple[int, ...]  # prompt + the first sampled token
    num_computed_tokens: int  # tokens whose K/V the payload holds (the prompt)
    num_cached_tokens: int  # prompt tokens the prefill pool served from its prefix cache
    generator_state: bytes | None  # torch.Generator state after the first draw; None: greedy
    block_hashes: tuple[bytes, ...]  # prefix-cache keys of the full blocks hashed so far

    @classmethod
    def of(cls, state: RequestState) -> RequestSnapshot:
        gen = state.generator
        return cls(
            state.request,
            tuple(state.token_ids),
            state.num_computed_tokens,
            state.num_cached_tokens,
            None if gen is None else gen.get_state().numpy().tobytes(),
            tuple(state.block_hashes),
        )

    def restore(self, state: RequestState) -> None:
        """Make a fresh state of the same request (built by `add_request`) this one."""
        assert state.request_id == self.request.request_id
        state.token_ids = list(self.token_ids)
        state.num_computed_tokens = self.num_computed_tokens
        state.num_cached_tokens = self.num_cached_tokens
        state.block_hashes = list(self.block_hashes)
        if self.generator_state is not None:
            assert state.generator is not None  # same params: not greedy on both sides
            raw = torch.frombuffer(bytearray(self.generator_state), dtype=torch.uint8)
            state.generator.set_state(raw)


@dataclass(frozen=True, slots=True)
class Handoff:
    snapshot: RequestSnapshot
    payload: bytes  # engine.kv_connector.pack_blocks

    @property
    def num_kv_bytes(self) -> int:
        return len(self.payload)


class PrefillEngine(EngineBase):
    """Prompts and first tokens only: each request leaves as a `Handoff` once it has sampled its
    first token (or ends here if that token finishes it). `take_handoff` collects it."""

    name = "disaggregated-prefill"

    def __init__(self, model: CausalLM | LoadedModel, config: EngineConfig) -> None:
        super().__init__(model, config)
        self.pool = ContinuousBatchEngine(self.model, config.prefill_pool())
        self.max_batch_size = self.pool.max_batch_size
        # Both tiers sized alike (no per-pool size set): a request that could never fit the
        # decode pool is refused here, before its first token, as one process would.
        self._same_pools = config.prefill_pool().num_blocks == config.decode_pool().num_blocks and (
            config.prefill_pool().kv_cache_memory_gib == config.decode_pool().kv_cache_memory_gib
        )
        # Written by the step thread, taken on the event loop after the step's outputs.
        self._handoffs: dict[str, Handoff] = {}
        self.handed_off = 0
        self.handed_off_bytes = 0

    def take_handoff(self, request_id: str) -> Handoff | None:
        return self._handoffs.pop(request_id, None)

    def _check_fits(self, request: Request, total_tokens: int) -> None:
        bm = self.pool.block_manager
        need = bm.blocks_for(len(request.prompt_token_ids))
        if need > bm.num_usable_blocks:
            raise RequestTooLongError(
                f"a {len(request.prompt_token_ids)}-token prompt needs {need} KV blocks but the "
                f"prefill pool has {bm.num_usable_blocks}"
            )
        if self._same_pools:
            self.pool.check_fits(total_tokens)

    def _enqueue(self, state: RequestState) -> None:
        self.pool.enqueue(state)

    def _dequeue(self, state: RequestState) -> None:
        self.pool.remove(state)

    def _step(self) -> list[StepOutput]:
        outputs = self.pool.step()
        for state in [s for s in self.pool.scheduler.running if s.num_output_tokens]:
            # Out of the pool with its blocks, K/V read out, blocks freed: all in this step, so
            # a prefill replica never holds K/V for a request that has left it.
            self.pool.detach(state)
            # The blocks that hold the computed tokens (the decode side slices the same way).
            held = self.pool.block_manager.blocks_for(state.num_computed_tokens)
            payload = pack_blocks(
                self.pool.runner, state.block_ids[:held], state.num_computed_tokens
            )
            self.pool.release(state)
            del self.requests[state.request_id]
            self._handoffs[state.request_id] = Handoff(RequestSnapshot.of(state), payload)
            self.handed_off += 1
            self.handed_off_bytes += len(payload)
        for out in outputs:
            if out.finished:
                self.requests.pop(out.request_id, None)
        self.total_slot_steps = self.pool.total_slot_steps
        self.wasted_slot_steps = self.pool.wasted_slot_steps
        return outputs

    def stats(self) -> EngineStats:
        return self.pool.stats()


class DecodeEngine(EngineBase):
    """Continues requests prefilled elsewhere: `expect(handoff)`, then `add_request` of the same
    request admits it at the next step with its K/V written from the payload."""

    name = "disaggregated-decode"

    def __init__(self, model: CausalLM | LoadedModel, config: EngineConfig) -> None:
        super().__init__(model, config)
        self.pool = ContinuousBatchEngine(self.model, config.decode_pool())
        self.max_batch_size = self.pool.max_batch_size
        self.connector = KVConnector()  # counts what arrived
        self._expected: dict[str, Handoff] = {}
        self._arrived: deque[tuple[RequestState, bytes]] = deque()  # oldest first

    def expect(self, handoff: Handoff) -> None:
        """Register a request's hand-off before `add_request` of its request."""
        self._expected[handoff.snapshot.request.request_id] = handoff

    def forget(self, request_id: str) -> None:
        """Drop an expected hand-off whose request was never added (refused, cancelled)."""
        self._expected.pop(request_id, None)

    def _check_fits(self, request: Request, total_tokens: int) -> None:
        if request.request_id not in self._expected:
            raise InvalidRequestError(  # a caller that skipped `expect`
                f"request {request.request_id!r} arrived without its prefilled K/V", "request_id"
            )
        self.pool.check_fits(total_tokens)

    def _enqueue(self, state: RequestState) -> None:
        handoff = self._expected.pop(state.request_id)
        handoff.snapshot.restore(state)
        self._arrived.append((state, handoff.payload))

    def _dequeue(self, state: RequestState) -> None:
        if state.request_id in self.pool.requests:
            self.pool.remove(state)
        else:
            self._arrived = deque(a for a in self._arrived if a[0] is not state)

    def _admit(self) -> None:
        # Requests the pool preempted go first: they were there before any newcomer.
        while self._arrived and not self.pool.scheduler.waiting:
            state, payload = self._arrived[0]
            if not self.pool.can_admit(state.num_tokens):
                return
            self._arrived.popleft()
            self.pool.admit_running(state)
            num_blocks = self.pool.block_manager.blocks_for(state.num_computed_tokens)
            self.connector.receive(payload, self.pool.runner, state.block_ids[:num_blocks])

    def _step(self) -> list[StepOutput]:
        self._admit()
        outputs = self.pool.step()
        for out in outputs:
            if out.finished:
                self.requests.pop(out.request_id, None)
        self.total_slot_steps = self.pool.total_slot_steps
        self.wasted_slot_steps = self.pool.wasted_slot_steps
        return outputs

    def stats(self) -> EngineStats:
        s = self.pool.stats()
        values = {f.name: getattr(s, f.name) for f in fields(EngineStats)}
        values["num_waiting"] += len(self._arrived)
        return EngineStats(**values)
