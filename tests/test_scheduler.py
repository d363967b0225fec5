"""The scheduler alone, with a fake runner: pure Python bookkeeping, no model forward.

`FakeRunner` does what the engine does around a forward (schedule, commit, sample the rows that
caught up, apply max_tokens, retire) but "samples" a fixed token, so each test states exactly
which requests run, how many tokens each computes, and when they join and leave.
"""

from __future__ import annotations

import pytest

from engine.block_manager import BlockManager
from engine.request import Request, RequestState, RequestStatus, SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput

TOKEN = 7  # what the fake runner samples


def make_state(prompt: int | list[int], max_tokens: int, rid: str) -> RequestState:
    ids = list(range(100, 100 + prompt)) if isinstance(prompt, int) else prompt
    return RequestState(
        Request(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), request_id=rid), ()
    )


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
    ) -> None:
        self.bm = BlockManager(num_blocks, block_size, prefix_caching)
        self.scheduler = Scheduler(self.bm, slots, budget, static=static)
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
        while self.scheduler.has_unfinished():
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
