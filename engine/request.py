"""Requests and their lifecycle: SamplingParams, Request, RequestState, StepOutput, finish reasons;
what a request carries for its grammar (`TokenConstraint`, engine.structured) and its prompt
outputs (`Pooling`, `PromptOutputs`, filled by engine.prompt_outputs).

`SamplingParams` validates itself (an `InvalidRequestError` naming the field). `RequestState` is
the engine's mutable view of one request: its tokens, how many of them have KV in the pool
(`num_computed_tokens`), its block table, its random generator. The one rule the scheduler
follows is that `num_computed_tokens` catches up to `num_tokens`.
"""

from __future__ import annotations

import enum
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.errors import InvalidRequestError

_ids = itertools.count()


def _next_request_id() -> str:
    return f"req-{next(_ids)}"


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop. Defaults are greedy decoding of 16 tokens."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int | None = None  # None: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF style, over prompt and output tokens
    presence_penalty: float = 0.0  # OpenAI style, over output tokens
    frequency_penalty: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # top-N logprobs with each sampled token (0: just the sampled one)
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    # Logprobs of the prompt's tokens (top-N alternatives each; engine.prompt_outputs). With
    # max_tokens 0 the request ends after its prompt (a loglikelihood: echo, max_tokens=0).
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"{name} {why}, got {getattr(self, name)!r}", param=name)

        if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise bad("max_tokens", "must be an integer >= 1 (or 0: the prompt only)")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a finite number >= 0")
        if self.top_k is not None and not (isinstance(self.top_k, int) and self.top_k >= 1):
            raise bad("top_k", "must be a positive integer or None (off)")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise bad("repetition_penalty", "must be > 0")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", "must be an integer in [0, max_tokens]")
        if self.logprobs is not None and not (
            isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20
        ):
            raise bad("logprobs", "must be an integer in [0, 20]")
        if self.prompt_logprobs is not None and not (
            isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= 20
        ):
            raise bad("prompt_logprobs", "must be an integer in [0, 20]")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        for tok, bias in self.logit_bias:
            if not isinstance(tok, int) or tok < 0 or not -100 <= bias <= 100:
                raise InvalidRequestError(
                    f"logit_bias entries must map token ids to [-100, 100], got {tok}: {bias}",
                    param="logit_bias",
                )

    @property
    def greedy(self) -> bool:
        # Below 1e-5 (vLLM's bound) dividing logits by the temperature overflows to inf.
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


@dataclass(slots=True)
class Request:
    """What a client asks for, in token ids. `request_id` is unique unless the caller sets it."""

    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=_next_request_id)
    arrival_time: float = field(default_factory=time.monotonic)
    # Prefix-cache namespace: only requests with the same salt share cached KV blocks (None is
    # the shared default). A tenant that must not share sets its own, as vLLM's `cache_salt`.
    cache_salt: str | None = None
    # Scheduling: lower runs earlier under the priority and fair policies (vLLM's semantics).
    priority: int = 0
    # Whose request this is, for per-client fair sharing (an API key or X-Client-Id); None is
    # one anonymous client.
    client_id: str | None = None
    # Structured output: this request's grammar state (engine.structured), built off the step
    # path; the sampler masks its row with it and the engine advances it. In-process only.
    constraint: TokenConstraint | None = None
    # An embedding request: prefill only, its prompt's final hidden states pooled
    # (engine.prompt_outputs); no token is sampled.
    pooling: Pooling | None = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise InvalidRequestError("prompt_token_ids must not be empty", "prompt_token_ids")
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise InvalidRequestError(
                f"priority must be an integer, got {self.priority!r}", "priority"
            )
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise InvalidRequestError("cache_salt must be a string", "cache_salt")


class RequestStatus(enum.IntEnum):
    """Ordered: everything from FINISHED_STOPPED on is terminal."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    # The request's grammar could not go on (a dead end, a limit hit): `RequestState.error`.
    FINISHED_ERROR = 6

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


# The one table from internal finish states to OpenAI finish_reason.
FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The sampled token's logprob and the top-N alternatives (id, logprob), best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None  # 1 + how many tokens are likelier (prompt logprobs carry it)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepOutput:
    """What one step produced for one request: new token ids, and whether it has finished.
    Built by keywords; an engine builds it from the request's state (`RequestState.output`)."""

    request_id: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # When the engine first scheduled the request (time.monotonic), for queue-time metrics;
    # None from an engine that does not record it.
    first_scheduled_time: float | None = None
    # With the first output of a request that asked for them: one per prompt token (None for
    # the first). The pooled, L2-normalised embedding of an embedding request's prompt.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    embedding: list[float] | None = None
    # With finish_reason "error": what went wrong, in the client's terms (its grammar's state).
    error: str | None = None


