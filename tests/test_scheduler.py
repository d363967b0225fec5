"""The scheduler alone, with a fake runner: pure Python bookkeeping, no model forward.

`FakeRunner` does what the engine does around a forward (schedule, commit, sample the rows that
caught up, apply max_tokens, retire) but "samples" a fixed token, so each test states exactly
which requests run, how many tokens each computes, and when they join and leave.
"""

from __future__ import annotations

import pytest

from engine.block_manager import BlockManager
from engine.policy import make_policy
from engine.request import Request, RequestState, RequestStatus, SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput

TOKEN = 7  # what the fake runner samples


def make_state(
    prompt: int | list[int],
    max_tokens: int,
    rid: str,
    *,
    client: str | None = None,
    priority: int = 0,
    arrival: float | None = None,
) -> RequestState:
    ids = list(range(100, 100 + prompt)) if isinstance(prompt, int) else prompt
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    request = Request(ids, params, request_id=rid, client_id=client, priority=priority)
    if arrival is not None:
        request.arrival_time = arrival
    return RequestState(request, ())


class FakeRunner:
    def __init__(
        self,
        *,
        slots: int = 4,
        budget: int = 64,
        num_blocks: int = 64,
        block_size: int = 4,
        static: bool = False,
        prefix_caching: bool = False,
        policy: str = "fcfs",
        clock=None,
    ) -> None:
        self.bm = BlockManager(num_blocks, block_size, prefix_caching)
        extra = {} if clock is None else {"clock": clock}
        self.scheduler = Scheduler(
            self.bm, slots, budget, static=static, policy=make_policy(policy, **extra)
        )
        self.steps: list[SchedulerOutput] = []
        self.sampled: list[list[str]] = []  # request ids that got a token, per step

    def add(self, *states: RequestState) -> None:
        for s in states:
            self.scheduler.add(s)

    def step(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        sampling = [r.state for r in out.rows if r.samples]  # decided before the forward
        self.scheduler.commit(out)
        for s in sampling:
            s.token_ids.append(TOKEN)
            if s.num_output_tokens >= s.params.max_tokens:
                s.status = RequestStatus.FINISHED_LENGTH
        self.scheduler.retire()
        self.steps.append(out)
        self.sampled.append([s.request_id for s in sampling])
        return out

    def run(self, max_steps: int = 1000) -> None:
        sched = self.scheduler
        while sched.waiting or any(not s.finished for s in sched.running):
            self.step()
            assert len(self.steps) < max_steps

    def rows(self, out: SchedulerOutput) -> dict[str, int]:
        return {r.state.request_id: r.num_new_tokens for r in out.rows}


# -- admission --------------------------------------------------------------------------------


def test_admission_stops_at_the_batch_slots():
    fr = FakeRunner(slots=2)
    fr.add(*(make_state(5, 3, f"r{i}") for i in range(4)))
    assert fr.rows(fr.step()) == {"r0": 5, "r1": 5}
    assert [s.request_id for s in fr.scheduler.waiting] == ["r2", "r3"]


def test_admission_stops_at_the_token_budget_with_a_partial_chunk():
    fr = FakeRunner(budget=16)
    fr.add(make_state(10, 3, "a"), make_state(10, 3, "b"), make_state(10, 3, "c"))
    # a fits whole, b gets what is left of the budget as a first chunk, c waits.
    assert fr.rows(fr.step()) == {"a": 10, "b": 6}
    assert [s.request_id for s in fr.scheduler.waiting] == ["c"]
    assert fr.sampled[-1] == ["a"]  # b has not caught up: it does not sample yet


def test_admission_stops_at_the_free_blocks_first_come_first_served():
    fr = FakeRunner(num_blocks=4, block_size=4)  # 3 usable blocks
    big, small = make_state(8, 2, "big"), make_state(3, 2, "small")
    fr.add(make_state(8, 2, "first"), big, small)
    # "first" takes 2 blocks; "big" needs 2 of the 1 left, and "small" may not jump ahead.
    assert fr.rows(fr.step()) == {"first": 8}
    assert [s.request_id for s in fr.scheduler.waiting] == ["big", "small"]
    fr.run()
    assert big.num_output_tokens == small.num_output_tokens == 2
    assert fr.bm.num_free_blocks == fr.bm.num_usable_blocks


# -- chunked prefill --------------------------------------------------------------------------


def test_a_long_prompt_is_prefilled_in_budget_sized_chunks_and_samples_once_caught_up():
    fr = FakeRunner(budget=16)
    long = make_state(50, 2, "long")
    fr.add(long)
    fr.run()
    assert [fr.rows(out)["long"] for out in fr.steps] == [16, 16, 16, 2, 1]
    assert fr.sampled == [[], [], [], ["long"], ["long"]]


def test_no_step_exceeds_the_token_budget_under_mixed_load():
    fr = FakeRunner(slots=6, budget=24, num_blocks=200)
    fr.add(*(make_state(5 + 9 * i, 4 + i, f"r{i}") for i in range(10)))
    fr.run()
    assert max(out.num_tokens for out in fr.steps) <= 24
    assert all(out.num_tokens > 0 for out in fr.steps)


# -- preemption -------------------------------------------------------------------------------


def test_memory_pressure_preempts_the_newest_running_request():
    # 4 usable blocks of 4 tokens; three 4-token prompts fill three, and each needs a second
    # block for its first generated token.
    fr = FakeRunner(num_blocks=5, block_size=4)
    old, mid, new = make_state(4, 6, "old"), make_state(4, 6, "mid"), make_state(4, 6, "new")
    fr.add(old, mid, new)
    fr.step()  # all three prefill and sample one token
    out = fr.step()  # old takes the last block; mid needs one: the newest (new) gives it up
    assert [s.request_id for s in out.preempted] == ["new"]
    assert fr.rows(out) == {"old": 1, "mid": 1}
    assert new.status is RequestStatus.PREEMPTED and new.num_preemptions == 1
    assert fr.scheduler.waiting[0] is new and not new.block_ids


def test_a_preempted_request_recomputes_and_keeps_its_generated_tokens():
    fr = FakeRunner(num_blocks=5, block_size=4)
    states = [make_state(4, 6, f"r{i}") for i in range(3)]
    fr.add(*states)
    fr.step()
    fr.step()
    victim = next(s for s in states if s.status is RequestStatus.PREEMPTED)
    kept = list(victim.token_ids)
    assert victim.num_output_tokens == 1 and victim.num_computed_tokens == 0
    fr.run()
    # When it came back it recomputed prompt + generated token in one row (no new sample
    # until it had caught up), then went on decoding.
    readmitted = [
        i for i, out in enumerate(fr.steps) if i >= 2 and victim.request_id in fr.rows(out)
    ]
    assert fr.rows(fr.steps[readmitted[0]])[victim.request_id] == len(kept)
    assert victim.token_ids[: len(kept)] == kept
    assert all(s.num_output_tokens == 6 for s in states)  # nothing lost or sampled twice


# -- static vs continuous -----------------------------------------------------------------------


@pytest.mark.parametrize("static", [False, True], ids=["continuous", "static"])
def test_when_a_finished_request_leaves_and_a_waiting_one_joins(static):
    fr = FakeRunner(slots=2, static=static)
    short, long, late = (
        make_state(3, 1, "short"),
        make_state(3, 4, "long"),
        make_state(3, 2, "late"),
    )
    fr.add(short, long, late)
    fr.step()  # short and long prefill; short finishes with its one token
    out = fr.step()
    if static:
        # The finished member keeps its slot as a wasted row; nobody joins until all are done.
        assert [(r.state.request_id, r.wasted) for r in out.rows] == [
            ("short", True),
            ("long", False),
        ]
        fr.run()
        first_late = min(i for i, o in enumerate(fr.steps) if "late" in fr.rows(o))
        last_long = max(i for i, o in enumerate(fr.steps) if "long" in fr.rows(o))
        assert first_late > last_long
    else:
        # Retired at once; the freed slot goes to the waiting request in the very next step.
        assert fr.rows(out) == {"long": 1, "late": 3}
        assert short not in fr.scheduler.running and not short.block_ids
        fr.run()
    assert fr.bm.num_free_blocks == fr.bm.num_usable_blocks


# -- prefix cache -----------------------------------------------------------------------------


def test_a_shared_prefix_is_served_from_cache_in_whole_blocks():
    fr = FakeRunner(block_size=4, prefix_caching=True)
    prompt = list(range(12))
    fr.add(make_state(prompt, 2, "first"))
    fr.run()
    second = make_state(prompt[:8] + [90, 91, 92], 2, "second")
    fr.add(second)
    assert fr.rows(fr.step()) == {"second": 3}  # 8 tokens (two blocks) came from the cache
    assert second.num_cached_tokens == 8
    assert (fr.bm.counters.queried_tokens, fr.bm.counters.hit_tokens) == (12 + 11, 8)


def test_an_identical_prompt_still_computes_its_last_token():
    fr = FakeRunner(block_size=4, prefix_caching=True)
    prompt = list(range(12))
    fr.add(make_state(prompt, 1, "first"))
    fr.run()
    again = make_state(prompt, 1, "again")
    fr.add(again)
    # Three full blocks are cached, but the last token must run to produce logits: the third
    # block is recomputed (the lookup stops at (12 - 1) // 4 = 2 blocks).
    assert fr.rows(fr.step()) == {"again": 4}
    assert again.num_cached_tokens == 8 and again.num_output_tokens == 1


# -- policies: priority, fair, aging -----------------------------------------------------------------


def test_priority_admits_the_lowest_value_first_then_the_oldest():
    fr = FakeRunner(slots=2, policy="priority")
    fr.add(
        make_state(3, 2, "late-low", priority=5, arrival=1.0),
        make_state(3, 2, "urgent", priority=-1, arrival=3.0),
        make_state(3, 2, "normal-old", arrival=2.0),
        make_state(3, 2, "normal-new", arrival=4.0),
    )
    assert set(fr.rows(fr.step())) == {"urgent", "normal-old"}


def test_priority_preempts_a_running_request_it_outranks():
    fr = FakeRunner(slots=2, policy="priority")
    fr.add(make_state(3, 8, "a", priority=1), make_state(3, 8, "b", priority=2))
    fr.step()
    vip = make_state(3, 2, "vip", priority=0)
    fr.add(vip)
    out = fr.step()
    assert [s.request_id for s in out.preempted] == ["b"]  # the worst-ranked running one
    assert set(fr.rows(out)) == {"a", "vip"}
    fr.run()
    assert all(s.num_output_tokens == s.params.max_tokens for s in (vip,))


def test_priority_ages_so_a_low_priority_request_is_not_starved():
    now = [100.0]
    fr = FakeRunner(slots=1, policy="priority", clock=lambda: now[0])
    old_low = make_state(3, 1, "old-low", priority=3, arrival=0.0)  # waited 100 s: 10 levels
    fresh_high = make_state(3, 1, "fresh-high", priority=0, arrival=100.0)
    fr.add(fresh_high, old_low)
    assert fr.rows(fr.step()) == {"old-low": 3}


def test_fair_gives_a_new_client_a_slot_taken_from_a_hog():
    fr = FakeRunner(slots=4, budget=64, num_blocks=200, policy="fair")
    hog = [make_state(4, 50, f"hog{i}", client="A") for i in range(8)]
    fr.add(*hog)
    fr.step()
    assert len(fr.scheduler.running) == 4  # the hog alone: it may use every slot
    short = make_state(4, 2, "short", client="B")
    fr.add(short)
    out = fr.step()
    assert [s.request_id for s in out.preempted] == ["hog3"]  # the hog's newest gives one up
    # The new client's step is its own: its prefill alone, so its first token comes fast.
    assert fr.rows(out) == {"short": 4} and fr.sampled[-1] == ["short"]
    assert set(fr.rows(fr.step())) == {"hog0", "hog1", "hog2", "short"}  # then all together
    assert short.finished
    # Two clients now: the slots split 2/2 at most one apart, never leaving B's second
    # request behind all of A's.
    more = [make_state(4, 20, f"b{i}", client="B") for i in range(3)]
    fr.add(*more)
    fr.step()
    fr.step()
    held = {c: sum(s.request.client_id == c for s in fr.scheduler.running) for c in "AB"}
    assert held == {"A": 2, "B": 2}
    fr.run()
    assert all(s.num_output_tokens == s.params.max_tokens for s in hog + more)
    assert fr.bm.num_free_blocks == fr.bm.num_usable_blocks


def test_fair_splits_the_token_budget_between_clients():
    fr = FakeRunner(slots=8, budget=32, num_blocks=200, policy="fair")
    # Client A's long prompts would take the whole budget under fcfs.
    fr.add(*(make_state(40, 2, f"a{i}", client="A", arrival=float(i)) for i in range(3)))
    fr.add(make_state(40, 2, "b0", client="B", arrival=10.0))
    rows = fr.rows(fr.step())
    per_client = {c: sum(n for r, n in rows.items() if r.startswith(c)) for c in "ab"}
    assert per_client == {"a": 16, "b": 16}
    fcfs = FakeRunner(slots=8, budget=32, num_blocks=200)
    fcfs.add(*(make_state(40, 2, f"a{i}", client="A") for i in range(3)))
    fcfs.add(make_state(40, 2, "b0", client="B"))
    assert fcfs.rows(fcfs.step()) == {"a0": 32}


def test_fair_interleaves_clients_and_does_not_thrash():
    fr = FakeRunner(slots=3, budget=64, num_blocks=200, policy="fair")
    fr.add(*(make_state(4, 10, f"a{i}", client="A") for i in range(3)))
    fr.add(*(make_state(4, 10, f"b{i}", client="B") for i in range(3)))
    assert set(fr.rows(fr.step())) == {"a0", "b0", "a1"}  # not a0, a1, a2
    fr.run()
    # 2 slots to 1 is as even as three slots get: nobody is preempted for it.
    assert fr.scheduler.num_preemptions == 0


@pytest.mark.parametrize("policy", ["fcfs", "priority", "fair"])
def test_every_policy_finishes_everything_and_frees_every_block(policy):
    fr = FakeRunner(slots=3, budget=16, num_blocks=20, block_size=4, policy=policy)
    states = [
        make_state(3 + 5 * i, 3 + i, f"r{i}", client="AB"[i % 2], priority=i % 3) for i in range(8)
    ]
    fr.add(*states)
    fr.run()
    assert all(s.num_output_tokens == s.params.max_tokens for s in states)
    assert max(out.num_tokens for out in fr.steps) <= 16
    assert fr.bm.num_free_blocks == fr.bm.num_usable_blocks


# -- the policy objects on their own (engine.policy) ---------------------------------------------


def test_fcfs_policy_takes_the_queue_order_skips_paused_and_preempts_the_newest():
    fr = FakeRunner(slots=2)
    policy = fr.scheduler.policy
    a, b, c = make_state(3, 2, "a"), make_state(3, 2, "b"), make_state(3, 2, "c")
    fr.add(a, b, c)
    a.paused = True
    assert policy.next_waiting(fr.scheduler) is b
    assert policy.victim([a, b, c]) is c
    fr.step()  # b and c run; the full batch
    assert policy.displace(fr.scheduler) is None  # fcfs never takes a slot from a runner
    assert policy.shares(fr.scheduler, 64).for_admission(a, 10) == 10


def test_priority_policy_ranks_by_priority_then_age_and_displaces_only_a_worse_runner():
    now = [50.0]
    fr = FakeRunner(slots=1, policy="priority", clock=lambda: now[0])
    policy = fr.scheduler.policy
    low = make_state(3, 4, "low", priority=3, arrival=45.0)
    high = make_state(3, 4, "high", priority=1, arrival=49.0)
    fr.add(low, high)
    assert policy.next_waiting(fr.scheduler) is high
    assert policy.victim([high, low]) is low
    fr.step()  # high runs
    assert policy.displace(fr.scheduler) is None  # low does not outrank it
    now[0] = 75.0  # low has waited 30 s: three levels better, priority 0 < high's 1 - 2
    assert policy.rank(low, now[0])[0] == 0 and policy.rank(high, now[0])[0] == -1
    vip = make_state(3, 1, "vip", priority=-5, arrival=75.0)
    fr.add(vip)
    assert policy.next_waiting(fr.scheduler) is vip
    assert policy.displace(fr.scheduler) is high


def test_fair_policy_shares_the_step_evenly_and_takes_a_slot_from_the_biggest_holder():
    fr = FakeRunner(slots=4, budget=20, num_blocks=200, policy="fair")
    policy = fr.scheduler.policy
    hog = [make_state(4, 50, f"a{i}", client="A") for i in range(3)]
    fr.add(*hog)
    fr.step()
    newcomer = make_state(30, 2, "b0", client="B")
    fr.add(newcomer)
    assert policy.next_waiting(fr.scheduler) is newcomer
    # (asked when every slot is taken) A holds 3 slots, B none: 3 >= 0 + 2, A's newest gives
    assert policy.displace(fr.scheduler) is hog[-1]
    shares = policy.shares(fr.scheduler, 20)
    # B holds no slot: this step is its own, A's requests and admissions sit it out.
    assert not shares.run_running and shares.spent == {"A"}
    # A's three decodes are owed 3 tokens; B the rest of the budget for its prefill.
    assert [shares.for_running(s, 1) for s in hog] == [1, 1, 1]
    assert shares.for_admission(newcomer, 30) == 17
    shares.used(newcomer, 17)
    assert shares.for_admission(newcomer, 30) is None  # B's grant is spent
    # Never two newcomer steps in a row.
    assert policy.shares(fr.scheduler, 20).run_running
