"""Scheduling policies: who goes first. They change only the order, never a token (a greedy
output is the same under every policy).

A policy answers three questions for the scheduler (`engine.scheduler`), which owns the one
catch-up rule and asks:

- `next_waiting`: which waiting request is admitted next;
- `victim` / `displace`: which running request gives up its slot when memory runs out, and
  whether, with every slot taken, the head of the queue may take one from a running request;
- `shares`: how this step's token budget is shared between running requests and admissions.

The three:

- `fcfs`: the queue's order; preempted requests go back to its front; the newest running request
  is preempted first. The default, and the behaviour the engines had before policies existed.
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

`SchedulingPolicy` is the one list of their names (`EngineConfig.scheduling`, both CLIs);
`make_policy` builds one. A new policy is a `Policy` subclass and one enum member.
"""

from __future__ import annotations

import enum
import time
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from typing import Protocol

from engine.request import RequestState, RequestStatus


class Scheduler(Protocol):
    """What a policy reads of the scheduler that asks it (`engine.scheduler.Scheduler`)."""

    waiting: Collection[RequestState]
    running: list[RequestState]
    static: bool
    max_batch_size: int


DEFAULT_AGING_SECONDS = 10.0


class SchedulingPolicy(enum.StrEnum):
    """The policies' names, as `EngineConfig.scheduling` and `--scheduling` spell them."""

    FCFS = "fcfs"
    PRIORITY = "priority"
    FAIR = "fair"


class Shares:
    """How one step's tokens are shared. This one: first come, first served within the budget."""

    # Whether running requests are scheduled this step (False: a newcomer's step of its own).
    run_running = True

    def __init__(self) -> None:
        # Clients that sit out admission this step.
        self.spent: set[str | None] = set()

    def for_running(self, state: RequestState, n: int) -> int:
        """Tokens a running request may compute this step, of the `n` it could."""
        return n

    def for_admission(self, state: RequestState, n: int) -> int | None:
        """Tokens an admitted request may compute this step, of the `n` it could; None: its
        client's share is used up, so the client sits out the rest of this step's admissions."""
        return n

    def used(self, state: RequestState, n: int) -> None:
        """`state` was scheduled for `n` tokens."""


class Policy:
    """First come, first served (`fcfs`); the base of the others."""

    name = SchedulingPolicy.FCFS

    def next_waiting(
        self, sched: Scheduler, skip: Collection[str | None] = ()
    ) -> RequestState | None:
        """The waiting request admitted next (paused ones and `skip`'s clients sit out)."""
        return next(
            (s for s in sched.waiting if not s.paused and s.request.client_id not in skip), None
        )

    def victim(self, running: Sequence[RequestState]) -> RequestState:
        """The running request preempted when memory runs out: the newest."""
        return running[-1]

    def displace(self, sched: Scheduler) -> RequestState | None:
        """With every slot taken, a running request that gives its slot to the head of the
        queue; None: nobody."""
        return None

    def shares(self, sched: Scheduler, budget: int) -> Shares:
        return Shares()


