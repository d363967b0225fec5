"""The recurrent state pool's bookkeeping (engine.state_pool) and how the batch engine sizes
and accounts for it: live slots taken on admission and given back on finish, abort and
preemption; snapshot slots kept for the prefix cache, least recently used first out, dropped
with their block; the budget split between K/V and state; the stats and /metrics lines."""

from __future__ import annotations

import pytest

from engine.state_pool import SNAPSHOT_INTERVAL, StateOp, StateSlots, snapshot_points


def test_snapshot_points_every_interval_and_the_prompts_last_full_block():
    bs = 16
    # a 1,074-token prompt in one chunk: every 256 tokens, and its last full block (1072)
    assert snapshot_points(0, 1074, 1074, bs) == [256, 512, 768, 1024, 1072]
    # in chunks of 512: the same points, each in the chunk that reaches it
    chunks = [snapshot_points(s, min(s + 512, 1074), 1074, bs) for s in (0, 512, 1024)]
    assert chunks == [[256, 512], [768, 1024], [1072]]
    # never past the prompt (decode tokens take none), never at the chunk's own start
    assert snapshot_points(1074, 1075, 1074, bs) == []
    assert snapshot_points(256, 300, 1000, bs) == []
    # a short prompt: its last full block only
    assert snapshot_points(0, 42, 42, 4) == [40]
    # an interval that is no multiple of the block size rounds up to one
    assert snapshot_points(0, 600, 600, 100) == [300, 600] and SNAPSHOT_INTERVAL == 256


def test_live_slots_are_zeroed_for_a_fresh_request_and_reused_last_freed_first():
    slots = StateSlots(num_live=3, num_snapshots=2)
    assert (slots.num_slots, slots.scratch) == (6, 5)
    a, b = slots.take_live(), slots.take_live()
    assert (a, b) == (0, 1)
    assert slots.take_ops() == [StateOp(None, 0), StateOp(None, 1)]
    slots.release_live(a)
    assert slots.take_live() == a  # the slot freed last: its pages are the warm ones
    slots.take_live()
    assert slots.take_live() is None and slots.num_free_live == 0
    with pytest.raises(AssertionError):
        slots.release_live(7)


def test_a_restore_copies_the_snapshot_into_the_new_live_slot():
    slots = StateSlots(num_live=2, num_snapshots=2)
    snap = slots.snapshot(b"k1")
    assert snap in (2, 3) and slots.has_snapshot(b"k1")
    live = slots.take_live(restore_from=b"k1")
    assert slots.take_ops() == [StateOp(snap, live)]
    assert slots.counters.restored == 1


def test_snapshots_are_evicted_least_recently_used_and_dropped_with_their_block():
    slots = StateSlots(num_live=1, num_snapshots=2)
    s1, s2 = slots.snapshot(b"a"), slots.snapshot(b"b")
    assert slots.snapshot(b"a") is None  # kept already: used, not retaken
    s3 = slots.snapshot(b"c")  # full: "b" is the least recently used
    assert s3 == s2 and not slots.has_snapshot(b"b") and slots.has_snapshot(b"a")
    slots.drop(b"a")
    assert not slots.has_snapshot(b"a") and slots.num_cached_snapshots == 1
    assert slots.snapshot(b"d") == s1
    assert StateSlots(num_live=1, num_snapshots=0).snapshot(b"x") is None


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory):
    from models import load_model
    from tests.helpers.hybrid_configs import lfm2_config
    from tests.helpers.model_files import write_hf_checkpoint

    path = tmp_path_factory.mktemp("lfm2")
    write_hf_checkpoint(path, lfm2_config(), seed=1)
    return load_model(str(path), use_kernels=False, kv_cache_dtype="float32")


def test_the_budget_holds_kv_and_state_and_bounds_the_batch(lfm2):
    """--kv-cache-memory covers K/V blocks and state slots: live slots take at most half the
    budget (fewer than the batch size: the batch is that small), snapshots an eighth."""
    from engine import ContinuousBatchEngine
    from engine.batch import SNAPSHOT_SHARE, STATE_SHARE

    c = lfm2.config
    per_slot = c.state_layout.bytes_per_slot
    assert per_slot == 4 * 3 * 2 * 64  # three conv layers, 2 x 64 inputs each, float32
    gib = 20 * per_slot / 2**30  # room for 10 live slots at most
    engine = ContinuousBatchEngine(
        lfm2.model, max_batch_size=64, block_size=4, kv_cache_memory_gib=gib
    )
    s = engine.stats()
    assert s.num_state_slots == int(gib * 2**30 * STATE_SHARE // per_slot) == 10
    assert s.num_slots == engine.scheduler.max_batch_size == 10  # admission waits for a slot
    assert s.num_state_snapshot_slots == int(gib * 2**30 * SNAPSHOT_SHARE // per_slot)
    kv = engine.block_manager.num_blocks * 4 * c.kv_bytes_per_token
    assert engine.block_manager.num_blocks > 2  # (the rest of the budget, not the floor)
    state = (s.num_state_slots + s.num_state_snapshot_slots + 1) * per_slot
    assert kv + state <= gib * 2**30
    assert engine.runner.kv.nbytes + engine.runner.conv_states.nbytes == kv + state
    with pytest.raises(ValueError, match="cannot hold one request's recurrent state"):
        ContinuousBatchEngine(lfm2.model, kv_cache_memory_gib=per_slot / 2**30)


def test_slots_return_on_finish_abort_and_preemption(lfm2):
    from engine import ContinuousBatchEngine, Request, SamplingParams

    engine = ContinuousBatchEngine(lfm2.model, max_batch_size=3, block_size=4, num_blocks=10)
    reqs = [
        Request(
            prompt_token_ids=list(range(3, 3 + n)),
            params=SamplingParams(max_tokens=8, ignore_eos=True),
        )
        for n in (9, 14, 5)
    ]
    for r in reqs:
        engine.add_request(r)
    engine.step()
    assert engine.stats().num_free_state_slots == 0
    engine.abort(reqs[2].request_id)
    assert engine.stats().num_free_state_slots == 1
    while engine.has_work():
        engine.step()
    s = engine.stats()
    assert s.num_preemptions > 0  # 9 blocks for the two others' 17 and 22 tokens (5 + 6)
    assert s.num_free_state_slots == s.num_state_slots == 3
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks


def test_metrics_report_the_state_pool(lfm2):
    from engine import ContinuousBatchEngine
    from server.generation.metrics import ServerMetrics

    engine = ContinuousBatchEngine(lfm2.model, max_batch_size=4, block_size=4, num_blocks=32)
    text = ServerMetrics(engine.stats, lambda: True).render().decode()
    per_slot = lfm2.config.state_layout.bytes_per_slot
    assert "cbserve_state_slots_total 4.0" in text
    assert "cbserve_state_slots_used 0.0" in text
    assert f"cbserve_state_pool_bytes {float(8 * per_slot)}" in text
