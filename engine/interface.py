"""What every engine is: the `Engine` protocol, the `EngineConfig` it is built from, its stats.

The server's driver, the in-process tools and the tests are typed against `Engine` and nothing
else: an engine takes requests in token ids (`add_request`), ends them early (`abort`), and
advances every live request by one `step`, which returns that step's `StepOutput`s; `pause` and
`resume` hold a request back while its reader is behind (backpressure). It is
synchronous and single-threaded; the driver calls it from one thread at a time.

`EngineConfig` holds the sizing every engine shares (slots, KV blocks or a memory budget, the
step's token budget, prefix caching, context cap) and the disaggregated engine's per-pool
overrides. It is validated once, here; `None` means "the engine's default" throughout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from engine.policy import SchedulingPolicy
from engine.request import Request, StepOutput


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
    # Batch slots (requests that can run at once); waiting requests up to the free slots start
    # at the next step, which is what admission control (`--max-waiting`) needs to know.
    num_slots: int
    # Requests paused because their reader is behind (backpressure); counted in running/waiting.
    num_paused: int
    # A hybrid model's recurrent state pool (engine.state_pool): live slots (one per running
    # request), those free, snapshot slots of the prefix cache and those holding a snapshot,
    # and one slot's bytes. All 0 for a model without recurrent layers.
    num_state_slots: int = 0
    num_free_state_slots: int = 0
    num_state_snapshot_slots: int = 0
    num_state_snapshots: int = 0
    state_bytes_per_slot: int = 0

    @property
    def num_cannot_start(self) -> int:
        """Waiting requests beyond the free batch slots: those the next step cannot start."""
        free = max(self.num_slots - self.num_running, 0)
        return max(self.num_waiting - free, 0)

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_total_blocks if self.num_total_blocks else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )


@runtime_checkable
class Engine(Protocol):
    """The contract between an engine and whatever drives it."""

    name: str  # short, for logs and /v1/models ("continuous-batch", "static-batch", ...)

    @property
    def max_model_len(self) -> int:
        """Prompt plus output tokens a request may reach."""
        ...

    def add_request(self, request: Request) -> None:
        """Queue a request; raises `InvalidRequestError` (or a subclass) if it is refused."""
        ...

    def abort(self, request_id: str) -> bool:
        """End a live request now and free its memory; its terminal output ("abort") comes with
        the next step. True if it was live. Idempotent."""
        ...

    def pause(self, request_id: str) -> None:
        """Stop scheduling a live request (its reader is behind); it keeps its place, and its
        memory until someone else needs it. Idempotent; unknown ids are ignored."""
        ...

    def resume(self, request_id: str) -> None:
        """Schedule a paused request again. Idempotent; unknown ids are ignored."""
        ...

    def step(self) -> list[StepOutput]:
        """Advance every scheduled request by one iteration; what each produced."""
        ...

    def has_work(self) -> bool:
        """Whether `step` has anything to do or to report."""
        ...

    def stats(self) -> EngineStats: ...


def _check(ok: bool, name: str, why: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{name} {why}, got {value!r}")


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How an engine is sized. Validated on construction (ValueError naming the field).

    The KV pool is `num_blocks` blocks if given, else sized from `kv_cache_memory_gib`, else
    enough for every slot to reach the full context (capped at 0.75 GiB and 40,960 tokens,
    `engine.batch.DEFAULT_KV_CACHE_GIB` / `DEFAULT_KV_CACHE_TOKENS`). The disaggregated engine
    sizes its two pools from the `prefill_*` / `decode_*` fields, each falling back to the shared
    one (`max_batch_size` is the decode pool's slots; the token budget is the prefill pool's).
    """

    max_batch_size: int = 8
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_gib: float | None = None
    max_num_batched_tokens: int | None = None  # None: max(512, max_batch_size)
    enable_prefix_caching: bool | None = None  # None: the engine's default
    max_model_len: int | None = None  # None: the model's context length
    # While requests decode, size each step's budget so the step takes about this long
    # (`engine.step_budget`); None: the fixed `token_budget` every step.
    target_step_ms: float | None = None
    # Who goes first: "fcfs", "priority" or "fair" (engine.policy explains them).
    scheduling: SchedulingPolicy = SchedulingPolicy.FCFS
    # The disaggregated engine's pools; None: the shared value above.
    prefill_max_batch_size: int | None = None
    prefill_num_blocks: int | None = None
    decode_num_blocks: int | None = None
    prefill_kv_cache_memory_gib: float | None = None
    decode_kv_cache_memory_gib: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "block_size"):
            value = getattr(self, name)
            _check(_positive_int(value), name, "must be an integer >= 1", value)
        for name in ("max_num_batched_tokens", "max_model_len", "prefill_max_batch_size"):
            value = getattr(self, name)
            _check(value is None or _positive_int(value), name, "must be an integer >= 1", value)
        for name in ("num_blocks", "prefill_num_blocks", "decode_num_blocks"):
            value = getattr(self, name)
            ok = value is None or (_positive_int(value) and value >= 2)
            _check(ok, name, "must be an integer >= 2 (block 0 is reserved)", value)
        for name in (
            "kv_cache_memory_gib",
            "prefill_kv_cache_memory_gib",
            "decode_kv_cache_memory_gib",
        ):
            value = getattr(self, name)
            ok = value is None or (
                isinstance(value, int | float) and math.isfinite(value) and value > 0
            )
            _check(ok, name, "must be > 0", value)
        target = self.target_step_ms
        ok = target is None or (
            isinstance(target, int | float) and math.isfinite(target) and target > 0
        )
        _check(ok, "target_step_ms", "must be > 0 or None", target)
        try:  # a name as a string is taken too
            object.__setattr__(self, "scheduling", SchedulingPolicy(self.scheduling))
        except ValueError:
            names = ", ".join(p.value for p in SchedulingPolicy)
            _check(False, "scheduling", f"must be one of {names}", self.scheduling)
        # Every running request decodes each step. (A pool's own config, `prefill_pool()`,
        # checks its own slots.)
        budget = self.max_num_batched_tokens
        ok = budget is None or budget >= self.max_batch_size
        why = f"must be >= max_batch_size ({self.max_batch_size})"
        _check(ok, "max_num_batched_tokens", why, budget)
        caching = self.enable_prefix_caching
        ok = caching is None or isinstance(caching, bool)
        _check(ok, "enable_prefix_caching", "must be True, False or None", caching)

    @property
    def token_budget(self) -> int:
        """Tokens one step may compute."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return max(512, self.max_batch_size)

    def prefill_pool(self) -> EngineConfig:
        """The prefill pool's own config (disaggregated engine)."""
        batch = self.prefill_max_batch_size
        return self._pool(
            self.max_batch_size if batch is None else batch,
            self.prefill_num_blocks,
            self.prefill_kv_cache_memory_gib,
            self.max_num_batched_tokens,
        )

    def decode_pool(self) -> EngineConfig:
        """The decode pool's own config (disaggregated engine). Its token budget is the default:
        it only prefills to recompute after a preemption."""
        return self._pool(
            self.max_batch_size, self.decode_num_blocks, self.decode_kv_cache_memory_gib, None
        )

    def _pool(
        self, batch: int, blocks: int | None, gib: float | None, budget: int | None
    ) -> EngineConfig:
        return EngineConfig(
            max_batch_size=batch,
            block_size=self.block_size,
            num_blocks=self.num_blocks if blocks is None else blocks,
            kv_cache_memory_gib=self.kv_cache_memory_gib if gib is None else gib,
            max_num_batched_tokens=budget,
            enable_prefix_caching=self.enable_prefix_caching,
            max_model_len=self.max_model_len,
            scheduling=self.scheduling,
        )
