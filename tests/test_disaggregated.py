"""Disaggregated prefill/decode: moving the cache between pools must not change a single token,
every request is handed off once with exactly its prompt's blocks, and every block of both pools
comes back whatever phase a request is aborted in."""

from __future__ import annotations

import math
import random

import pytest
import torch

from engine import Request, RequestTooLongError, SamplingParams
from engine.disaggregated import DisaggregatedEngine, Phase
from engine.kv_connector import KVConnector, pack_blocks, unpack_blocks
from engine.model_runner import ModelRunner
from models import kernels, load_model
from tests.helpers.engine_runs import greedy, mixed_specs, seeded, serve, serve_individually
from tools import synth_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(tiny_lm):
    return tiny_lm.model


def ignore_eos(n: int, i: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def _all_blocks_free(engine: DisaggregatedEngine) -> bool:
    return all(
        bm.num_free_blocks == bm.num_usable_blocks and not any(bm.ref_counts)
        for bm in (engine.prefill.block_manager, engine.decode.block_manager)
    )


def _num_free_blocks(engine: DisaggregatedEngine) -> int:
    return (
        engine.prefill.block_manager.num_free_blocks + engine.decode.block_manager.num_free_blocks
    )


@pytest.mark.parametrize("params", [greedy, seeded], ids=["greedy", "seeded"])
def test_disaggregation_does_not_change_output(model, params):
    specs = mixed_specs(20)  # 20 requests for 8 decode slots: handoffs while others decode
    expected = serve_individually(model, specs, params)
    engine = DisaggregatedEngine(model)
    assert serve(engine, specs, params) == expected
    assert _all_blocks_free(engine)


def test_every_request_is_transferred_once_with_exactly_its_prompt_blocks(model):
    specs = [(p, max(n, 2)) for p, n in mixed_specs(12, seed=5, max_out=20)]
    engine = DisaggregatedEngine(model)
    serve(engine, specs, ignore_eos)
    assert engine.transfers == len(specs)
    # Whole blocks of the prompt's K and V in every layer: the last block travels padding and all.
    # TinyGPT: 2 (K, V) x 6 layers x 16 tokens x 2 KV heads x 32 dims x 4 bytes (fp32) = 49,152.
    c = model.config
    bytes_per_block = 2 * c.num_layers * 16 * c.num_kv_heads * c.head_dim * 4
    assert bytes_per_block == 49_152
    blocks = sum(math.ceil(len(prompt) / 16) for prompt, _ in specs)
    assert engine.transferred_bytes == blocks * bytes_per_block
    stats = engine.stats()
    assert (stats.transfers, stats.transferred_bytes) == (len(specs), engine.transferred_bytes)


def test_a_request_finished_by_its_first_token_is_not_transferred(model):
    engine = DisaggregatedEngine(model)
    assert [len(t) for t in serve(engine, [([1, 2, 3], 1), ([4, 5], 1)])] == [1, 1]
    assert engine.transfers == 0
    assert _all_blocks_free(engine)


def test_first_token_is_emitted_by_the_prefill_step_before_the_handoff(model):
    engine = DisaggregatedEngine(model)
    r = Request(list(range(40)), SamplingParams(max_tokens=5, ignore_eos=True))
    engine.add_request(r)
    assert [(o.request_id, len(o.token_ids)) for o in engine.step()] == [(r.request_id, 1)]
    assert engine.phase(r.request_id) is Phase.TRANSFER and engine.transfers == 0
    assert len(engine.step()) == 1
    assert engine.phase(r.request_id) is Phase.DECODING and engine.transfers == 1


def test_prefix_cache_hits_in_the_prefill_pool_keep_outputs_identical(model):
    rng = random.Random(2)
    system = [rng.randrange(256) for _ in range(100)]
    specs = [
        (system + [rng.randrange(256) for _ in range(rng.randint(3, 30))], 12) for _ in range(10)
    ]
    expected = serve_individually(model, specs, ignore_eos)
    engine = DisaggregatedEngine(model, max_batch_size=4)
    assert serve(engine, specs, ignore_eos) == expected
    assert engine.stats().prefix_cache_hits > 0
    # Shared blocks are still transferred whole to each request's own decode blocks.
    assert engine.transferred_bytes == sum(math.ceil(len(p) / 16) for p, _ in specs) * 49_152
    assert _all_blocks_free(engine)


@pytest.mark.parametrize("params", [ignore_eos, seeded], ids=["greedy", "seeded"])
def test_small_decode_pool_preempts_and_keeps_outputs_identical(model, params):
    specs = mixed_specs(12, seed=3, max_prompt=60, max_out=30)
    expected = serve_individually(model, specs, params)
    # 9 usable decode blocks of 16 tokens: far less than 8 requests of up to 90 tokens need.
    engine = DisaggregatedEngine(model, decode_num_blocks=10)
    assert serve(engine, specs, params) == expected
    assert engine.decode.stats().num_preemptions > 0
    # Recomputed in the decode pool, not re-prefilled: still one transfer per request.
    assert engine.transfers == sum(len(t) > 1 for t in expected)
    assert _all_blocks_free(engine)


def test_a_waiting_handoff_does_not_stop_others_decoding(model):
    engine = DisaggregatedEngine(model, max_batch_size=2)
    decoders = [Request([7] * 20, SamplingParams(max_tokens=12, ignore_eos=True)) for _ in range(2)]
    for r in decoders:
        engine.add_request(r)
    engine.step()
    engine.step()  # both are decoding, and the decode pool has no free slot
    late = Request([9] * 30, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.add_request(late)
    engine.step()
    held = engine.prefill.block_manager
    for _ in range(5):
        assert engine.phase(late.request_id) is Phase.TRANSFER
        assert held.num_free_blocks == held.num_usable_blocks - 2  # its 30 prompt tokens' KV
        assert {o.request_id for o in engine.step()} == {r.request_id for r in decoders}
    while engine.has_work():
        engine.step()
    assert engine.transfers == 3 and _all_blocks_free(engine)


def test_prefill_waits_rather_than_run_ahead_of_a_full_decode_pool(model):
    engine = DisaggregatedEngine(model, max_batch_size=1)
    blocker = Request([3] * 20, SamplingParams(max_tokens=20, ignore_eos=True))
    engine.add_request(blocker)
    engine.step()
    engine.step()
    late = [Request([i] * 10, SamplingParams(max_tokens=3, ignore_eos=True)) for i in range(3)]
    for r in late:
        engine.add_request(r)
    for _ in range(10):
        emitted = {o.request_id for o in engine.step()}
        assert emitted <= {blocker.request_id, late[0].request_id}
    # One first token out and ready for the next free slot; the rest have not started.
    assert [engine.phase(r.request_id) for r in late] == [
        Phase.TRANSFER,
        Phase.WAITING,
        Phase.WAITING,
    ]


def _advance_to(engine: DisaggregatedEngine, request_id: str, phase: Phase, seen: dict) -> None:
    for _ in range(200):
        if engine.phase(request_id) is phase:
            return
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    raise AssertionError(f"{request_id} never reached {phase}")


@pytest.mark.parametrize("phase", list(Phase), ids=lambda p: p.value)
def test_abort_in_each_phase_frees_every_block_in_both_pools(model, phase):
    # One slot per pool and a 32-token budget: the target waits behind the blocker, prefills in
    # three chunks, then waits in transfer until the blocker's 30 tokens are done.
    engine = DisaggregatedEngine(
        model, max_batch_size=1, prefill_max_batch_size=1, max_num_batched_tokens=32
    )
    blocker = Request([3] * 20, SamplingParams(max_tokens=30, ignore_eos=True))
    target = Request(list(range(70)), SamplingParams(max_tokens=10, ignore_eos=True))
    engine.add_request(blocker)
    engine.add_request(target)
    seen: dict = {}
    _advance_to(engine, target.request_id, phase, seen)
    if phase is Phase.TRANSFER:
        assert engine.phase(blocker.request_id) is Phase.DECODING  # the decode pool is full
    state = engine.requests[target.request_id]
    held, free = len(state.block_ids), _num_free_blocks(engine)
    assert engine.abort(target.request_id) is True
    assert not state.block_ids and _num_free_blocks(engine) == free + held  # freed at once
    assert engine.abort(target.request_id) is False
    assert engine.phase(target.request_id) is None
    while engine.has_work():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    *before, last = seen[target.request_id]
    assert (last.finished, last.finish_reason, last.token_ids) == (True, "abort", [])
    assert not any(o.finished for o in before)
    assert sum(len(o.token_ids) for o in seen[blocker.request_id]) == 30
    assert _all_blocks_free(engine)


def test_a_prompt_larger_than_the_prefill_pool_is_refused(model):
    engine = DisaggregatedEngine(model, prefill_num_blocks=3, decode_num_blocks=20)
    with pytest.raises(RequestTooLongError):
        engine.add_request(Request([1] * 33, SamplingParams(max_tokens=2)))
    with pytest.raises(RequestTooLongError):
        engine.add_request(Request([1] * 30, SamplingParams(max_tokens=300)))  # decode pool
    engine.add_request(Request([1] * 32, SamplingParams(max_tokens=2)))


def test_payload_round_trips_whole_blocks_byte_for_byte(model):
    runner = ModelRunner(model, num_blocks=6, block_size=16)
    runner.kv.normal_()
    payload = pack_blocks(runner, [4, 2], num_tokens=20)
    header, blocks = unpack_blocks(payload)
    assert (header.dtype, header.num_blocks, header.num_tokens) == (torch.float32, 2, 20)
    assert torch.equal(blocks, runner.read_blocks([4, 2]))
    dst = ModelRunner(model, num_blocks=6, block_size=16)
    connector = KVConnector()
    connector.receive(payload, dst, [1, 5])
    assert torch.equal(dst.read_blocks([1, 5]), runner.read_blocks([4, 2]))
    assert not dst.read_blocks([2, 3, 4]).any()  # nothing else written
    assert (connector.transfers, connector.transferred_bytes) == (1, 2 * 49_152)


def test_receive_refuses_blocks_of_another_shape(model):
    src = ModelRunner(model, num_blocks=4, block_size=16)
    payload = pack_blocks(src, [1], num_tokens=3)
    with pytest.raises(ValueError, match="does not fit"):
        KVConnector().receive(payload, ModelRunner(model, num_blocks=4, block_size=8), [1])
    with pytest.raises(ValueError, match="blocks sent"):
        KVConnector().receive(payload, ModelRunner(model, num_blocks=4, block_size=16), [1, 2])


@pytest.mark.skipif(not kernels.available(), reason="no kernels")
def test_receive_refuses_keys_ordered_otherwise(tmp_path, smol_tokenizer):
    """One llama-architecture Q4_K_M file loaded two ways: with the kernels its keys stay in the
    file's (GGML's) order, without them in Hugging Face's. The pools have the same shape, but a
    cache moved from one to the other would be read permuted: refused, either way round."""
    path = synth_model.write_synthetic(
        tmp_path / "llama.gguf", "llama-3.2-1b", "Q4_K_M", seed=1, tokenizer=smol_tokenizer,
        num_hidden_layers=1, hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=256, head_dim=64, vocab_size=512,
    )  # fmt: skip
    packed = load_model(str(path), kv_cache_dtype="float32")
    floats = load_model(str(path), use_kernels=False)
    assert packed.config.rope_interleaved and not floats.config.rope_interleaved
    src, dst = (ModelRunner(lm.model, num_blocks=4, block_size=16) for lm in (packed, floats))
    with pytest.raises(ValueError, match="order"):
        KVConnector().receive(pack_blocks(src, [1], num_tokens=3), dst, [1])
    with pytest.raises(ValueError, match="order"):
        KVConnector().receive(pack_blocks(dst, [1], num_tokens=3), src, [1])
    KVConnector().receive(pack_blocks(src, [1], num_tokens=3), src, [2])  # alike: accepted
