"""The batching engine: one class, two modes.

`BatchEngine` runs requests over a paged KV cache: block manager, scheduler, model runner,
sampler, stop rules. Its `BatchMode` says only *when* a request may join and leave the batch
(the book chapter's point: continuous batching changes that, nothing else):

- `CONTINUOUS` (iteration-level, as in Orca): each step retires finished requests, admits waiting
  ones into the freed slots, and runs one forward over prefill chunks and decode tokens together.
  Prefix caching is on by default; `target_step_ms` sizes the step's token budget.
- `STATIC`: a batch forms only when the previous one has entirely finished. Finished members keep
  their slot and are still computed until the whole batch is done (`wasted_slot_steps`).

`ContinuousBatchEngine(model)` and `StaticBatchEngine(model)` are the two modes by their names
(the engine contract's spelling). Engines made of pools drive a `BatchEngine` through its hand-off
API (`enqueue`, `remove`, `detach`, `release`, `can_admit`, `admit_running`).
"""

from __future__ import annotations

import enum
import math
import time

from engine.block_manager import BlockManager
from engine.core import EngineBase, engine_config
from engine.errors import RequestTooLongError
from engine.interface import EngineConfig, EngineStats
from engine.model_runner import ModelRunner
from engine.policy import make_policy
from engine.prompt_outputs import finish_prefill_only, is_prefill_only
from engine.request import Request, RequestState, StepOutput
from engine.sampling import sample
from engine.scheduler import Scheduler
from engine.state_pool import StateSlots
from engine.step_budget import StepBudget
from models.base import CausalLM, LoadedModel

# A pool sized without a budget holds every slot's full context, capped at both of these: a busy
# server touches the whole pool (the prefix cache hands out every free block in turn), so the cap
# is what its RSS grows by. 40,960 tokens (five 8k contexts) is what binds for compact caches (an
# int8 pool: 0.5 GiB of SmolLM2), 0.75 GiB for the rest (34,900 float16 tokens of SmolLM2).
DEFAULT_KV_CACHE_GIB = 0.75
DEFAULT_KV_CACHE_TOKENS = 40_960
# A hybrid model's recurrent state comes out of the same budget (`--kv-cache-memory`): live state
# slots (one per running request) take at most half of it, prefix-cache snapshots at most an
# eighth, the K/V blocks of its attention layers the rest. With fewer slots than
# `max_batch_size`, the batch is as large as the slots: admission waits for one.
STATE_SHARE = 0.5
SNAPSHOT_SHARE = 0.125


class BatchMode(enum.Enum):
    """When a request may join and leave the batch; the value is the engine's name."""

    CONTINUOUS = "continuous-batch"
    STATIC = "static-batch"


