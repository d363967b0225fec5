"""Prefix caching: shared full blocks are reused by ref count, never change a token, and every
block is accounted for (free + cached == total) through eviction and preemption."""

from __future__ import annotations

import random

import pytest

from engine import ContinuousBatchEngine, Request, SamplingParams
from engine.block_manager import BlockManager, block_keys
from engine.request import RequestState
from models import load_model
from tests.helpers.engine_runs import greedy, seeded, serve, serve_individually


@pytest.fixture(scope="module")
def model():
    return load_model("tinygpt").model


def chat_like(n: int, system_len: int = 200, seed: int = 0) -> list[tuple[list[int], int]]:
    """A shared system prompt, then a distinct question per request."""
    rng = random.Random(seed)
    system = [rng.randrange(256) for _ in range(system_len)]
    return [
        (system + [rng.randrange(256) for _ in range(rng.randint(5, 40))], rng.randint(4, 20))
        for _ in range(n)
    ]


def unrelated(n: int, seed: int = 1) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(256) for _ in range(rng.randint(40, 200))], 8) for _ in range(n)]


def _accounted(engine) -> bool:
    bm = engine.block_manager
    return bm.num_free_blocks == bm.num_usable_blocks and all(c == 0 for c in bm.ref_counts)


def test_prefix_caching_is_on_by_default_in_the_continuous_engine(model):
    assert ContinuousBatchEngine(model).block_manager.enable_prefix_caching


@pytest.mark.parametrize("params", [greedy, seeded], ids=["greedy", "seeded"])
def test_prefix_caching_does_not_change_output(model, params):
    specs = chat_like(12)
    expected = serve_individually(model, specs, params, engine_cls=_no_cache_engine)
    engine = ContinuousBatchEngine(model, max_batch_size=4)
    assert serve(engine, specs, params) == expected
    assert engine.stats().prefix_cache_hits > 0


def _no_cache_engine(model, **kw):
    return ContinuousBatchEngine(model, enable_prefix_caching=False, **kw)


def test_shared_system_prompt_hits_the_cache(model):
    engine = ContinuousBatchEngine(model, max_batch_size=4)
    serve(engine, chat_like(16, system_len=200))
    stats = engine.stats()
    # 12 full blocks of the 200-token system prompt are shared; the first request computes them,
    # so at least (15 / 16) * (192 / ~222) of the prompt tokens should be hits. State a safe bound.
    assert stats.prefix_cache_hit_rate > 0.6, stats


def test_unrelated_prompts_do_not_hit(model):
    engine = ContinuousBatchEngine(model)
    serve(engine, unrelated(10))
    assert engine.stats().prefix_cache_hits == 0


def test_a_resubmitted_prompt_hits_after_its_first_request_finished(model):
    engine = ContinuousBatchEngine(model)
    prompt = list(range(100))
    first = serve(engine, [(prompt, 5)])
    again = serve(engine, [(prompt, 5)])
    assert first == again
    assert engine.stats().prefix_cache_hits == 96  # 6 full blocks; the last token is recomputed


def test_eviction_under_a_small_pool_keeps_outputs_identical(model):
    specs = chat_like(10, system_len=64) + unrelated(6)
    random.Random(3).shuffle(specs)
    params = lambda n, i: SamplingParams(max_tokens=n, ignore_eos=True)  # noqa: E731
    expected = serve_individually(model, specs, params, engine_cls=_no_cache_engine)
    engine = ContinuousBatchEngine(model, num_blocks=24, max_batch_size=4)
    assert serve(engine, specs, params) == expected
    stats = engine.stats()
    assert stats.prefix_cache_evictions > 0 and stats.prefix_cache_hits > 0
    assert _accounted(engine)


