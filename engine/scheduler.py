"""Who runs this step, and how many tokens each.

One rule explains it: every request has `num_computed_tokens` catching up to `num_tokens`.
A new request is behind by its whole prompt (prefill), a running one by the token it just sampled
(decode), a long prompt catches up across several steps when the token budget runs out (chunked
prefill), a prefix-cache hit starts it further along, and a preempted request falls back to zero
and catches up again (recompute), keeping the tokens it already generated.

Each step (finished requests were retired at the end of the step that finished them): schedule
running requests first (oldest first), then admit waiting ones while the batch has slots, the
step has token budget and the pool has blocks. When a running request needs a block and none is
free, the newest running request is preempted. After the forward, `commit` advances each row's
`num_computed_tokens`; after sampling, `retire` lets finished requests go.

Who goes first (admission order, preemption victims, how a step's tokens are shared) is the
`policy`'s (`engine.policy`: fcfs, priority, fair); nothing here names one.

`detach` and `admit_running` hand a request from one scheduler to another with its K/V (the
disaggregated engine's prefill-to-decode move; later a transfer between processes).

The static and continuous engines differ only in `_admission_open` and in what happens to a
finished member: continuous batching admits whenever a slot is free and retires a finished request
at once; static batching admits only into an empty batch, and a finished member keeps its slot and
is still computed (a wasted row) until the whole batch is done.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.policy import Policy
from engine.request import RequestState, RequestStatus


@dataclass(slots=True)
class ScheduledRequest:
    state: RequestState
    num_new_tokens: int  # tokens fed this step (0 for a wasted row)
    wasted: bool = False  # static batching: a finished member computed for nothing
    # A hybrid model's state snapshots the forward writes: (tokens of the row after which,
    # snapshot slot) (`BlockManager.plan_snapshots`).
    snapshots: list[tuple[int, int]] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """Does this row produce a token? Only when it catches up with all its tokens."""
        s = self.state
        return not self.wasted and s.num_computed_tokens + self.num_new_tokens == s.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    rows: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[RequestState] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.rows)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_batch_size: int,
        max_num_batched_tokens: int,
        static: bool = False,
        policy: Policy | None = None,
    ) -> None:
        # Sizes are validated once, by EngineConfig.
        self.bm = block_manager
        self.max_batch_size = max_batch_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.static = static
        self.policy = policy or Policy()
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        self.num_preemptions = 0

    # -- membership ----------------------------------------------------------------------------

    def add(self, state: RequestState) -> None:
        self.waiting.append(state)

    def remove(self, state: RequestState) -> None:
        """Take a request out wherever it is (abort) and free its blocks."""
        if state in self.running:
            self.running.remove(state)
        else:
            with contextlib.suppress(ValueError):
                self.waiting.remove(state)
        self.bm.free(state)

    @property
    def has_free_slot(self) -> bool:
        return len(self.running) < self.max_batch_size

    # -- handing a request from one scheduler to another (disaggregation, KV transfer) ----------

    def detach(self, state: RequestState) -> None:
        """Take a running request out of this scheduler, keeping its blocks (and their K/V):
        the caller moves it elsewhere, then frees them with `BlockManager.free`."""
        self.running.remove(state)

    def admit_running(self, state: RequestState) -> None:
        """Join a request computed elsewhere to the running batch. Its blocks in this pool must
        already cover its tokens, the first `num_computed_tokens` of them holding their K/V."""
        assert self.has_free_slot, "admit_running needs a free slot"
        assert len(state.block_ids) >= self.bm.blocks_for(state.num_tokens), "blocks first"
        state.status = RequestStatus.RUNNING
        self.running.append(state)

    def retire(self) -> list[RequestState]:
        """Drop finished requests from the running set and free their blocks.

        Continuous: every finished request leaves now. Static: only once the whole batch is done.
        """
        if self.static and not all(s.finished for s in self.running):
            return []
        done = [s for s in self.running if s.finished]
        for s in done:
            self.bm.free(s)
        self.running = [s for s in self.running if not s.finished]
        return done

    # -- one step ------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = self._schedule()
        if self.bm.states is not None:
            for r in out.rows:
                if not r.wasted:
                    r.snapshots = self.bm.plan_snapshots(r.state, r.num_new_tokens)
        return out

    def _schedule(self) -> SchedulerOutput:
        # Finished requests were retired at the end of the step that finished them (`retire`).
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        if not self.static:
            self._unseat_paused(out)
            self._rebalance(out)
        shares = self.policy.shares(self, budget)
        preempted_for_memory = False
        for state in list(self.running) if shares.run_running else []:
            if budget <= 0:
                break
            if state not in self.running:  # preempted earlier in this step
                continue
            if state.finished:  # static batching: the slot is held and computed anyway
                out.rows.append(ScheduledRequest(state, 0, wasted=True))
                budget -= 1
                continue
            if state.paused:
                continue
            n = shares.for_running(state, min(state.num_tokens - state.num_computed_tokens, budget))
            if n <= 0:
                continue
            while not self.bm.allocate(state, state.num_computed_tokens + n):
                victim = self._pick_victim()
                self._preempt(victim, out)
                preempted_for_memory = True
                if victim is state:
                    break
            else:
                out.rows.append(ScheduledRequest(state, n))
                budget -= n
                shares.used(state, n)

        # vLLM's rule: no admissions in a step that had to preempt; memory is short already.
        if preempted_for_memory or not self._admission_open():
            return out
        # A static batch forms all at once: members join now and prefill over the next steps if
        # the budget runs out; continuous batching admits only what it can start now.
        while len(self.running) < self.max_batch_size and (budget > 0 or self.static):
            state = self.policy.next_waiting(self, shares.spent)
            if state is None:
                break
            prefix = self.bm.lookup_prefix(state) if state.num_computed_tokens == 0 else []
            cached = len(prefix) * self.bm.block_size
            n = shares.for_admission(state, min(state.num_tokens - cached, budget))
            if n is None:
                shares.spent.add(state.request.client_id)
                continue
            if not self.bm.allocate(state, cached + n, prefix_blocks=prefix):
                break  # nobody jumps the head of the queue (the policy's head)
            if state.status == RequestStatus.WAITING:
                self.bm.count_lookup(state.num_prompt_tokens, cached)
                state.num_cached_tokens = cached
                state.first_scheduled_time = time.monotonic()
            state.num_computed_tokens = cached
            state.status = RequestStatus.RUNNING
            self.waiting.remove(state)
            self.running.append(state)
            if n:
                out.rows.append(ScheduledRequest(state, n))
            budget -= n
            shares.used(state, n)
        return out

    def _unseat_paused(self, out: SchedulerOutput) -> None:
        """With every slot taken and someone able to run waiting, a paused request (its reader
        is behind) gives up its slot and blocks; it recomputes once resumed."""
        while (
            len(self.running) >= self.max_batch_size and self.policy.next_waiting(self) is not None
        ):
            victim = next((s for s in reversed(self.running) if s.paused), None)
            if victim is None:
                return
            self._preempt(victim, out)

    def _rebalance(self, out: SchedulerOutput) -> None:
        """With every slot taken, let the policy give the head of the queue a running request's
        slot. The preempted request recomputes later, keeping its tokens."""
        while len(self.running) >= self.max_batch_size:
            victim = self.policy.displace(self)
            if victim is None:
                return
            self._preempt(victim, out)

    def commit(self, out: SchedulerOutput) -> None:
        """Record that the step computed its rows: each catches up by its new tokens, and blocks
        now full of computed tokens are named for the prefix cache."""
        for r in out.rows:
            if not r.wasted:
                r.state.num_computed_tokens += r.num_new_tokens
                self.bm.cache_full_blocks(r.state)

    def _admission_open(self) -> bool:
        if self.static:
            return not self.running
        return True

    def _pick_victim(self) -> RequestState:
        # In static batching a finished member's slot is the cheapest to give up, then a paused
        # request (its reader is behind anyway); then the policy's choice.
        for s in reversed(self.running):
            if s.finished:
                return s
        for s in reversed(self.running):
            if s.paused:
                return s
        return self.policy.victim(self.running)

    def _preempt(self, victim: RequestState, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        self.bm.free(victim)
        out.rows = [r for r in out.rows if r.state is not victim]
        if victim.finished:
            return
        # Recompute later: generated tokens stay in token_ids and are never emitted again.
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        out.preempted.append(victim)
