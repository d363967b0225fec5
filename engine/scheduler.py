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

Policies (`policy`), which change only who goes first, never a token (a greedy output is the same
under every policy):

- `fcfs`: the queue's order; preempted requests go back to its front. The default, and the only
  behaviour the static and continuous engines had before policies existed.
- `priority`: the lowest `Request.priority` first (vLLM's semantics), then the oldest; a request
  waiting `aging_seconds` counts as one priority level better, so nothing starves. With every slot
  taken, a waiting request that outranks a running one preempts it.
- `fair`: clients (`Request.client_id`) share the batch slots and the step's token budget. The next
  admission goes to the client holding the fewest slots (every choice of an n>1 request holds one);
  with every slot taken, a client with fewer slots than another by two or more takes one from it
  (the other's newest request is preempted and recomputed later). Each step's token budget is
  split evenly between the clients with running requests, what one leaves unused going to others.
  Within a client, requests go by priority, then age. A client holding no slot gets the next
  step to itself (its prefill alone, a short step; never two such steps in a row), so a short
  request's first token does not wait for a full batch's step.

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
from collections import Counter, deque
from collections.abc import Collection
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.request import RequestState, RequestStatus

POLICIES = ("fcfs", "priority", "fair")
DEFAULT_AGING_SECONDS = 10.0


@dataclass(slots=True)
class ScheduledRequest:
    state: RequestState
    num_new_tokens: int  # tokens fed this step (0 for a wasted row)
    wasted: bool = False  # static batching: a finished member computed for nothing

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
        policy: str = "fcfs",
        aging_seconds: float = DEFAULT_AGING_SECONDS,
        clock=time.monotonic,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        if not aging_seconds > 0:
            raise ValueError(f"aging_seconds must be > 0, got {aging_seconds!r}")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_num_batched_tokens < max_batch_size:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_batch_size "
                f"({max_batch_size}) so every running request can decode each step"
            )
        self.bm = block_manager
        self.max_batch_size = max_batch_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.static = static
        self.policy = policy
        self.aging_seconds = aging_seconds
        self.clock = clock
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        self.num_preemptions = 0
        self._last_newcomer_step = False

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

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or any(not s.finished for s in self.running)

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
        # Finished requests were retired at the end of the step that finished them (`retire`).
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        if not self.static:
            self._unseat_paused(out)
            if self.policy != "fcfs":
                self._rebalance(out)
        preempted_for_memory = False

        # Fair: a client that holds no slot gets the next step to itself, so its first token
        # comes after one small step rather than one full-batch step; never two such steps in a
        # row, so a stream of new clients cannot stall the running ones.
        newcomer_step = False
        if self.policy == "fair" and not self.static:
            newcomer_step = not self._last_newcomer_step and self._has_newcomer()
            self._last_newcomer_step = newcomer_step
        # Fair: tokens per client this step (`grant`), and per running request (`allotment`).
        grant: dict[str | None, int] | None = None
        allotment: dict[int, int] | None = None
        if self.policy == "fair":
            grant, allotment = self._allotments(budget)
        used: Counter = Counter()
        for state in [] if newcomer_step else list(self.running):
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
            n = min(state.num_tokens - state.num_computed_tokens, budget)
            if allotment is not None:
                n = min(n, allotment.get(id(state), 0))
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
                used[state.request.client_id] += n

        # vLLM's rule: no admissions in a step that had to preempt; memory is short already.
        if not preempted_for_memory and self._admission_open():
            # A static batch forms all at once: members join now and prefill over the next steps
            # if the budget runs out; continuous batching admits only what it can start now.
            # Fair: clients whose grant this step is used up (or, in a newcomer's step, every
            # client already holding a slot).
            spent: set[str | None] = set(self._running_per_client()) if newcomer_step else set()
            while len(self.running) < self.max_batch_size and (budget > 0 or self.static):
                state = self._next_waiting(spent)
                if state is None:
                    break
                prefix = []
                if state.num_computed_tokens == 0:
                    prefix = self.bm.lookup_prefix(state)
                cached = len(prefix) * self.bm.block_size
                n = min(state.num_tokens - cached, budget)
                client = state.request.client_id
                if grant is not None:
                    n = min(n, grant.get(client, 0) - used[client])
                    if n <= 0:
                        spent.add(client)
                        continue
                if not self.bm.allocate(state, cached + n, prefix_blocks=prefix):
                    break  # nobody jumps the head of the queue (the policy's head)
                if state.status == RequestStatus.WAITING:
                    self.bm.counters.queried_tokens += state.num_prompt_tokens
                    self.bm.counters.hit_tokens += cached
                    state.num_cached_tokens = cached
                    state.first_scheduled_time = time.monotonic()
                state.num_computed_tokens = cached
                state.status = RequestStatus.RUNNING
                self.waiting.remove(state)
                self.running.append(state)
                if n:
                    out.rows.append(ScheduledRequest(state, n))
                budget -= n
                used[client] += n
        return out

    # -- policies --------------------------------------------------------------------------------

    def _rank(self, state: RequestState, now: float) -> tuple[int, float]:
        """Sort key under the priority and fair policies: priority, improved by one level per
        `aging_seconds` waited (no starvation), then arrival."""
        req = state.request
        aged = int((now - req.arrival_time) // self.aging_seconds)
        return (req.priority - max(aged, 0), req.arrival_time)

    def _running_per_client(self) -> Counter:
        return Counter(s.request.client_id for s in self.running if not s.finished)

    def _has_newcomer(self) -> bool:
        """A never-scheduled request can start now from a client that holds no slot, while
        other clients hold some."""
        if len(self.running) >= self.max_batch_size:
            return False
        held = self._running_per_client()
        if not any(s.request.client_id in held and not s.paused for s in self.running):
            return False
        return any(
            not s.paused and s.status == RequestStatus.WAITING and held[s.request.client_id] == 0
            for s in self.waiting
        )

    def _next_waiting(self, skip: Collection[str | None] = ()) -> RequestState | None:
        """The waiting request the policy admits next (paused ones and `skip`'s clients sit
        out)."""
        if self.policy == "fcfs":
            return next((s for s in self.waiting if not s.paused), None)
        now = self.clock()
        candidates = [s for s in self.waiting if not s.paused and s.request.client_id not in skip]
        if not candidates:
            return None
        if self.policy == "priority":
            return min(candidates, key=lambda s: self._rank(s, now))
        held = self._running_per_client()
        return min(candidates, key=lambda s: (held[s.request.client_id], self._rank(s, now)))

    def _unseat_paused(self, out: SchedulerOutput) -> None:
        """With every slot taken and someone able to run waiting, a paused request (its reader
        is behind) gives up its slot and blocks; it recomputes once resumed."""
        while len(self.running) >= self.max_batch_size and self._next_waiting() is not None:
            victim = next((s for s in reversed(self.running) if s.paused), None)
            if victim is None:
                return
            self._preempt(victim, out)

    def _rebalance(self, out: SchedulerOutput) -> None:
        """With every slot taken, let the request the policy admits next take a slot from a
        running request it ranks above (priority), or from a client holding at least two slots
        more than its own (fair). The preempted request recomputes later, keeping its tokens."""
        now = self.clock()
        while len(self.running) >= self.max_batch_size:
            head = self._next_waiting()
            live = [s for s in self.running if not s.finished]
            if head is None or not live:
                return
            if self.policy == "priority":
                victim = max(live, key=lambda s: self._rank(s, now))
                if not self._rank(head, now)[0] < self._rank(victim, now)[0]:
                    return
            else:
                held = self._running_per_client()
                top = max(held, key=lambda c: held[c])
                if held[top] < held[head.request.client_id] + 2:
                    return
                victim = max(
                    (s for s in live if s.request.client_id == top),
                    key=lambda s: self._rank(s, now),
                )
            self._preempt(victim, out)

    def _allotments(self, budget: int) -> tuple[dict[str | None, int], dict[int, int]]:
        """Fair policy: the step's tokens per client, and per running request (by id). Clients get equal shares
        (water-filling: a client needing less than its share leaves the rest to the others);
        within a client its requests are served in order, decodes being one token each."""
        demand: dict[str | None, list[RequestState]] = {}
        for s in self.running:
            if not s.finished and not s.paused:
                demand.setdefault(s.request.client_id, []).append(s)
        need = {
            c: sum(s.num_tokens - s.num_computed_tokens for s in group)
            for c, group in demand.items()
        }
        if len(self.running) < self.max_batch_size:
            # A client that can be admitted this step is owed its share too: what running
            # requests leave of the budget goes to admissions.
            for s in self.waiting:
                if not s.paused:
                    c = s.request.client_id
                    need[c] = need.get(c, 0) + s.num_tokens - s.num_computed_tokens
        grant = dict.fromkeys(need, 0)
        left = budget
        hungry = [c for c in need if need[c] > 0]
        while left > 0 and hungry:
            share = max(left // len(hungry), 1)
            for c in hungry:
                give = min(share, need[c] - grant[c], left)
                grant[c] += give
                left -= give
                if left <= 0:
                    break
            hungry = [c for c in hungry if grant[c] < need[c]]
        allot: dict[int, int] = {}
        for c, group in demand.items():  # waiting clients' grants stay in the budget
            tokens = grant[c]
            for s in group:
                n = min(s.num_tokens - s.num_computed_tokens, tokens)
                allot[id(s)] = n
                tokens -= n
        return grant, allot

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
        if self.policy == "fcfs":
            return self.running[-1]  # newest first
        now = self.clock()
        if self.policy == "fair":
            # The newest request of the client holding the most slots.
            held = self._running_per_client()
            top = max(held, key=lambda c: held[c])
            group = [s for s in self.running if s.request.client_id == top]
            return max(group, key=lambda s: self._rank(s, now))
        return max(self.running, key=lambda s: self._rank(s, now))

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
