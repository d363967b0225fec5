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
from collections import deque
from dataclasses import dataclass

import torch
from torch import nn

from engine.block_manager import BlockManager
from engine.errors import DuplicateRequestError, RequestTooLongError
from engine.model_runner import ModelRunner, run_full_sequence
from engine.request import Request, RequestState, RequestStatus, StepOutput, TokenLogprob
from engine.sampling import sample
from engine.scheduler import Scheduler
from models.llama import LlamaForCausalLM

DEFAULT_KV_CACHE_GIB = 1.0


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # of which served from cache
    prefix_cache_evictions: int
    total_slot_steps: int
    wasted_slot_steps: int

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_total_blocks if self.num_total_blocks else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )


def _unwrap(model) -> LlamaForCausalLM:
    """Engines take the torch module or a models.LoadedModel."""
    inner = getattr(model, "model", None)
    if isinstance(inner, nn.Module):
        model = inner
    if not hasattr(model, "config"):
        raise TypeError("engine needs a models.LlamaForCausalLM (or a LoadedModel)")
    return model


class _EngineBase:
    """Request bookkeeping every engine shares: validation, stop rules, aborts, outputs."""

    name = "base"

    def __init__(self, model, max_model_len: int | None = None) -> None:
        self.model = _unwrap(model)
        self.config = self.model.config
        self.eos_token_ids = tuple(self.config.eos_token_ids)
        self.max_model_len = min(
            max_model_len or self.config.max_position_embeddings,
            self.config.max_position_embeddings,
        )
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
        vocab = self.config.vocab_size
        bad = next(
            (t for t in request.prompt_token_ids if not (isinstance(t, int) and 0 <= t < vocab)),
            None,
        )
        if bad is not None:
            raise ValueError(
                f"prompt_token_ids contains {bad!r}, outside the vocabulary [0, {vocab})"
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
            )
        )
        return True

    def has_work(self) -> bool:
        return bool(self._pending) or bool(self.requests)

    def step(self) -> list[StepOutput]:
        outputs, self._pending = self._pending, []
        # Inference mode is thread-local: entered here, it holds in whichever thread steps.
        with torch.inference_mode():
            outputs += self._step()
        self.num_steps += 1
        return outputs

    # -- shared by subclasses --------------------------------------------------------------------

    def _append_token(self, state: RequestState, token: int, lp: TokenLogprob | None) -> StepOutput:
        """Record a sampled token, apply the stop rules, and describe it as a StepOutput."""
        state.token_ids.append(token)
        p = state.params
        if token in state.stop_ids and state.num_output_tokens >= p.min_tokens:
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
        )

    def _check_fits(self, request: Request, total_tokens: int) -> None:
        pass

    def _enqueue(self, state: RequestState) -> None:
        raise NotImplementedError

    def _dequeue(self, state: RequestState) -> None:
        raise NotImplementedError

    def _step(self) -> list[StepOutput]:
        raise NotImplementedError


class StaticBatchEngine(_EngineBase):
    """Static batching: a batch forms only when the previous one has entirely finished.

    Finished members keep their slot and are still computed until the whole batch is done;
    `wasted_slot_steps` counts those rows.
    """

    name = "static-batch"
    _static = True
    _default_prefix_caching = False

    def __init__(
        self,
        model,
        *,
        max_batch_size: int = 8,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_memory_gib: float | None = None,
        max_num_batched_tokens: int | None = None,
        enable_prefix_caching: bool | None = None,
        max_model_len: int | None = None,
    ) -> None:
        super().__init__(model, max_model_len)
        if num_blocks is None:
            num_blocks = self._blocks_from_budget(max_batch_size, block_size, kv_cache_memory_gib)
        if enable_prefix_caching is None:
            enable_prefix_caching = self._default_prefix_caching
        self.max_batch_size = max_batch_size
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            max_batch_size,
            max_num_batched_tokens or max(512, max_batch_size),
            static=self._static,
        )
        self.runner = ModelRunner(self.model, num_blocks, block_size)

    def _blocks_from_budget(self, max_batch_size: int, block_size: int, gib: float | None) -> int:
        """Size the pool from a memory budget; without one, enough for every slot to reach the
        full context, capped at DEFAULT_KV_CACHE_GIB."""
        per_block = self.config.kv_bytes_per_token * block_size
        if gib is not None:
            if gib <= 0:
                raise ValueError(f"kv_cache_memory_gib must be > 0, got {gib}")
            return max(2, int(gib * 2**30 // per_block))
        want = max_batch_size * math.ceil(self.max_model_len / block_size) + 1
        cap = int(DEFAULT_KV_CACHE_GIB * 2**30 // per_block)
        return max(2, min(want, cap))

    # -- queueing --------------------------------------------------------------------------------

    def _check_fits(self, request: Request, total_tokens: int) -> None:
        usable = self.block_manager.num_usable_blocks
        if self.block_manager.blocks_for(total_tokens) > usable:
            raise RequestTooLongError(
                f"{total_tokens} tokens (prompt + max_tokens) need "
                f"{self.block_manager.blocks_for(total_tokens)} KV blocks but the pool has {usable}"
            )

    def _enqueue(self, state: RequestState) -> None:
        self.scheduler.add(state)

    def _dequeue(self, state: RequestState) -> None:
        self.scheduler.remove(state)

    # -- one step ----------------------------------------------------------------------------------

    def _step(self) -> list[StepOutput]:
        sched = self.scheduler.schedule()
        if not sched.rows:
            return []
        self.total_slot_steps += len(sched.rows)
        self.wasted_slot_steps += sum(r.wasted for r in sched.rows)
        logits, sampling = self.runner.execute(sched.rows)
        for r in sched.rows:
            if not r.wasted:
                r.state.num_computed_tokens += r.num_new_tokens
                self.block_manager.cache_full_blocks(r.state)
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


class NaiveEngine(_EngineBase):
    """One request at a time, no KV cache, full recompute for every token: the oracle."""

    name = "naive"

    def __init__(self, model, *, max_model_len: int | None = None, **_ignored) -> None:
        super().__init__(model, max_model_len)
        self.queue: deque[RequestState] = deque()

    def _enqueue(self, state: RequestState) -> None:
        self.queue.append(state)

    def _dequeue(self, state: RequestState) -> None:
        self.queue.remove(state)

    def _step(self) -> list[StepOutput]:
        if not self.queue:
            return []
        state = self.queue[0]
        state.status = RequestStatus.RUNNING
        logits = run_full_sequence(self.model, state.token_ids)
        self.total_slot_steps += 1
        tokens, logprobs = sample(logits, [state])
        out = self._append_token(state, tokens[0], logprobs[0])
        if state.finished:
            self.queue.popleft()
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
        )


ENGINES: dict[str, type[_EngineBase]] = {
    "continuous": ContinuousBatchEngine,
    "static": StaticBatchEngine,
    "naive": NaiveEngine,
}


def make_engine(kind: str, model, **options) -> _EngineBase:
    """Build an engine by its short name ("continuous", "static", "naive")."""
    if kind == "disaggregated":
        # Imported here: the disaggregated engine is built from the classes above.
        from engine.disaggregated import DisaggregatedEngine

        return DisaggregatedEngine(model, **options)
    try:
        cls = ENGINES[kind]
    except KeyError:
        names = sorted([*ENGINES, "disaggregated"])
        raise ValueError(f"unknown engine {kind!r}; choose one of {names}") from None
    return cls(model, **options)
