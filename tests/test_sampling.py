"""Sampling parameters: validation, each processing rule, logprobs, per-request seeds."""

from __future__ import annotations

import math

import pytest
import torch

from engine import ContinuousBatchEngine, Request, SamplingParams
from engine.request import RequestState
from engine.sampling import sample
from models import load_model
from tests.helpers.engine_runs import serve

PROMPT = [72, 101, 108, 108, 111]


@pytest.fixture(scope="module")
def model():
    return load_model("tinygpt").model


def _run(model, **params) -> list[int]:
    return serve(
        ContinuousBatchEngine(model),
        [(PROMPT, params.pop("max_tokens", 12))],
        lambda n, i: SamplingParams(max_tokens=n, **params),
    )[0]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", -1),  # 0 is valid: the prompt only (engine.prompt_outputs)
        ("temperature", -0.5),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 2.0),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 3.0),
        ("frequency_penalty", -3.0),
        ("logprobs", 50),
    ],
)
def test_invalid_sampling_params_raise_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_is_invalid():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)


def test_top_k_one_is_greedy(model):
    assert _run(model, temperature=1.0, top_k=1, seed=3) == _run(model)


def test_tiny_top_p_is_greedy(model):
    assert _run(model, temperature=1.0, top_p=1e-6, seed=3) == _run(model)


def test_min_p_one_is_greedy(model):
    assert _run(model, temperature=1.5, min_p=1.0, seed=3) == _run(model)


def test_same_seed_same_tokens_different_seed_different_tokens(model):
    a = _run(model, temperature=1.0, seed=11, max_tokens=24)
    assert a == _run(model, temperature=1.0, seed=11, max_tokens=24)
    assert a != _run(model, temperature=1.0, seed=12, max_tokens=24)


def test_logit_bias_forces_a_token(model):
    assert _run(model, logit_bias=((65, 100.0),), max_tokens=5) == [65] * 5


def test_stop_token_id_ends_the_request_with_stop(model):
    first = _run(model, max_tokens=1)[0]
    engine = ContinuousBatchEngine(model)
    engine.add_request(Request(PROMPT, SamplingParams(max_tokens=10, stop_token_ids=(first,))))
    outs = []
    while engine.has_work():
        outs += engine.step()
    assert [o.token_ids for o in outs] == [[first]]
    assert outs[-1].finish_reason == "stop"


def test_eos_stops_unless_ignore_eos_and_min_tokens_delays_it(model):
    eos = model.config.eos_token_ids[0]
    forced = ((eos, 100.0),)
    assert _run(model, logit_bias=forced) == [eos]
    assert len(_run(model, logit_bias=forced, ignore_eos=True, max_tokens=6)) == 6
    delayed = _run(model, logit_bias=forced, min_tokens=4, max_tokens=10)
    assert len(delayed) == 5 and eos not in delayed[:4] and delayed[4] == eos


def test_max_tokens_ends_with_length(model):
    engine = ContinuousBatchEngine(model)
    engine.add_request(Request(PROMPT, SamplingParams(max_tokens=3, ignore_eos=True)))
    outs = []
    while engine.has_work():
        outs += engine.step()
    assert sum(len(o.token_ids) for o in outs) == 3
    assert [o.finished for o in outs] == [False, False, True]
    assert outs[-1].finish_reason == "length"


def _state(prompt, **params) -> RequestState:
    return RequestState(Request(list(prompt), SamplingParams(**params)), eos_token_ids=())


def test_logprobs_report_the_sampled_token_and_sorted_top_n():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    tokens, lps = sample(logits, [_state([1], logprobs=3)])
    lp = lps[0]
    expected = torch.log_softmax(logits[0], dim=-1)
    assert tokens == [1] and lp.token_id == 1
    assert math.isclose(lp.logprob, float(expected[1]), rel_tol=1e-6)
    assert [t for t, _ in lp.top] == [1, 2, 0]
    assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)


def test_no_logprobs_unless_asked():
    _, lps = sample(torch.tensor([[0.0, 1.0]]), [_state([1])])
    assert lps == [None]


def test_repetition_penalty_demotes_seen_tokens():
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    assert sample(logits, [_state([0])])[0] == [0]
    assert sample(logits, [_state([0], repetition_penalty=1.5)])[0] == [1]


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.tensor([[2.0, 1.5, 0.0]])
    in_prompt = _state([0], presence_penalty=1.0)
    assert sample(logits, [in_prompt])[0] == [0]  # prompt tokens are not penalised
    generated = _state([2], presence_penalty=1.0)
    generated.token_ids.append(0)  # token 0 was generated
    assert sample(logits, [generated])[0] == [1]
    freq = _state([2], frequency_penalty=0.2)
    freq.token_ids += [0, 0]  # 2.0 - 2 * 0.2 = 1.6 > 1.5: still token 0
    assert sample(logits, [freq])[0] == [0]
    freq.token_ids.append(0)  # 2.0 - 3 * 0.2 = 1.4 < 1.5
    assert sample(logits, [freq])[0] == [1]


def test_seeded_row_draws_the_same_whatever_shares_its_batch():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    alone = sample(logits[2:3], [_state([1], temperature=1.0, seed=5)])[0]
    others = [_state([1], temperature=1.0, seed=s) for s in (1, 2)]
    batched = sample(logits[:3], [*others, _state([1], temperature=1.0, seed=5)])[0]
    assert batched[2] == alone[0]