class BatchEngine(EngineBase):
    """Batching over a paged KV cache, continuous or static (`mode`).

    Built from an `EngineConfig`, or from its fields as keywords:
    `BatchEngine(model, max_batch_size=8, mode=BatchMode.STATIC)`.
    """

    mode = BatchMode.CONTINUOUS  # the default; `mode=` picks the other
    name = mode.value
    serves_prompt_outputs = True

    def __init__(
        self,
        model: CausalLM | LoadedModel,
        config: EngineConfig | None = None,
        *,
        mode: BatchMode | None = None,
        **options: object,
    ) -> None:
        config = engine_config(config, options)
        super().__init__(model, config)
        if mode is not None:
            self.mode = mode
        self.name = self.mode.value
        static = self.mode is BatchMode.STATIC
        self.requests: dict[str, RequestState] = {}
        caching = config.enable_prefix_caching
        if caching is None:
            caching = not static
        if self.model_config.state_layout is None:
            num_blocks = config.num_blocks
            if num_blocks is None:
                num_blocks = self._blocks_from_budget(config)
            states = None
            self.max_batch_size = config.max_batch_size
        else:
            num_blocks, states = self._hybrid_pools(config, caching)
            self.max_batch_size = min(config.max_batch_size, states.num_live)
        self.block_manager = BlockManager(
            num_blocks,
            config.block_size,
            caching,
            model_identity=self.model_config.name,
            states=states,
        )
        self.scheduler = Scheduler(
            self.block_manager,
            self.max_batch_size,
            config.token_budget,
            static=static,
            policy=make_policy(config.scheduling),
        )
        self.runner = ModelRunner(self.model, num_blocks, config.block_size, states)
        self.runner.warm_up()
        self.step_budget = None
        if config.target_step_ms is not None and not static:
            self.step_budget = StepBudget(config.target_step_ms / 1000, config.token_budget)

    def _blocks_from_budget(self, config: EngineConfig) -> int:
        """Size the pool from a memory budget; without one, enough for every slot to reach the
        full context, capped at DEFAULT_KV_CACHE_GIB and DEFAULT_KV_CACHE_TOKENS."""
        per_block = self.model_config.kv_bytes_per_token * config.block_size
        if config.kv_cache_memory_gib is not None:
            return max(2, int(config.kv_cache_memory_gib * 2**30 // per_block))
        want = config.max_batch_size * math.ceil(self.max_model_len / config.block_size) + 1
        cap = min(
            int(DEFAULT_KV_CACHE_GIB * 2**30 // per_block),
            DEFAULT_KV_CACHE_TOKENS // config.block_size + 1,
        )
        return max(2, min(want, cap))

    def _hybrid_pools(self, config: EngineConfig, caching: bool) -> tuple[int, StateSlots]:
        """A hybrid model's KV blocks and state slots from one budget (`STATE_SHARE`,
        `SNAPSHOT_SHARE`; without a budget, DEFAULT_KV_CACHE_GIB, the K/V capped as
        `_blocks_from_budget` caps it). With `num_blocks` given: a live slot per batch slot and
        as many snapshot slots."""
        layout = self.model_config.state_layout
        assert layout is not None
        if config.num_blocks is not None:
            live = config.max_batch_size
            return config.num_blocks, StateSlots(live, live if caching else 0)
        gib = config.kv_cache_memory_gib
        budget = (DEFAULT_KV_CACHE_GIB if gib is None else gib) * 2**30
        per_slot = layout.bytes_per_slot
        live = min(config.max_batch_size, int(budget * STATE_SHARE // per_slot))
        if live < 1:
            raise ValueError(
                f"a KV cache budget of {budget / 2**30:.3g} GiB cannot hold one request's "
                f"recurrent state ({per_slot / 2**20:.1f} MiB, at most {STATE_SHARE:.0%} of the "
                f"budget): raise --kv-cache-memory to at least "
                f"{per_slot / STATE_SHARE / 2**30:.3g} GiB"
            )
        snapshots = min(live, int(budget * SNAPSHOT_SHARE // per_slot)) if caching else 0
        per_block = self.model_config.kv_bytes_per_token * config.block_size
        blocks = int((budget - (live + snapshots + 1) * per_slot) // per_block)
        if gib is None:
            want = config.max_batch_size * math.ceil(self.max_model_len / config.block_size) + 1
            blocks = min(blocks, want, DEFAULT_KV_CACHE_TOKENS // config.block_size + 1)
        return max(2, blocks), StateSlots(live, snapshots)

    # -- queueing --------------------------------------------------------------------------------

    def check_fits(self, num_tokens: int) -> None:
        """Raise RequestTooLongError if a request of `num_tokens` tokens could never fit the pool."""
        bm = self.block_manager
        need, usable = bm.blocks_for(num_tokens), bm.num_usable_blocks
        if need > usable:
            raise RequestTooLongError(
                f"{num_tokens} tokens (prompt + max_tokens) need {need} KV blocks but the pool "
                f"has {usable}"
            )

    def _check_fits(self, request: Request, total_tokens: int) -> None:
        self.check_fits(total_tokens)

    def _enqueue(self, state: RequestState) -> None:
        self.requests[state.request_id] = state
        self.scheduler.add(state)

    def _dequeue(self, state: RequestState) -> None:
        del self.requests[state.request_id]
        self.scheduler.remove(state)

    # -- the hand-off API: a request built or computed by another engine (a pool's owner) ---------

    def enqueue(self, state: RequestState) -> None:
        """Queue a request state another engine built and validated (it owns the abort path:
        `remove` takes the state out again without a terminal output)."""
        self._enqueue(state)

    def remove(self, state: RequestState) -> None:
        """Take a request out wherever it is and free its blocks; no output is produced."""
        self._dequeue(state)

    def detach(self, state: RequestState) -> None:
        """Hand a running, unfinished request out of this engine with its blocks, which keep its
        K/V until `release` frees them (after the K/V has been read out)."""
        del self.requests[state.request_id]
        self.scheduler.detach(state)

    def release(self, state: RequestState) -> None:
        """Free the blocks a detached request still holds in this pool."""
        self.block_manager.free(state)

    def can_admit(self, num_tokens: int) -> bool:
        """Whether `admit_running` would take a request of `num_tokens` tokens now."""
        bm = self.block_manager
        return self.scheduler.has_free_slot and bm.blocks_for(num_tokens) <= bm.num_free_blocks

    def admit_running(self, state: RequestState) -> None:
        """Take in a request whose first `num_computed_tokens` tokens were computed elsewhere:
        allocate blocks for all its tokens and join it to the running batch (check `can_admit`
        first). Its K/V must be written into `state.block_ids` before the next step."""
        allocated = self.block_manager.allocate(state, state.num_tokens)
        assert allocated, "admit_running without can_admit"
        self.scheduler.admit_running(state)
        self.requests[state.request_id] = state

    # -- one step ----------------------------------------------------------------------------------

    def _step(self) -> list[StepOutput]:
        sb = self.step_budget
        if sb is not None:
            sch = self.scheduler
            live = [s for s in sch.running if not s.finished]
            prefilling = [s for s in live if s.num_tokens - s.num_computed_tokens > 1]
            # Waiting for a first token: running prompts mid-prefill, and the queued requests
            # this step could admit (a full batch admits none).
            admissible = min(len(sch.waiting), max(0, sch.max_batch_size - len(sch.running)))
            decoding, first = len(live) - len(prefilling), len(prefilling) + admissible
            waited = 0.0
            if decoding and first:  # (how long only matters when both groups share the step)
                oldest = min(s.request.arrival_time for s in (*prefilling, *sch.waiting))
                waited = time.monotonic() - oldest
            sch.max_num_batched_tokens = sb.budget(decoding, first, waited)
        sched = self.scheduler.schedule()
        if not sched.rows:
            return []
        self.total_slot_steps += len(sched.rows)
        self.wasted_slot_steps += sum(r.wasted for r in sched.rows)
        t0 = time.perf_counter()
        logits, sampling = self.runner.execute(sched.rows)
        if sb is not None:
            rows = [r.num_new_tokens for r in sched.rows]
            decodes = sum(n == 1 for n in rows)
            sb.observe(decodes, sum(rows) - decodes, time.perf_counter() - t0)
        # Prefill-only requests (embeddings, max_tokens 0) end with their prompt, unsampled.
        done = [r.state for r in sched.rows if r.samples and is_prefill_only(r.state)]
        self.scheduler.commit(sched)
        outputs = [self._finish_prefill_only(s) for s in done]
        if sampling:
            states = [r.state for r in sampling]
            tokens, logprobs = sample(logits, states)
            outputs += [
                self._append_token(s, t, lp)
                for s, t, lp in zip(states, tokens, logprobs, strict=True)
            ]
        # Retire now, not at the start of the next step: continuous batching frees a finished
        # request's blocks at once (also when no next step comes); static holds them until the
        # batch is done (the scheduler's retire decides).
        self.scheduler.retire()
        return outputs

    def _finish_prefill_only(self, state: RequestState) -> StepOutput:
        out = finish_prefill_only(state)
        del self.requests[state.request_id]
        return out

    def stats(self) -> EngineStats:
        bm, sch = self.block_manager, self.scheduler
        return EngineStats(
            num_running=sum(not s.finished for s in sch.running),
            num_waiting=len(sch.waiting),
            num_free_blocks=bm.num_free_blocks,
            num_total_blocks=bm.num_usable_blocks,
            num_preemptions=sch.num_preemptions,
            prefix_cache_queries=bm.counters.queried_tokens,
            prefix_cache_hits=bm.counters.hit_tokens,
            prefix_cache_evictions=bm.counters.evictions,
            total_slot_steps=self.total_slot_steps,
            wasted_slot_steps=self.wasted_slot_steps,
            num_slots=sch.max_batch_size,
            num_paused=sum(s.paused for s in self.requests.values()),
            **self._state_stats(),
        )

    def _state_stats(self) -> dict[str, int]:
        states = self.block_manager.states
        if states is None:
            return {}
        return dict(
            num_state_slots=states.num_live,
            num_free_state_slots=states.num_free_live,
            num_state_snapshot_slots=states.num_snapshots,
            num_state_snapshots=states.num_cached_snapshots,
            state_bytes_per_slot=self.model_config.state_layout.bytes_per_slot,
        )


class ContinuousBatchEngine(BatchEngine):
    """`BatchEngine` in continuous mode: `ContinuousBatchEngine(model, max_batch_size=8)`."""

    mode = BatchMode.CONTINUOUS
    name = mode.value


class StaticBatchEngine(BatchEngine):
    """`BatchEngine` in static mode: `StaticBatchEngine(model, max_batch_size=8)`."""

    mode = BatchMode.STATIC
    name = mode.value