def test_shared_block_is_never_freed_while_a_request_uses_it():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = RequestState(Request(list(range(9))), ())
    assert bm.allocate(a, 9)
    a.num_computed_tokens = 9
    bm.cache_full_blocks(a)
    b = RequestState(Request(list(range(8)) + [99]), ())
    hits = bm.lookup_prefix(b)
    assert hits == a.block_ids[:2]
    assert bm.allocate(b, 9, prefix_blocks=hits)
    assert [bm.ref_counts[x] for x in hits] == [2, 2]
    bm.free(a)
    # Still owned by b: not in the free queue, so no allocation can take and overwrite them.
    assert [bm.ref_counts[x] for x in hits] == [1, 1]
    c = RequestState(Request([50] * 16), ())
    assert bm.allocate(c, 16)
    assert not set(c.block_ids) & set(hits)
    assert not bm.allocate(RequestState(Request([1] * 8), ()), 8)  # pool exhausted, hits kept
    bm.free(b)
    bm.free(c)
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_lookup_never_serves_the_last_prompt_token():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = RequestState(Request(list(range(8))), ())
    assert bm.allocate(a, 8)
    a.num_computed_tokens = 8
    bm.cache_full_blocks(a)
    same = RequestState(Request(list(range(8))), ())
    assert (
        len(bm.lookup_prefix(same)) == 1
    )  # 8 tokens: one block, the second would hold the last token


def test_requests_running_together_share_blocks(model):
    engine = ContinuousBatchEngine(model, max_batch_size=8)
    specs = chat_like(8, system_len=160)
    reqs = [Request(p, SamplingParams(max_tokens=30, ignore_eos=True)) for p, _ in specs]
    engine.add_request(reqs[0])
    engine.step()  # the first computes the system prompt
    for r in reqs[1:]:
        engine.add_request(r)
    engine.step()
    shared = engine.block_manager.ref_counts
    assert max(shared) == 8  # the system prompt's blocks, owned by all eight at once
    while engine.has_work():
        engine.step()
    assert _accounted(engine)


# -- keys: cryptographic, salted ----------------------------------------------------------------


def _computed(bm: BlockManager, ids: list[int], salt: str | None = None) -> RequestState:
    s = RequestState(Request(ids, cache_salt=salt), ())
    assert bm.allocate(s, len(ids))
    s.num_computed_tokens = len(ids)
    bm.cache_full_blocks(s)
    return s


def test_blocks_with_a_forced_equal_python_hash_are_never_shared(monkeypatch):
    # Make Python's hash() collide for everything: keys built on it would chain two different
    # first blocks to the same parent, and the second prompt would get the first's KV.
    import builtins

    monkeypatch.setattr(builtins, "hash", lambda obj: 0)
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    a = _computed(bm, [1, 2, 3, 4] + [9, 9, 9, 9] + [5])
    b = RequestState(Request([5, 6, 7, 8] + [9, 9, 9, 9] + [5]), ())
    assert bm.lookup_prefix(b) == []
    same = RequestState(Request([1, 2, 3, 4] + [9, 9, 9, 9] + [6]), ())
    assert bm.lookup_prefix(same) == a.block_ids[:2]  # the cache still works


def test_salted_requests_do_not_share_with_unsalted_or_other_salts():
    bm = BlockManager(num_blocks=32, block_size=4, enable_prefix_caching=True)
    prompt = list(range(13))
    plain = _computed(bm, prompt)
    salted = _computed(bm, prompt, salt="tenant-a")
    assert not set(plain.block_ids) & set(salted.block_ids)
    assert bm.lookup_prefix(RequestState(Request(prompt), ())) == plain.block_ids[:3]
    assert (
        bm.lookup_prefix(RequestState(Request(prompt, cache_salt="tenant-a"), ()))
        == (salted.block_ids[:3])
    )
    assert bm.lookup_prefix(RequestState(Request(prompt, cache_salt="tenant-b"), ())) == []
    assert bm.lookup_prefix(RequestState(Request(prompt, cache_salt=""), ())) == []


def test_block_keys_is_a_chain_that_continues_and_depends_on_model_and_salt():
    ids = list(range(40))
    keys = block_keys(ids, 8)
    assert len(keys) == 5 and all(isinstance(k, bytes) and len(k) == 32 for k in keys)
    assert len(set(keys)) == 5
    assert block_keys(ids[:17], 8) == keys[:2]  # a partial last block has no key
    assert block_keys(ids, 8, parent=keys[1], start=2) == keys[2:]
    assert block_keys(ids, 8, salt="s") != keys
    assert block_keys(ids, 8, model="m1") != block_keys(ids, 8, model="m2")
    # A change in the first block changes every later key (the chain).
    assert not set(block_keys([99] + ids[1:], 8)) & set(keys)
    # Token ids are not truncated to bytes: 256 and 0 differ.
    assert block_keys([256] * 8, 8) != block_keys([0] * 8, 8)
