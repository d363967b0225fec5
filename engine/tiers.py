"""The disaggregated tiers' engines, one per process: `PrefillEngine` and `DecodeEngine`.

A request's life across processes (`python -m server.ray --disaggregated` runs them on Ray):

1. A prefill process's `PrefillEngine` computes the prompt in its own KV pool (chunked, batched,
   with its prefix cache, exactly as the continuous engine does) and samples the first token.
   In that same step the request leaves the pool with its blocks (`detach`), its K/V is packed
   into bytes (`engine.kv_connector.pack_blocks`, whole blocks) and the blocks are freed
   (`release`; named ones stay in the prefill pool's prefix cache). What a decode pool needs to
   continue the request is a `Handoff`: the packed K/V plus a `RequestSnapshot` (tokens so far,
   computed-token count, the state of the request's random generator, prefix-cache keys).
2. The snapshot and the bytes travel to a decode process (on Ray, its object store carries the
   bytes: `server.ray.disagg`).
3. The decode process's `DecodeEngine` is told to `expect` the request, then gets it through the
   ordinary `add_request` (so a driver's queueing, abort and backpressure paths are the usual
   ones). At the start of its next step it admits the request into its pool (`admit_running`),
   writes the K/V into the blocks it allocated (`KVConnector.receive`) and decodes it with the
   others. A request waits in arrival order while the pool has no free slot or blocks.

Equality with one process: the decode pool sees the same tokens, the same K/V values for them
(bytes, bit for bit), the same sampling parameters and a generator in the same state, so it
samples the same tokens as a single engine would have. The first token and its logprobs were
emitted by the prefill tier.

Both are `engine.pooled.PooledEngine`s over one continuous pool, as `DisaggregatedEngine` is over
two: the same prompt-fit check, admission step and stats merge.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.batch import ContinuousBatchEngine
from engine.errors import InvalidRequestError
from engine.interface import EngineConfig, EngineStats
from engine.kv_connector import KVConnector, pack_blocks
from engine.pooled import PooledEngine
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


class PrefillEngine(PooledEngine):
    """Prompts and first tokens only: each request leaves as a `Handoff` once it has sampled its
    first token (or ends here if that token finishes it). `take_handoff` collects it."""

    name = "disaggregated-prefill"

    def __init__(self, model: CausalLM | LoadedModel, config: EngineConfig) -> None:
        pool = ContinuousBatchEngine(model, config.prefill_pool())
        super().__init__(model, config, (pool,))
        self.pool = pool
        self.max_batch_size = pool.max_batch_size
        # Both tiers sized alike (no per-pool size set): a request that could never fit the
        # decode pool is refused here, before its first token, as one process would.
        prefill, decode = config.prefill_pool(), config.decode_pool()
        self._same_pools = (prefill.num_blocks, prefill.kv_cache_memory_gib) == (
            decode.num_blocks,
            decode.kv_cache_memory_gib,
        )
        # Written by the step thread, taken on the event loop after the step's outputs.
        self._handoffs: dict[str, Handoff] = {}
        self.handed_off = 0
        self.handed_off_bytes = 0

    def take_handoff(self, request_id: str) -> Handoff | None:
        return self._handoffs.pop(request_id, None)

    def _check_fits(self, request: Request, total_tokens: int) -> None:
        decode = self.pool if self._same_pools else None
        self._check_split_fits(request, total_tokens, self.pool, decode)

    def _enqueue(self, state: RequestState) -> None:
        self.pool.enqueue(state)

    def _step(self) -> list[StepOutput]:
        outputs = self._step_pools(self.pool)
        for state in [s for s in self.pool.scheduler.running if s.num_output_tokens]:
            # Out of the pool with its blocks, K/V read out, blocks freed: all in this step, so
            # a prefill process never holds K/V for a request that has left it.
            self.pool.detach(state)
            # The blocks that hold the computed tokens (the decode side slices the same way).
            held = self.pool.block_manager.blocks_for(state.num_computed_tokens)
            payload = pack_blocks(
                self.pool.runner,
                state.block_ids[:held],
                state.num_computed_tokens,
                state.state_slot,
            )
            self.pool.release(state)
            self._handoffs[state.request_id] = Handoff(RequestSnapshot.of(state), payload)
            self.handed_off += 1
            self.handed_off_bytes += len(payload)
        return outputs

    def stats(self) -> EngineStats:
        return EngineStats(**self._merged_stats())


class DecodeEngine(PooledEngine):
    """Continues requests prefilled elsewhere: `expect(handoff)`, then `add_request` of the same
    request admits it at the next step with its K/V written from the payload."""

    name = "disaggregated-decode"

    def __init__(self, model: CausalLM | LoadedModel, config: EngineConfig) -> None:
        pool = ContinuousBatchEngine(model, config.decode_pool())
        super().__init__(model, config, (pool,))
        self.pool = pool
        self.max_batch_size = pool.max_batch_size
        self.connector = KVConnector()  # counts what arrived
        self._expected: dict[str, Handoff] = {}
        self._payloads: dict[str, bytes] = {}  # of the held (arrived, not yet admitted) requests

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
        self._check_split_fits(request, total_tokens, None, self.pool)

    def _enqueue(self, state: RequestState) -> None:
        handoff = self._expected.pop(state.request_id)
        handoff.snapshot.restore(state)
        self.held[state.request_id] = state
        self._payloads[state.request_id] = handoff.payload

    def _drop_held(self, state: RequestState) -> None:
        del self._payloads[state.request_id]

    def _step(self) -> list[StepOutput]:
        self._admit_held(self.pool, self.connector, lambda s: self._payloads.pop(s.request_id))
        return self._step_pools(self.pool)

    def stats(self) -> EngineStats:
        summed = self._merged_stats()
        summed["num_waiting"] += len(self.held)
        return EngineStats(**summed)