def _kept_by_full_sort(x: torch.Tensor, top_k, top_p: float, min_p: float) -> set[int]:
    """The reference filter: sort the whole vocabulary (what the sampler did before it started
    from top-k candidates)."""
    vals, order = x.sort(descending=True)
    drop = torch.arange(len(x)) >= (top_k if top_k is not None else len(x))
    probs = vals.masked_fill(drop, float("-inf")).softmax(dim=0)
    drop |= (probs.cumsum(dim=0) - probs) >= top_p
    drop[0] = False
    kept = x.clone()
    kept[order[drop]] = float("-inf")
    if min_p > 0:
        probs = kept.softmax(dim=0)
        kept[probs < min_p * probs.max()] = float("-inf")
    return set(torch.nonzero(kept > float("-inf")).flatten().tolist())


@pytest.mark.parametrize(
    ("scale", "top_k", "top_p", "min_p"),
    [
        (8.0, None, 0.9, 0.0),  # peaked: the nucleus is a few of the 256 candidates
        (8.0, None, 0.999, 0.0),
        (0.05, None, 0.9, 0.0),  # flat: the nucleus reaches past the candidates (full sort)
        (1.0, 40, 0.8, 0.0),
        (1.0, 1000, 0.95, 0.0),  # top-k larger than the candidates
        (1.0, None, 1.0, 0.05),  # min-p alone
        (3.0, 50, 0.9, 0.1),
    ],
)
def test_the_kept_tokens_are_those_a_full_sort_keeps(scale, top_k, top_p, min_p):
    from engine.sampling import CANDIDATES, _nucleus

    torch.manual_seed(11)
    x = torch.randn(49152) * scale
    ids, vals = _nucleus(x, top_k, top_p, min_p)
    kept = set(ids.tolist())
    assert kept == _kept_by_full_sort(x, top_k, top_p, min_p)
    assert torch.equal(vals, x[ids])
    if top_k is not None or top_p < 1.0:
        assert bool((vals[:-1] >= vals[1:]).all())  # best first
    if scale == 0.05:
        assert len(kept) > CANDIDATES


def test_a_filtered_draw_only_picks_kept_tokens_and_follows_their_probabilities():
    torch.manual_seed(2)
    logits = torch.randn(1, 300) * 2
    keep = _kept_by_full_sort(logits[0], None, 0.7, 0.0)
    counts: dict[int, int] = {}
    for seed in range(3000):
        tok = sample(logits, [_state([1], temperature=1.0, top_p=0.7, seed=seed)])[0][0]
        counts[tok] = counts.get(tok, 0) + 1
    assert set(counts) <= keep
    probs = logits[0, sorted(keep)].softmax(dim=0)
    for tok, p in zip(sorted(keep), probs.tolist(), strict=True):
        assert abs(counts.get(tok, 0) / 3000 - p) < 4 * math.sqrt(p * (1 - p) / 3000) + 1e-3


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0.7, "top_p": 0.9},
        {"temperature": 1.0, "top_k": 20, "top_p": 0.95},
        {"temperature": 3.0, "top_p": 0.99},  # flat: the nucleus reaches past the candidates
        {"temperature": 1.0, "top_k": 600},  # a top-k beyond the candidates
        {"temperature": 1.0, "min_p": 0.05},
    ],
)
def test_seeded_filtered_rows_draw_the_same_alone_and_in_a_mixed_batch(params):
    """Over a vocabulary larger than the candidates, so the batched topk path runs."""
    torch.manual_seed(3)
    logits = torch.randn(5, 1000) * 4
    mixed = [
        {"temperature": 0.0},
        {"temperature": 0.5, "top_p": 0.8},
        {"temperature": 1.0},
        {"temperature": 1.2, "top_k": 5},
    ]
    for seed in range(6):
        alone = sample(logits[4:5], [_state([1], seed=seed, **params)])[0][0]
        others = [_state([1], seed=100 + j, **m) for j, m in enumerate(mixed)]
        batched = sample(logits, [*others, _state([1], seed=seed, **params)])[0]
        assert batched[4] == alone
        x = logits[4] / params["temperature"]
        keep = _kept_by_full_sort(
            x, params.get("top_k"), params.get("top_p", 1.0), params.get("min_p", 0.0)
        )
        assert alone in keep


@pytest.mark.parametrize("params", [{"top_p": 0.9}, {"top_k": 50}, {"min_p": 0.01}, {}])
def test_masked_tokens_are_never_drawn(params):
    """A row with a handful of allowed tokens (a grammar or logit-bias mask leaves -inf) over a
    vocabulary larger than the candidates: every path draws only allowed tokens."""
    logits = torch.full((2, 1000), float("-inf"))
    allowed = [3, 500, 999]
    logits[:, allowed] = torch.tensor([1.0, 0.5, 0.2])
    drawn = set()
    for seed in range(200):
        tokens = sample(logits, [_state([1], temperature=1.5, seed=seed, **params)] * 2)[0]
        drawn.update(tokens)
    assert drawn <= set(allowed) and len(drawn) > 1
