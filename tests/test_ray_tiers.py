"""The disaggregated tiers' engines without Ray: a `PrefillEngine` hands each request off as a
pickled `Handoff` (what crosses processes), a separate `DecodeEngine` continues it, and the tokens
equal one engine's, greedy and seeded, with every block of both pools free afterwards."""

from __future__ import annotations

import math
import pickle

import pytest
import torch

from engine import EngineConfig, Request
from engine.tiers import DecodeEngine, PrefillEngine
from tests.helpers.engine_runs import greedy, mixed_specs, seeded, serve_individually


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model(tiny_lm):
    return tiny_lm.model


def run_split(model, specs, params, config=None):
    """Every request through a prefill engine, its hand-off pickled and unpickled (as between two
    processes), then a decode engine; both stepped in turn until done."""
    config = config or EngineConfig(max_batch_size=4, kv_cache_memory_gib=0.05)
    prefill, decode = PrefillEngine(model, config), DecodeEngine(model, config)
    ids, outputs = [], {}
    for i, (prompt, n) in enumerate(specs):
        r = Request(prompt_token_ids=list(prompt), params=params(n, i))
        ids.append(r.request_id)
        outputs[r.request_id] = []
        prefill.add_request(r)
    steps = 0
    while prefill.has_work() or decode.has_work():
        for out in prefill.step():
            outputs[out.request_id].extend(out.token_ids)
            handoff = prefill.take_handoff(out.request_id)
            assert (handoff is None) == out.finished
            if handoff is not None:
                handoff = pickle.loads(pickle.dumps(handoff))
                decode.expect(handoff)
                decode.add_request(handoff.snapshot.request)
        for out in decode.step():
            outputs[out.request_id].extend(out.token_ids)
        steps += 1
        assert steps < 10_000
    return [outputs[i] for i in ids], prefill, decode


@pytest.mark.parametrize("params", [greedy, seeded], ids=["greedy", "seeded"])
def test_split_tiers_equal_one_engine(model, params):
    specs = mixed_specs(12, seed=3)  # 12 requests for 4 decode slots: arrivals wait for room
    got, prefill, decode = run_split(model, specs, params)
    assert got == serve_individually(model, specs, params)
    for bm in (prefill.pool.block_manager, decode.pool.block_manager):
        assert bm.num_free_blocks == bm.num_usable_blocks and not any(bm.ref_counts)
    handed = sum(n > 1 for _, n in specs)  # a 1-token request ends in the prefill tier
    assert prefill.handed_off == decode.connector.transfers == handed
    c = model.config
    per_block = 2 * c.num_layers * 16 * c.num_kv_heads * c.head_dim * 4
    blocks = sum(math.ceil(len(p) / 16) for p, n in specs if n > 1)
    assert decode.connector.transferred_bytes == blocks * per_block
    assert prefill.handed_off_bytes > decode.connector.transferred_bytes  # + the headers


def test_split_tiers_equal_one_engine_over_int8_kv_pools():
    """The hand-off carries int8 pool rows (values and scales) byte for byte."""
    from models import load_model
    from models.base import ModelLoadError

    try:
        model = load_model("tinygpt", kv_cache_dtype="int8").model
    except ModelLoadError as e:  # no kernels here
        pytest.skip(str(e))
    specs = mixed_specs(6, seed=4)
    got, _, decode = run_split(model, specs, seeded)
    assert got == serve_individually(model, specs, seeded)
    layout = model.config.kv_layout
    blocks = sum(math.ceil(len(p) / 16) for p, n in specs if n > 1)
    assert decode.connector.transferred_bytes == blocks * 16 * layout.bytes_per_token


def test_abort_while_waiting_for_a_decode_slot_frees_everything(model):
    config = EngineConfig(max_batch_size=1, kv_cache_memory_gib=0.05)
    prefill, decode = PrefillEngine(model, config), DecodeEngine(model, config)
    reqs = [Request(prompt_token_ids=[5] * 40, params=greedy(30, 0)) for _ in range(2)]
    for r in reqs:
        prefill.add_request(r)
    while len(decode.requests) < 2:
        for out in prefill.step():
            h = prefill.take_handoff(out.request_id)
            decode.expect(h)
            decode.add_request(h.snapshot.request)
    decode.step()  # the first is admitted, the second waits for the slot
    assert decode.stats().num_waiting == 1
    assert decode.abort(reqs[1].request_id) and decode.abort(reqs[0].request_id)
    assert [o.finish_reason for o in decode.step()] == ["abort", "abort"]
    bm = decode.pool.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks and not decode.has_work()


def test_a_request_without_its_handoff_is_refused(model):
    decode = DecodeEngine(model, EngineConfig(max_batch_size=1, kv_cache_memory_gib=0.05))
    from engine import InvalidRequestError

    with pytest.raises(InvalidRequestError):
        decode.add_request(Request(prompt_token_ids=[1, 2], params=greedy(3, 0)))
