"""The engines: continuous batching, its static-batching baseline, and the naive oracle.

`StaticBatchEngine` and `ContinuousBatchEngine` share everything (block manager, model runner,
sampler, stop rules) and differ only in the scheduler's admission and retirement rule: the seed's
point that continuous batching changes *when* a sequence joins and leaves, nothing else.
`NaiveEngine` serves one request at a time with no KV cache, recomputing the whole sequence for
every token: slow on purpose, it is the correctness oracle.

All engines are synchronous and single-threaded: the server's driver calls `add_request`, `abort`
and `step` from one thread at a time.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import replace

import torch

from engine.block_manager import BlockManager
from engine.errors import DuplicateRequestError, InvalidRequestError, RequestTooLongError
from engine.interface import EngineConfig, EngineStats
from engine.model_runner import ModelRunner, run_full_sequence
from engine.policy import make_policy
from engine.request import Request, RequestState, RequestStatus, StepOutput, TokenLogprob
from engine.sampling import sample
from engine.scheduler import Scheduler
from engine.step_budget import StepBudget
from models.base import CausalLM, LoadedModel

# A pool sized without a budget holds every slot's full context, capped at both of these: a busy
# server touches the whole pool (the prefix cache hands out every free block in turn), so the cap
# is what its RSS grows by. 40,960 tokens (five 8k contexts) is what binds for compact caches (an
# int8 pool: 0.5 GiB of SmolLM2), 0.75 GiB for the rest (34,900 float16 tokens of SmolLM2).
DEFAULT_KV_CACHE_GIB = 0.75
DEFAULT_KV_CACHE_TOKENS = 40_960


def engine_config(config: EngineConfig | None, options: dict[str, object]) -> EngineConfig:
    """The config an engine constructor was given: `config`, or keywords naming its fields
    (`max_batch_size=8`), or `config` with some fields replaced by keywords."""
    if config is None:
        return EngineConfig(**options)  # type: ignore[arg-type]
    if options:
        return replace(config, **options)  # type: ignore[arg-type]
    return config


def _unwrap(model: CausalLM | LoadedModel) -> CausalLM:
    """Engines take the model, or a models.LoadedModel."""
    if isinstance(model, LoadedModel):
        model = model.model
    if not isinstance(model, CausalLM):
        raise TypeError(f"an engine needs a models.CausalLM (or a LoadedModel), got {model!r}")
    return model


class EngineBase:
    """Request bookkeeping every engine shares: validation, stop rules, aborts, outputs.

    Implements `engine.interface.Engine`. A subclass says where a request waits and how a step
    runs through four hooks: `_check_fits`, `_enqueue`, `_dequeue` and `_step`.
    """

    name = "base"

    def __init__(self, model: CausalLM | LoadedModel, config: EngineConfig) -> None:
        self.model = _unwrap(model)
        self.config = config
        self.model_config = self.model.config
        self.eos_token_ids = tuple(self.model_config.eos_token_ids)
        limit = self.model_config.max_position_embeddings
        # Prompt plus output tokens a request may reach (the Engine protocol's max_model_len).
        self.max_model_len = min(config.max_model_len or limit, limit)
        self.requests: dict[str, RequestState] = {}
        self._pending: list[StepOutput] = []  # terminal outputs of aborts, sent with the next step
        self.total_slot_steps = 0
        self.wasted_slot_steps = 0
        self.num_steps = 0

    # -- the public interface ------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise DuplicateRequestError(f"request id {request.request_id!r} is already running")
        n_prompt = len(request.prompt_token_ids)
        vocab = self.model_config.vocab_size
        bad = next(
            (t for t in request.prompt_token_ids if not (isinstance(t, int) and 0 <= t < vocab)),
            None,
        )
        if bad is not None:
            raise InvalidRequestError(
                f"prompt_token_ids contains {bad!r}, outside the vocabulary [0, {vocab})",
                "prompt_token_ids",
            )
        total = n_prompt + request.params.max_tokens
        if total > self.max_model_len:
            raise RequestTooLongError(
                f"this model's maximum context length is {self.max_model_len} tokens, but "
                f"{n_prompt} prompt tokens + {request.params.max_tokens} max_tokens = {total} were requested"
            )
        self._check_fits(request, total)
        state = RequestState(request, self.eos_token_ids)
        self.requests[request.request_id] = state
        self._enqueue(state)

    def abort(self, request_id: str) -> bool:
        """End a request now and free its blocks. True if it was live; idempotent."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return False
        self._dequeue(state)
        state.status = RequestStatus.FINISHED_ABORTED
        self._pending.append(
            StepOutput(
                request_id,
                [],
                True,
                "abort",
                None,
                state.num_prompt_tokens,
                state.num_cached_tokens,
                state.first_scheduled_time,
            )
        )
        return True

    def has_work(self) -> bool:
        # Paused requests wait for their reader: with nothing else, there is no step to run.
        return bool(self._pending) or any(not s.paused for s in self.requests.values())

    def pause(self, request_id: str) -> None:
        """Stop scheduling a request whose reader is behind (backpressure); it keeps its place
        and its blocks until the scheduler needs them for someone else. Idempotent."""
        state = self.requests.get(request_id)
        if state is not None:
            state.paused = True

    def resume(self, request_id: str) -> None:
        """Schedule a paused request again. Idempotent."""
        state = self.requests.get(request_id)
        if state is not None:
            state.paused = False

    def step(self) -> list[StepOutput]:
        outputs, self._pending = self._pending, []
        # Inference mode is thread-local: entered here, it holds in whichever thread steps.
        with torch.inference_mode():
            outputs += self._step()
        self.num_steps += 1
        return outputs

    def stats(self) -> EngineStats:
        raise NotImplementedError

    # -- shared by subclasses --------------------------------------------------------------------

    def _append_token(self, state: RequestState, token: int, lp: TokenLogprob | None) -> StepOutput:
        """Record a sampled token, apply the stop rules, and describe it as a StepOutput."""
        state.token_ids.append(token)
        p = state.params
        grammar_done = False
        if state.constraint is not None:
            # Advance the grammar; once it is complete (or, never with the mask applied, rejects
            # the token) the request ends here, without waiting for the model to pick EOS.
            grammar_done = not state.constraint.accept(token) or state.constraint.is_finished
        if grammar_done or (token in state.stop_ids and state.num_output_tokens >= p.min_tokens):
            state.status = RequestStatus.FINISHED_STOPPED
        elif state.num_output_tokens >= p.max_tokens or state.num_tokens >= self.max_model_len:
            state.status = RequestStatus.FINISHED_LENGTH
        if state.finished:
            del self.requests[state.request_id]
        return StepOutput(
            state.request_id,
            [token],
            state.finished,
            state.finish_reason,
            None if lp is None else [lp],
            state.num_prompt_tokens,
            state.num_cached_tokens,
            state.first_scheduled_time,
        )

    # -- hooks -----------------------------------------------------------------------------------

    def _check_fits(self, request: Request, total_tokens: int) -> None:
        """Raise RequestTooLongError for a request this engine's memory could never hold."""

    def _enqueue(self, state: RequestState) -> None:
        raise NotImplementedError

    def _dequeue(self, state: RequestState) -> None:
        raise NotImplementedError

    def _step(self) -> list[StepOutput]:
        raise NotImplementedError


