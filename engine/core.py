"""What every engine shares (`EngineBase`: validation, stop rules, aborts, pause, outputs), and
the naive oracle.

`NaiveEngine` serves one request at a time with no KV cache, recomputing the whole sequence for
every token: slow on purpose, it is the correctness oracle. The batching engines are
`engine.batch`'s; engines made of pools of them, `engine.pooled`'s.

All engines are synchronous and single-threaded: the server's driver calls `add_request`, `abort`
and `step` from one thread at a time.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import replace

import torch

from engine.errors import DuplicateRequestError, InvalidRequestError, RequestTooLongError
from engine.interface import EngineConfig, EngineStats
from engine.model_runner import run_full_sequence
from engine.prompt_outputs import take_prompt_logprobs
from engine.request import Request, RequestState, RequestStatus, StepOutput, TokenLogprob
from engine.sampling import sample
from models.base import CausalLM, LoadedModel


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
    runs through four hooks: `_check_fits`, `_enqueue` (record it in `requests` and queue it),
    `_dequeue` (take it out of both) and `_step`.
    """

    name = "base"
    # Whether prompt logprobs, max_tokens 0 and embeddings (engine.prompt_outputs) are served.
    serves_prompt_outputs = False
    # Live requests by id: a dict of the engine's own, or (an engine made of pools) a view of
    # its pools' (`engine.pooled`).
    requests: Mapping[str, RequestState]

    def __init__(self, model: CausalLM | LoadedModel, config: EngineConfig) -> None:
        self.model = _unwrap(model)
        self.config = config
        self.model_config = self.model.config
        self.eos_token_ids = tuple(self.model_config.eos_token_ids)
        limit = self.model_config.max_position_embeddings
        # Prompt plus output tokens a request may reach (the Engine protocol's max_model_len).
        self.max_model_len = min(config.max_model_len or limit, limit)
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
        wants_prompt = request.params.prompt_logprobs is not None or request.pooling is not None
        if (wants_prompt or request.params.max_tokens == 0) and not self.serves_prompt_outputs:
            raise InvalidRequestError(
                f"the {self.name} engine does not compute prompt logprobs or embeddings "
                "(max_tokens 0 needs them)",
                "prompt_logprobs",
            )
        total = n_prompt + request.params.max_tokens
        if total > self.max_model_len:
            raise RequestTooLongError(
                f"this model's maximum context length is {self.max_model_len} tokens, but "
                f"{n_prompt} prompt tokens + {request.params.max_tokens} max_tokens = {total} were requested"
            )
        self._check_fits(request, total)
        self._enqueue(RequestState(request, self.eos_token_ids))

    def abort(self, request_id: str) -> bool:
        """End a request now and free its blocks. True if it was live; idempotent."""
        state = self.requests.get(request_id)
        if state is None:
            return False
        self._dequeue(state)
        state.status = RequestStatus.FINISHED_ABORTED
        self._pending.append(state.output([]))
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
        """Record a sampled token, apply the stop rules, and describe it as a StepOutput. (An
        engine that samples keeps its own `requests` dict: a finished request leaves it here.)"""
        state.token_ids.append(token)
        p = state.params
        grammar_done = False
        if state.constraint is not None:
            # Advance the grammar; once it is complete the request ends here, without waiting
            # for the model to pick EOS. A grammar that cannot go on (its mask found a dead end
            # or hit a limit; or, never with the mask applied, it rejects the token) ends the
            # request with its error: that is no normal end.
            accepted = state.constraint.accept(token)
            state.error = state.constraint.error
            if state.error is None and not accepted:
                state.error = "the grammar rejected the sampled token"
            grammar_done = state.constraint.is_finished
        if state.error is not None:
            state.status = RequestStatus.FINISHED_ERROR
        elif grammar_done or (token in state.stop_ids and state.num_output_tokens >= p.min_tokens):
            state.status = RequestStatus.FINISHED_STOPPED
        elif state.num_output_tokens >= p.max_tokens or state.num_tokens >= self.max_model_len:
            state.status = RequestStatus.FINISHED_LENGTH
        if state.finished:
            del self.requests[state.request_id]  # type: ignore[attr-defined]
        return state.output(
            [token], None if lp is None else [lp], prompt_logprobs=take_prompt_logprobs(state)
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
        self.requests: dict[str, RequestState] = {}
        self.queue: deque[RequestState] = deque()

    def _enqueue(self, state: RequestState) -> None:
        self.requests[state.request_id] = state
        self.queue.append(state)

    def _dequeue(self, state: RequestState) -> None:
        del self.requests[state.request_id]
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
