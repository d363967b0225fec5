"""KV memory: preemption by recompute, aborts, admission limits, and that every block comes back."""

from __future__ import annotations

import pytest

from engine import (
    ContinuousBatchEngine,
    DuplicateRequestError,
    Request,
    RequestTooLongError,
    SamplingParams,
    StaticBatchEngine,
)
from engine.block_manager import BlockManager
from engine.request import RequestState
from models import load_model
from tests.helpers.engine_runs import mixed_specs, seeded, serve, serve_individually

ENGINES = [StaticBatchEngine, ContinuousBatchEngine]


@pytest.fixture(scope="module")
def model():
    return load_model("tinygpt").model


def _all_blocks_free(engine) -> bool:
    bm = engine.block_manager
    return bm.num_free_blocks == bm.num_usable_blocks and all(c == 0 for c in bm.ref_counts)


@pytest.mark.parametrize("engine_cls", ENGINES, ids=lambda c: c.name)
def test_small_pool_preempts_and_keeps_outputs_identical(model, engine_cls):
    specs = [(p, n) for p, n in mixed_specs(12, seed=3, max_prompt=60, max_out=30)]
    params = lambda n, i: SamplingParams(max_tokens=n, ignore_eos=True)  # noqa: E731
    expected = serve_individually(model, specs, params)
    # 9 usable blocks of 16 tokens: far less than 8 running requests of up to 90 tokens need.
    engine = engine_cls(model, num_blocks=10)
    got = serve(engine, specs, params)
    assert got == expected
    assert engine.stats().num_preemptions > 0
    assert _all_blocks_free(engine)


def test_preempted_request_never_resends_tokens(model):
    specs = mixed_specs(10, seed=4, max_prompt=40, max_out=30)
    engine = ContinuousBatchEngine(model, num_blocks=8)
    got = serve(engine, specs, lambda n, i: SamplingParams(max_tokens=n, ignore_eos=True))
    assert engine.stats().num_preemptions > 0
    assert [len(t) for t in got] == [n for _, n in specs]


def test_seeded_sampling_survives_preemption(model):
    specs = mixed_specs(10, seed=6, max_prompt=40, max_out=30)
    expected = serve_individually(model, specs, seeded)
    engine = ContinuousBatchEngine(model, num_blocks=8)
    assert serve(engine, specs, seeded) == expected
    assert engine.stats().num_preemptions > 0


def _start(engine, n: int, max_tokens: int = 50) -> list[Request]:
    reqs = [
        Request([5, 6, 7] * 10, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        for _ in range(n)
    ]
    for r in reqs:
        engine.add_request(r)
    return reqs


@pytest.mark.parametrize("engine_cls", ENGINES, ids=lambda c: c.name)
def test_abort_running_and_waiting_frees_blocks_and_ends_once(model, engine_cls):
    engine = engine_cls(model, max_batch_size=2)
    running, running2, waiting = _start(engine, 3)
    engine.step()
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_usable_blocks
    assert engine.abort(running.request_id) is True
    assert engine.abort(waiting.request_id) is True
    terminal = [o for o in engine.step() if o.finished]
    assert sorted(o.request_id for o in terminal) == sorted(
        [running.request_id, waiting.request_id]
    )
    assert all(o.finish_reason == "abort" and o.token_ids == [] for o in terminal)
    # Idempotent: a second abort is a no-op and produces no second terminal output.
    assert engine.abort(running.request_id) is False
    seen = []
    while engine.has_work():
        seen += [o.request_id for o in engine.step()]
    assert running.request_id not in seen and waiting.request_id not in seen
    assert running2.request_id in seen
    assert _all_blocks_free(engine)


def test_abort_unknown_request_returns_false(model):
    assert ContinuousBatchEngine(model).abort("no-such-request") is False


@pytest.mark.parametrize("engine_cls", ENGINES, ids=lambda c: c.name)
def test_a_new_engine_has_warmed_the_model_up_in_the_reserved_block_only(model, engine_cls):
    """The warm-up forward (a chunk and a decode row, before any request) writes K/V into block
    0, which wasted rows write and no request reads, and nowhere else; every block stays free."""
    engine = engine_cls(model, block_size=16)
    kv = engine.runner.kv  # (layers, 2, blocks, block_size, kv_heads, head_dim)
    assert kv[:, :, 0, :9].abs().amax(dim=(0, 1, 3, 4)).gt(0).all()  # chunk 0..7, decode row 8
    assert not kv[:, :, 1:].any()
    assert _all_blocks_free(engine)


def test_finished_requests_return_every_block(model):
    engine = ContinuousBatchEngine(model)
    serve(engine, mixed_specs(12, seed=9))
    assert _all_blocks_free(engine)


def test_prompt_plus_max_tokens_beyond_context_is_refused_with_numbers(model):
    engine = ContinuousBatchEngine(model)
    with pytest.raises(RequestTooLongError, match=r"2048.*2000.*100"):
        engine.add_request(Request([1] * 2000, SamplingParams(max_tokens=100)))


def test_request_that_can_never_fit_the_pool_is_refused(model):
    engine = ContinuousBatchEngine(model, num_blocks=4)  # 3 usable blocks = 48 tokens
    with pytest.raises(RequestTooLongError, match="KV blocks"):
        engine.add_request(Request([1] * 40, SamplingParams(max_tokens=20)))
    engine.add_request(Request([1] * 30, SamplingParams(max_tokens=18)))  # 48 tokens fit


def test_duplicate_live_request_id_is_refused(model):
    engine = ContinuousBatchEngine(model)
    engine.add_request(Request([1, 2], request_id="same"))
    with pytest.raises(DuplicateRequestError):
        engine.add_request(Request([3, 4], request_id="same"))


def test_out_of_vocabulary_prompt_token_is_refused(model):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ContinuousBatchEngine(model).add_request(Request([1, 999]))


def test_block_manager_allocation_is_all_or_nothing():
    bm = BlockManager(num_blocks=5, block_size=4)  # 4 usable
    a = RequestState(Request([1] * 10), ())
    b = RequestState(Request([1] * 10), ())
    assert bm.allocate(a, 12)  # 3 blocks
    assert not bm.allocate(b, 8)  # needs 2, only 1 free
    assert b.block_ids == [] and bm.num_free_blocks == 1
    assert 0 not in a.block_ids  # block 0 is reserved
    bm.free(a)
    assert bm.num_free_blocks == 4 and a.block_ids == []


def test_a_pool_sized_without_a_budget_is_capped_in_bytes_and_in_tokens(model):
    """Without a budget the pool holds every slot's full context up to 0.75 GiB and 40,960 tokens
    (a busy server ends up touching all of it: the cap is what its RSS grows by)."""
    from engine.batch import DEFAULT_KV_CACHE_GIB, DEFAULT_KV_CACHE_TOKENS

    small = ContinuousBatchEngine(model, max_batch_size=2)  # two full contexts: under both caps
    per_token, context = small.model_config.kv_bytes_per_token, small.max_model_len
    assert small.block_manager.num_blocks == 2 * -(-context // 16) + 1
    many = ContinuousBatchEngine(model, max_batch_size=4096)  # far over both caps
    cap_tokens = min(DEFAULT_KV_CACHE_TOKENS, int(DEFAULT_KV_CACHE_GIB * 2**30 // per_token))
    assert 4096 * context > cap_tokens
    assert many.block_manager.num_blocks * 16 <= cap_tokens + 16
    assert many.block_manager.num_blocks * 16 >= cap_tokens - 16