class StaticBatchEngine(EngineBase):
    """Static batching: a batch forms only when the previous one has entirely finished.

    Finished members keep their slot and are still computed until the whole batch is done;
    `wasted_slot_steps` counts those rows.

    Built from an `EngineConfig`, or from its fields as keywords:
    `StaticBatchEngine(model, max_batch_size=8)`.
    """

    name = "static-batch"
    _static = True
    _default_prefix_caching = False

    def __init__(
        self,
        model: CausalLM | LoadedModel,
        config: EngineConfig | None = None,
        **options: object,
    ) -> None:
        config = engine_config(config, options)
        super().__init__(model, config)
        num_blocks = config.num_blocks
        if num_blocks is None:
            num_blocks = self._blocks_from_budget(config)
        caching = config.enable_prefix_caching
        if caching is None:
            caching = self._default_prefix_caching
        self.max_batch_size = config.max_batch_size
        self.block_manager = BlockManager(
            num_blocks, config.block_size, caching, model_identity=self.model_config.name
        )
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_batch_size,
            config.token_budget,
            static=self._static,
            policy=make_policy(config.scheduling),
        )
        self.runner = ModelRunner(self.model, num_blocks, config.block_size)
        self.step_budget = None
        if config.target_step_ms is not None and not self._static:
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
        self.scheduler.add(state)

    def _dequeue(self, state: RequestState) -> None:
        self.scheduler.remove(state)

    # -- a request built or computed by another engine (a composite engine's pool) ---------------

    def enqueue(self, state: RequestState) -> None:
        """Queue a request state another engine built and validated (it owns the abort path:
        `remove` takes the state out again without a terminal output)."""
        self.requests[state.request_id] = state
        self._enqueue(state)

    def remove(self, state: RequestState) -> None:
        """Take a request out wherever it is and free its blocks; no output is produced."""
        del self.requests[state.request_id]
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
            decoding = sum(
                not s.finished and s.num_tokens - s.num_computed_tokens <= 1
                for s in self.scheduler.running
            )
            self.scheduler.max_num_batched_tokens = sb.budget(decoding)
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
        self.scheduler.commit(sched)
        if not sampling:
            return []
        states = [r.state for r in sampling]
        tokens, logprobs = sample(logits, states)
        outputs = [
            self._append_token(s, t, lp) for s, t, lp in zip(states, tokens, logprobs, strict=True)
        ]
        # Retire now, not at the start of the next step: continuous batching frees a finished
        # request's blocks at once (also when no next step comes); static holds them until the
        # batch is done (the scheduler's retire decides).
        self.scheduler.retire()
        return outputs

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
        )


