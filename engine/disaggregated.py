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
from collections import deque
from dataclasses import dataclass, fields

from engine.core import ContinuousBatchEngine, EngineStats, _EngineBase
from engine.errors import RequestTooLongError
from engine.kv_connector import KVConnector
from engine.request import Request, RequestState, StepOutput


class Phase(enum.Enum):
    WAITING = "waiting"  # queued for the prefill pool
    PREFILLING = "prefilling"  # prompt being computed in the prefill pool
    TRANSFER = "transfer"  # first token out; KV in prefill blocks, waiting for the decode pool
    DECODING = "decoding"  # in the decode pool (running, or preempted and to be recomputed there)


@dataclass(frozen=True, slots=True)
class DisaggregatedStats(EngineStats):
    """Both pools summed (blocks, preemptions, prefix cache), plus the handoff."""

    num_in_transfer: int
    transfers: int
    transferred_bytes: int


class DisaggregatedEngine(_EngineBase):
    """A prefill pool and a decode pool, each with its own KV blocks, joined by a KV connector.

    Pool options: `max_batch_size` (decode slots), `prefill_max_batch_size` (prompts prefilling at
    once, default the same), `max_num_batched_tokens` (the prefill token budget per step), and per
    pool `*_num_blocks` or `*_kv_cache_memory_gib` (each pool sized on its own, as two machines
    would be); `num_blocks` / `kv_cache_memory_gib` set both.
    """

    name = "disaggregated"

    def __init__(
        self,
        model,
        *,
        max_batch_size: int = 8,
        prefill_max_batch_size: int | None = None,
        block_size: int = 16,
        num_blocks: int | None = None,
        prefill_num_blocks: int | None = None,
        decode_num_blocks: int | None = None,
        kv_cache_memory_gib: float | None = None,
        prefill_kv_cache_memory_gib: float | None = None,
        decode_kv_cache_memory_gib: float | None = None,
        max_num_batched_tokens: int | None = None,
        enable_prefix_caching: bool | None = None,
        max_model_len: int | None = None,
        connector: KVConnector | None = None,
    ) -> None:
        super().__init__(model, max_model_len)

        def pool(
            batch: int, blocks: int | None, gib: float | None, budget: int | None
        ) -> ContinuousBatchEngine:
            return ContinuousBatchEngine(
                self.model,
                max_batch_size=batch,
                block_size=block_size,
                num_blocks=blocks,
                kv_cache_memory_gib=gib,
                max_num_batched_tokens=budget,
                enable_prefix_caching=enable_prefix_caching,
                max_model_len=self.max_model_len,
            )

        self.max_batch_size = max_batch_size
        self.prefill = pool(
            max_batch_size if prefill_max_batch_size is None else prefill_max_batch_size,
            num_blocks if prefill_num_blocks is None else prefill_num_blocks,
            kv_cache_memory_gib
            if prefill_kv_cache_memory_gib is None
            else prefill_kv_cache_memory_gib,
            max_num_batched_tokens,
        )
        self.decode = pool(
            max_batch_size,
            num_blocks if decode_num_blocks is None else decode_num_blocks,
            kv_cache_memory_gib
            if decode_kv_cache_memory_gib is None
            else decode_kv_cache_memory_gib,
            None,  # the decode pool only prefills to recompute after a preemption
        )
        self.connector = connector or KVConnector()
        self._in_transfer: deque[RequestState] = deque()  # oldest first

    @property
    def transfers(self) -> int:
        return self.connector.transfers

    @property
    def transferred_bytes(self) -> int:
        return self.connector.transferred_bytes

    def phase(self, request_id: str) -> Phase | None:
        """Where a live request is; None once it has finished or was never added."""
        state = self.requests.get(request_id)
        if state is None:
            return None
        if request_id in self.prefill.requests:
            return Phase.PREFILLING if state in self.prefill.scheduler.running else Phase.WAITING
        if request_id in self.decode.requests:
            return Phase.DECODING
        return Phase.TRANSFER

    # -- queueing: a request belongs to exactly one pool, or to the transfer queue --------------

    def _check_fits(self, request: Request, total_tokens: int) -> None:
        bm = self.prefill.block_manager
        need = bm.blocks_for(len(request.prompt_token_ids))
        if need > bm.num_usable_blocks:
            raise RequestTooLongError(
                f"a {len(request.prompt_token_ids)}-token prompt needs {need} KV blocks but the "
                f"prefill pool has {bm.num_usable_blocks}"
            )
        self.decode._check_fits(request, total_tokens)

    def _enqueue(self, state: RequestState) -> None:
        self.prefill.requests[state.request_id] = state
        self.prefill._enqueue(state)

    def _dequeue(self, state: RequestState) -> None:
        if self.prefill.requests.pop(state.request_id, None) is not None:
            self.prefill._dequeue(state)
        elif self.decode.requests.pop(state.request_id, None) is not None:
            self.decode._dequeue(state)
        else:
            self._in_transfer.remove(state)
            self.prefill.block_manager.free(state)

    # -- one step ----------------------------------------------------------------------------------

    def _step(self) -> list[StepOutput]:
        self._hand_off()
        outputs = self.decode._step()
        # Backpressure (see the module docstring): prefill only what the decode pool can take
        # at the next step, or one request ready for the next slot that frees.
        dec = self.decode.scheduler
        room = dec.max_batch_size - len(dec.running) - len(dec.waiting)
        if len(self._in_transfer) < max(1, room):
            outputs += self.prefill._step()
        # A request that has sampled its first token leaves the prefill scheduler (which would
        # otherwise decode it there) but keeps its blocks until the decode pool takes it.
        sampled = [s for s in self.prefill.scheduler.running if s.num_output_tokens]
        for state in sampled:
            self.prefill.scheduler.running.remove(state)
            del self.prefill.requests[state.request_id]
            self._in_transfer.append(state)
        for out in outputs:
            if out.finished:
                del self.requests[out.request_id]
        self.total_slot_steps = self.prefill.total_slot_steps + self.decode.total_slot_steps
        self.wasted_slot_steps = self.prefill.wasted_slot_steps + self.decode.wasted_slot_steps
        return outputs

    def _hand_off(self) -> None:
        """Move prefilled requests into the decode pool, oldest first, while it has room."""
        sched, bm = self.decode.scheduler, self.decode.block_manager
        # Requests the decode pool preempted go first: they were there before any newcomer.
        while self._in_transfer and not sched.waiting and len(sched.running) < sched.max_batch_size:
            state = self._in_transfer[0]
            # Room for the sampled token too, so its first decode step needs no new block.
            if bm.blocks_for(state.num_tokens) > bm.num_free_blocks:
                return
            self._in_transfer.popleft()
            num_blocks = len(state.block_ids)
            payload = self.connector.send(
                self.prefill.runner, state.block_ids, state.num_computed_tokens
            )
            self.prefill.block_manager.free(state)
            allocated = bm.allocate(state, state.num_tokens)
            assert allocated, "checked above: the decode pool has the blocks"
            self.connector.receive(payload, self.decode.runner, state.block_ids[:num_blocks])
            self.decode.requests[state.request_id] = state
            sched.running.append(state)

    def stats(self) -> DisaggregatedStats:
        p, d = self.prefill.stats(), self.decode.stats()
        summed = {f.name: getattr(p, f.name) + getattr(d, f.name) for f in fields(EngineStats)}
        summed["num_running"] += len(self._in_transfer)
        return DisaggregatedStats(
            **summed,
            num_in_transfer=len(self._in_transfer),
            transfers=self.connector.transfers,
            transferred_bytes=self.connector.transferred_bytes,
        )