class TokenConstraint(Protocol):
    """Per-request grammar state, as the sampler and engine use it."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-token bits into `bitmask[row]` (int32, 32 tokens a word)."""
        ...

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the grammar rejects it."""
        ...

    @property
    def is_finished(self) -> bool:
        """The grammar is complete: nothing but end-of-sequence may follow."""
        ...

    @property
    def error(self) -> str | None:
        """Why the grammar cannot go on (a dead end, a limit hit), for the client; None while
        it can. A request whose constraint has an error ends with it, not with `stop`."""
        ...


class Pooling(enum.Enum):
    """How an embedding request's prompt hidden states become one vector."""

    MEAN = "mean"
    LAST = "last"


class PromptOutputs:
    """One request's prompt logprobs and pooled hidden state, filled chunk by chunk."""

    __slots__ = ("top_n", "logprobs", "pooling", "pooled", "sent")

    def __init__(self, num_prompt_tokens: int, top_n: int | None, pooling: Pooling | None):
        self.top_n = top_n
        self.logprobs: list[TokenLogprob | None] | None = (
            [None] * num_prompt_tokens if top_n is not None else None
        )
        self.pooling = pooling
        self.pooled: torch.Tensor | None = None  # float64 (d,): running sum, or the last state
        self.sent = False  # prompt logprobs go out once, with the request's first output

    @staticmethod
    def for_state(state: RequestState) -> PromptOutputs | None:
        top_n = state.params.prompt_logprobs
        pooling = state.request.pooling
        if top_n is None and pooling is None:
            return None
        return PromptOutputs(state.num_prompt_tokens, top_n, pooling)

    def embedding(self, num_prompt_tokens: int) -> list[float]:
        assert self.pooled is not None, "embedding before the prompt was computed"
        v = self.pooled / num_prompt_tokens if self.pooling is Pooling.MEAN else self.pooled
        return (v / v.norm().clamp_min(1e-12)).tolist()


class RequestState:
    """The engine's mutable record of one request."""

    __slots__ = (
        "request",
        "params",
        "status",
        "token_ids",
        "num_prompt_tokens",
        "num_computed_tokens",
        "num_cached_tokens",
        "block_ids",
        "state_slot",
        "generator",
        "stop_ids",
        "num_preemptions",
        "first_scheduled_time",
        "block_hashes",
        "paused",
        "constraint",
        "prompt_out",
        "error",
    )

    def __init__(self, request: Request, eos_token_ids: tuple[int, ...]) -> None:
        self.request = request
        self.params = request.params
        self.status = RequestStatus.WAITING
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.block_ids: list[int] = []
        # A hybrid model's live recurrent state slot while running (engine.state_pool).
        self.state_slot: int | None = None
        # Every request owns its generator: a seeded request then draws the same numbers
        # whatever else shares its batch.
        self.generator: torch.Generator | None = None
        if not self.params.greedy:
            self.generator = torch.Generator()
            if self.params.seed is not None:
                self.generator.manual_seed(self.params.seed)
            else:
                self.generator.seed()
        eos = () if self.params.ignore_eos else tuple(eos_token_ids)
        self.stop_ids = frozenset(eos) | frozenset(self.params.stop_token_ids)
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None
        # Prefix-cache keys of the full blocks hashed so far (engine.block_manager.block_keys).
        self.block_hashes: list[bytes] = []
        # The reader is behind (backpressure): not scheduled until resumed.
        self.paused = False
        self.constraint = request.constraint
        self.error: str | None = None  # why it ended with FINISHED_ERROR
        # Prompt logprobs / embedding being computed (engine.prompt_outputs), or None.
        self.prompt_out = None
        if self.params.prompt_logprobs is not None or request.pooling is not None:
            self.prompt_out = PromptOutputs.for_state(self)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def output(
        self,
        token_ids: list[int],
        logprobs: list[TokenLogprob] | None = None,
        *,
        prompt_logprobs: list[TokenLogprob | None] | None = None,
        embedding: list[float] | None = None,
    ) -> StepOutput:
        """This step's output for the request: `token_ids` new, and where it stands now."""
        return StepOutput(
            request_id=self.request_id,
            token_ids=token_ids,
            finished=self.finished,
            finish_reason=self.finish_reason,
            logprobs=logprobs,
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=self.num_cached_tokens,
            first_scheduled_time=self.first_scheduled_time,
            prompt_logprobs=prompt_logprobs,
            embedding=embedding,
            error=self.error,
        )

    def __repr__(self) -> str:
        return (
            f"RequestState({self.request_id}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})"
        )