class ContinuousBatchEngine(StaticBatchEngine):
    """Continuous (iteration-level) batching, as in Orca.

    Each step retires finished requests, admits waiting ones into the freed slots, and runs one
    forward over prefill chunks and decode tokens together. Nothing about how tokens are computed
    differs from the static engine; only when a request may join and leave.
    """

    name = "continuous-batch"
    _static = False
    _default_prefix_caching = True


class NaiveEngine(EngineBase):
    """One request at a time, no KV cache, full recompute for every token: the oracle.

    Of the config it uses only `max_model_len` (it has no pool and no batch)."""

    name = "naive"

    def __init__(
        self,
        model: CausalLM | LoadedModel,
        config: EngineConfig | None = None,
        **options: object,
    ) -> None:
        super().__init__(model, engine_config(config, options))
        self.queue: deque[RequestState] = deque()

    def _enqueue(self, state: RequestState) -> None:
        self.queue.append(state)

    def _dequeue(self, state: RequestState) -> None:
        self.queue.remove(state)

    def _step(self) -> list[StepOutput]:
        state = next((s for s in self.queue if not s.paused), None)
        if state is None:
            return []
        state.status = RequestStatus.RUNNING
        logits = run_full_sequence(self.model, state.token_ids)
        self.total_slot_steps += 1
        tokens, logprobs = sample(logits, [state])
        out = self._append_token(state, tokens[0], logprobs[0])
        if state.finished:
            self.queue.remove(state)
        return [out]

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=min(len(self.queue), 1),
            num_waiting=max(len(self.queue) - 1, 0),
            num_free_blocks=0,
            num_total_blocks=0,
            num_preemptions=0,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            prefix_cache_evictions=0,
            total_slot_steps=self.total_slot_steps,
            wasted_slot_steps=0,
            num_slots=1,
            num_paused=sum(s.paused for s in self.queue),
        )
