"""The seed's claims about batching, made strict: scheduling never changes a token."""

from __future__ import annotations

import pytest
import torch

from engine import ContinuousBatchEngine, NaiveEngine, Request, SamplingParams, StaticBatchEngine
from models import load_model
from models.base import ModelLoadError
from tests.helpers.engine_runs import greedy, mixed_specs, seeded, serve, serve_individually

ENGINES = [StaticBatchEngine, ContinuousBatchEngine]


@pytest.fixture(scope="module", params=["auto", "int8"], ids=lambda kv: f"kv-{kv}")
def model(request):
    # int8: the quantized KV pool (the kernels' own format) must be batch-invariant too.
    try:
        return load_model("tinygpt", kv_cache_dtype=request.param).model
    except ModelLoadError as e:  # no kernels here (another CPU, CBSERVE_KERNELS=0)
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def specs():
    # 20 requests for max_batch_size 8: admission happens while others are mid-flight.
    return mixed_specs(20)


@pytest.fixture(scope="module")
def alone_greedy(model, specs):
    return serve_individually(model, specs, greedy)


@pytest.fixture(scope="module")
def alone_seeded(model, specs):
    return serve_individually(model, specs, seeded)


@pytest.mark.parametrize("engine_cls", ENGINES, ids=lambda c: c.name)
def test_batching_does_not_change_greedy_output(model, specs, alone_greedy, engine_cls):
    assert serve(engine_cls(model), specs, greedy) == alone_greedy


@pytest.mark.parametrize("engine_cls", ENGINES, ids=lambda c: c.name)
def test_batching_does_not_change_seeded_sampling(model, specs, alone_seeded, engine_cls):
    assert serve(engine_cls(model), specs, seeded) == alone_seeded


def test_seeded_sampling_differs_from_greedy(alone_greedy, alone_seeded):
    # Guards the test above against sampling silently falling back to argmax.
    assert alone_greedy != alone_seeded


def test_paged_engines_match_naive_recompute(model, specs, alone_greedy):
    if model.config.kv_dtype != torch.float32:
        pytest.skip("the oracle keeps no KV cache: tokens over a quantized pool are that pool's")
    few = specs[:6]
    naive = serve(NaiveEngine(model), few, greedy)
    assert naive == alone_greedy[:6]
    assert serve(ContinuousBatchEngine(model), few, greedy) == naive


def test_continuous_batching_wastes_no_slot_steps(model, specs):
    engine = ContinuousBatchEngine(model)
    serve(engine, specs)
    assert engine.total_slot_steps > 0
    assert engine.wasted_slot_steps == 0


def test_static_batching_wastes_slot_steps_on_mixed_lengths(model, specs):
    engine = StaticBatchEngine(model)
    serve(engine, specs)
    assert engine.wasted_slot_steps > 0
    assert engine.wasted_slot_steps < engine.total_slot_steps


def _first_token_steps(engine, requests: list[Request]) -> tuple[dict[str, int], dict[str, int]]:
    """Step index of each request's first token and of its last."""
    for r in requests:
        engine.add_request(r)
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    step = 0
    while engine.has_work():
        for out in engine.step():
            first.setdefault(out.request_id, step)
            if out.finished:
                last[out.request_id] = step
        step += 1
    return first, last


def _three_requests() -> list[Request]:
    def req(n: int) -> Request:
        return Request([1, 2, 3, 4], SamplingParams(max_tokens=n, ignore_eos=True))

    return [req(2), req(12), req(3)]  # short, long, and one that must wait for a slot


def test_continuous_admits_waiting_request_in_the_step_a_slot_frees(model):
    short, long_, waiting = reqs = _three_requests()
    first, last = _first_token_steps(ContinuousBatchEngine(model, max_batch_size=2), reqs)
    assert first[waiting.request_id] == last[short.request_id] + 1
    assert first[waiting.request_id] < last[long_.request_id]


def test_static_waiting_request_waits_for_the_whole_batch(model):
    short, long_, waiting = reqs = _three_requests()
    first, last = _first_token_steps(StaticBatchEngine(model, max_batch_size=2), reqs)
    assert first[waiting.request_id] == last[long_.request_id] + 1


def test_chunked_prefill_matches_unchunked(model):
    prompt = [(7 * i) % 256 for i in range(300)]
    spec = [(prompt, 20)]
    whole = serve(ContinuousBatchEngine(model, max_num_batched_tokens=2048), spec)
    engine = ContinuousBatchEngine(model, max_batch_size=4, max_num_batched_tokens=32)
    chunked = serve(engine, spec + mixed_specs(3, seed=5))
    assert chunked[0] == whole[0]
    # 300 tokens at 32 a step: the prompt really was split.
    assert engine.num_steps >= 300 // 32


def test_the_step_budget_with_a_starving_queue_does_not_change_greedy_output(
    model, specs, alone_greedy
):
    """A step target far below TinyGPT's step time: 20 requests for 8 slots starve at once, so
    the budget shares steps by head count (the queue's path) and the target's minimum chunks
    alike; every request still finishes with its tokens alone."""
    engine = ContinuousBatchEngine(model, max_batch_size=8, target_step_ms=0.05)
    sb = engine.step_budget
    calls = []
    budget = sb.budget

    def recorded(decoding, prefilling=0, waited_s=0.0):
        calls.append((decoding, prefilling, waited_s))
        return budget(decoding, prefilling, waited_s)

    sb.budget = recorded
    assert serve(engine, specs) == alone_greedy
    starving = [c for c in calls if c[0] and c[1] and c[2] > sb.patience * sb.target_s]
    assert starving, calls


def test_static_batch_forms_whole_even_when_the_token_budget_is_small(model):
    engine = StaticBatchEngine(model, max_batch_size=4, max_num_batched_tokens=8)
    specs = [([i + 1] * 20, 3) for i in range(6)]
    for prompt, n in specs:
        engine.add_request(Request(prompt, SamplingParams(max_tokens=n, ignore_eos=True)))
    engine.step()
    assert engine.stats().num_running == 4  # the batch is 4, though only 8 tokens ran this step
    assert engine.stats().num_waiting == 2
    finished = set()
    while engine.has_work():
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert len(finished) == 6


@pytest.mark.parametrize("policy", ["priority", "fair"])
def test_scheduling_policies_do_not_change_greedy_output(model, specs, alone_greedy, policy):
    # Three clients, mixed priorities, few slots and a tight pool: the policies reorder,
    # preempt and rebalance, and not one token may change.
    engine = ContinuousBatchEngine(
        model, max_batch_size=4, max_num_batched_tokens=48, num_blocks=40, scheduling=policy
    )
    outputs: dict[str, list[int]] = {}
    ids = []
    for i, (prompt, n) in enumerate(specs):
        # The second half arrives mid-run from a new client with a better priority: it
        # outranks (priority) or is owed slots by (fair) the requests running then.
        late = i >= len(specs) // 2
        r = Request(
            list(prompt),
            greedy(n, i),
            client_id="late" if late else f"c{i % 3}",
            priority=-1 if late else i % 4,
        )
        ids.append(r.request_id)
        outputs[r.request_id] = []
        engine.add_request(r)
        if i == len(specs) // 2 - 1:
            for _ in range(6):
                for out in engine.step():
                    outputs[out.request_id].extend(out.token_ids)
    while engine.has_work():
        for out in engine.step():
            outputs[out.request_id].extend(out.token_ids)
    assert [outputs[i] for i in ids] == alone_greedy
    assert engine.stats().num_preemptions > 0  # the policies did move things around