class PriorityPolicy(Policy):
    """The lowest priority value first, improved by one level per `aging_seconds` waited."""

    name = SchedulingPolicy.PRIORITY

    def __init__(
        self,
        aging_seconds: float = DEFAULT_AGING_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not aging_seconds > 0:
            raise ValueError(f"aging_seconds must be > 0, got {aging_seconds!r}")
        self.aging_seconds = aging_seconds
        self.clock = clock

    def rank(self, state: RequestState, now: float) -> tuple[int, float]:
        """Sort key: priority, improved by one level per `aging_seconds` waited (no
        starvation), then arrival."""
        req = state.request
        aged = int((now - req.arrival_time) // self.aging_seconds)
        return (req.priority - max(aged, 0), req.arrival_time)

    def next_waiting(
        self, sched: Scheduler, skip: Collection[str | None] = ()
    ) -> RequestState | None:
        candidates = [s for s in sched.waiting if not s.paused and s.request.client_id not in skip]
        if not candidates:
            return None
        return min(candidates, key=self._admission_key(sched, self.clock()))

    def _admission_key(self, sched: Scheduler, now: float) -> Callable[[RequestState], tuple]:
        """Sort key of the waiting requests, the lowest admitted first."""
        return lambda s: self.rank(s, now)

    def victim(self, running: Sequence[RequestState]) -> RequestState:
        now = self.clock()
        return max(running, key=lambda s: self.rank(s, now))

    def displace(self, sched: Scheduler) -> RequestState | None:
        head = self.next_waiting(sched)
        live = [s for s in sched.running if not s.finished]
        if head is None or not live:
            return None
        return self._displaced(sched, head, live, self.clock())

    def _displaced(
        self, sched: Scheduler, head: RequestState, live: list[RequestState], now: float
    ) -> RequestState | None:
        """The running request `head` takes a slot from: the worst-ranked, if `head` outranks
        it."""
        victim = max(live, key=lambda s: self.rank(s, now))
        return victim if self.rank(head, now)[0] < self.rank(victim, now)[0] else None


def running_per_client(sched: Scheduler) -> Counter:
    return Counter(s.request.client_id for s in sched.running if not s.finished)


class FairShares(Shares):
    """The fair policy's step: a token grant per client and an allotment per running request
    (by id); in a newcomer's step, running requests sit out and so do the clients holding a
    slot."""

    def __init__(
        self,
        grant: dict[str | None, int],
        allotment: dict[int, int],
        newcomer_step: bool,
        holders: Collection[str | None],
    ) -> None:
        super().__init__()
        self.grant, self.allotment = grant, allotment
        self.run_running = not newcomer_step
        if newcomer_step:
            self.spent = set(holders)
        self.used_by: Counter = Counter()

    def for_running(self, state: RequestState, n: int) -> int:
        return min(n, self.allotment.get(id(state), 0))

    def for_admission(self, state: RequestState, n: int) -> int | None:
        client = state.request.client_id
        n = min(n, self.grant.get(client, 0) - self.used_by[client])
        return n if n > 0 else None

    def used(self, state: RequestState, n: int) -> None:
        self.used_by[state.request.client_id] += n


class FairPolicy(PriorityPolicy):
    """Clients share the slots and each step's tokens; within a client, priority then age."""

    name = SchedulingPolicy.FAIR

    def __init__(
        self,
        aging_seconds: float = DEFAULT_AGING_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(aging_seconds, clock)
        self._last_newcomer_step = False

    def _admission_key(self, sched: Scheduler, now: float) -> Callable[[RequestState], tuple]:
        # The client holding the fewest slots first.
        held = running_per_client(sched)
        return lambda s: (held[s.request.client_id], self.rank(s, now))

    def victim(self, running: Sequence[RequestState]) -> RequestState:
        # The newest request of the client holding the most slots.
        now = self.clock()
        held = Counter(s.request.client_id for s in running if not s.finished)
        top = max(held, key=lambda c: held[c])
        group = [s for s in running if s.request.client_id == top]
        return max(group, key=lambda s: self.rank(s, now))

    def _displaced(
        self, sched: Scheduler, head: RequestState, live: list[RequestState], now: float
    ) -> RequestState | None:
        """The newest request of the client holding the most slots, if that is at least two
        more than `head`'s client holds."""
        held = running_per_client(sched)
        top = max(held, key=lambda c: held[c])
        if held[top] < held[head.request.client_id] + 2:
            return None
        return max((s for s in live if s.request.client_id == top), key=lambda s: self.rank(s, now))

    def shares(self, sched: Scheduler, budget: int) -> FairShares:
        # A client that holds no slot gets the next step to itself, so its first token comes
        # after one small step rather than one full-batch step; never two such steps in a row,
        # so a stream of new clients cannot stall the running ones.
        newcomer_step = False
        if not sched.static:
            newcomer_step = not self._last_newcomer_step and self._has_newcomer(sched)
            self._last_newcomer_step = newcomer_step
        grant, allotment = self._allotments(sched, budget)
        return FairShares(grant, allotment, newcomer_step, running_per_client(sched))

    def _has_newcomer(self, sched: Scheduler) -> bool:
        """A never-scheduled request can start now from a client that holds no slot, while
        other clients hold some."""
        if len(sched.running) >= sched.max_batch_size:
            return False
        held = running_per_client(sched)
        if not any(s.request.client_id in held and not s.paused for s in sched.running):
            return False
        return any(
            not s.paused and s.status == RequestStatus.WAITING and held[s.request.client_id] == 0
            for s in sched.waiting
        )

    def _allotments(
        self, sched: Scheduler, budget: int
    ) -> tuple[dict[str | None, int], dict[int, int]]:
        """The step's tokens per client, and per running request (by id). Clients get equal
        shares (water-filling: a client needing less than its share leaves the rest to the
        others); within a client its requests are served in order, decodes being one token
        each."""
        demand: dict[str | None, list[RequestState]] = {}
        for s in sched.running:
            if not s.finished and not s.paused:
                demand.setdefault(s.request.client_id, []).append(s)
        need = {
            c: sum(s.num_tokens - s.num_computed_tokens for s in group)
            for c, group in demand.items()
        }
        if len(sched.running) < sched.max_batch_size:
            # A client that can be admitted this step is owed its share too: what running
            # requests leave of the budget goes to admissions.
            for s in sched.waiting:
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


def make_policy(
    name: SchedulingPolicy | str,
    aging_seconds: float = DEFAULT_AGING_SECONDS,
    clock: Callable[[], float] = time.monotonic,
) -> Policy:
    """The policy called `name` (ValueError naming the choices for an unknown one)."""
    try:
        policy = SchedulingPolicy(name)
    except ValueError:
        choices = ", ".join(p.value for p in SchedulingPolicy)
        raise ValueError(f"policy must be one of {choices}, got {name!r}") from None
    if policy is SchedulingPolicy.FCFS:
        return Policy()
    cls = PriorityPolicy if policy is SchedulingPolicy.PRIORITY else FairPolicy
    return cls(aging_seconds, clock)
