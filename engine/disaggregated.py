"""Disaggregated prefill and decode: two KV pools, and the handoff of a request between them.

Owns when a request moves from the prefill pool to the decode pool; how each pool schedules,
computes and samples is the continuous engine's, reused whole: each pool is a
`ContinuousBatchEngine` with its own block manager, scheduler, model runner and KV tensor (the
model weights are shared). The KV bytes move through `engine.kv_connector`.

A request's life, in `Phase`s:

- WAITING, PREFILLING: the prefill pool computes its prompt, in chunks within the prefill token
  budget, and samples its first token there; that token is emitted in the same step.
- TRANSFER: out of the prefill scheduler, its KV still in prefill blocks. At the start of each step
  the oldest such requests move, one payload each, into the decode pool while it has a free slot
  and blocks for the whole sequence so far; the prefill blocks are then freed (named ones stay in
  the prefill pool's prefix cache). When the decode pool is full the request waits here holding
  its prefill blocks: nothing is recomputed, nothing buffered elsewhere. The prefill pool pauses
  while as many requests wait here as the decode pool has free slots (at least one): prefilling
  further ahead would emit first tokens whose streams then stall, moving the queue from before
  the first token (TTFT) into the stream (ITL). It cannot deadlock: decode requests always
  finish, and `add_request` refuses a request that could never fit either pool.
- DECODING: a running member of the decode pool. If that pool must preempt, its scheduler does
  what it always does: the newest request falls back to zero computed tokens, keeps the tokens it
  generated, and is recomputed in the decode pool when room returns (before any new handoff). So a
  request is transferred exactly once, and tokens are never lost or sent twice.

One step is a decode forward on the decode pool, then a prefill forward on the prefill pool
(sequential here; separate machines would overlap them). A waiting handoff never stops the
others from decoding.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from engine.batch import ContinuousBatchEngine
from engine.core import engine_config
from engine.interface import EngineConfig, EngineStats
from engine.kv_connector import KVConnector
from engine.pooled import PooledEngine
from engine.request import Request, RequestState, StepOutput
from models.base import CausalLM, LoadedModel


class Phase(enum.Enum):
    WAITING = "waiting"  # queued for the prefill pool
    PREFILLING = "prefilling"  # prompt being computed in the prefill pool
    TRANSFER = "transfer"  # first token out; KV in prefill blocks, waiting for the decode pool
    DECODING = "decoding"  # in the decode pool (running, or preempted and to be recomputed there)


@dataclass(frozen=True, slots=True, kw_only=True)
class DisaggregatedStats(EngineStats):
    """Both pools summed (blocks, preemptions, prefix cache), plus the handoff."""

    num_in_transfer: int
    transfers: int
    transferred_bytes: int


class DisaggregatedEngine(PooledEngine):
    """A prefill pool and a decode pool, each with its own KV blocks, joined by a KV connector.

    Pools are sized by `EngineConfig.prefill_pool()` and `decode_pool()`: `max_batch_size` (decode
    slots), `prefill_max_batch_size` (prompts prefilling at once, default the same),
    `max_num_batched_tokens` (the prefill token budget per step), and per pool `*_num_blocks` or
    `*_kv_cache_memory_gib` (each pool sized on its own, as two machines would be);
    `num_blocks` / `kv_cache_memory_gib` set both. The pools are driven only through the batch
    engine's hand-off API; requests in transfer are this engine's `held` ones.
    """

    name = "disaggregated"

    def __init__(
        self,
        model: CausalLM | LoadedModel,
        config: EngineConfig | None = None,
        *,
        connector: KVConnector | None = None,
        **options: object,
    ) -> None:
        config = engine_config(config, options)
        prefill = ContinuousBatchEngine(model, config.prefill_pool())
        decode = ContinuousBatchEngine(prefill.model, config.decode_pool())
        super().__init__(model, config, (prefill, decode))
        self.prefill, self.decode = prefill, decode
        self.max_batch_size = config.max_batch_size
        self.connector = connector or KVConnector()

    @property
    def transfers(self) -> int:
        return self.connector.transfers

    @property
    def transferred_bytes(self) -> int:
        return self.connector.transferred_bytes

    def phase(self, request_id: str) -> Phase | None:
        """Where a live request is; None once it has finished or was never added."""
        if request_id in self.prefill.requests:
            state = self.prefill.requests[request_id]
            return Phase.PREFILLING if state in self.prefill.scheduler.running else Phase.WAITING
        if request_id in self.decode.requests:
            return Phase.DECODING
        if request_id in self.held:
            return Phase.TRANSFER
        return None

    # -- queueing: a request belongs to exactly one pool, or to the transfer queue --------------

    def _check_fits(self, request: Request, total_tokens: int) -> None:
        self._check_split_fits(request, total_tokens, self.prefill, self.decode)

    def _enqueue(self, state: RequestState) -> None:
        self.prefill.enqueue(state)

    def _drop_held(self, state: RequestState) -> None:
        self.prefill.release(state)  # its K/V still sits in prefill blocks

    # -- one step ----------------------------------------------------------------------------------

    def _step(self) -> list[StepOutput]:
        self._admit_held(self.decode, self.connector, self._send)
        # Backpressure (see the module docstring): prefill only what the decode pool can take
        # at the next step, or one request ready for the next slot that frees.
        dec = self.decode.scheduler
        room = dec.max_batch_size - len(dec.running) - len(dec.waiting)
        pools = (self.decode, self.prefill) if len(self.held) < max(1, room) else (self.decode,)
        outputs = self._step_pools(*pools)
        # A request that has sampled its first token leaves the prefill pool (which would
        # otherwise decode it there) but keeps its blocks until the decode pool takes it.
        for state in [s for s in self.prefill.scheduler.running if s.num_output_tokens]:
            self.prefill.detach(state)
            self.held[state.request_id] = state
        return outputs

    def _send(self, state: RequestState) -> bytes:
        """A prefilled request's K/V out of the prefill pool, whose blocks are then freed (named
        ones stay in its prefix cache)."""
        payload = self.connector.send(
            self.prefill.runner, state.block_ids, state.num_computed_tokens, state.state_slot
        )
        self.prefill.release(state)
        return payload

    def stats(self) -> DisaggregatedStats:
        summed = self._merged_stats()
        summed["num_running"] += len(self.held)
        return DisaggregatedStats(
            **summed,
            num_in_transfer=len(self.held),
            transfers=self.connector.transfers,
            transferred_bytes=self.connector.transferred_bytes,
        )
