"""Prompt logprobs and embeddings from the engine's own prefill, against transformers.

The oracle is transformers' modeling code on a tiny random Llama (written as a checkpoint our
loader reads): its log_softmax over the whole sequence for prompt logprobs, its final hidden
states (`last_hidden_state`, after the final norm) pooled for embeddings. The engine computes
them chunk by chunk in the paged prefill that runs anyway, next to other requests.
"""

from __future__ import annotations

import pytest
import torch

from engine import ContinuousBatchEngine, NaiveEngine, Request, SamplingParams
from engine.errors import InvalidRequestError
from engine.prompt_outputs import Pooling
from models import load_model
from tests.helpers.model_files import random_ids, small_config, write_hf_checkpoint
from tests.helpers.oracles import hf_hidden, hf_logprobs

TOL = 1e-4
VOCAB = 272


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("tiny-llama")
    ref = write_hf_checkpoint(path, small_config(LlamaConfig, tie_word_embeddings=False))
    return load_model(str(path)), ref


def run(engine, requests: list[Request]) -> dict:
    for r in requests:
        engine.add_request(r)
    outs: dict[str, list] = {r.request_id: [] for r in requests}
    while engine.has_work():
        for o in engine.step():
            outs[o.request_id].append(o)
    return outs


def assert_prompt_logprobs(plps, ref_lps: torch.Tensor, ids: list[int], top_n: int) -> None:
    assert len(plps) == len(ids) and plps[0] is None
    for p in range(1, len(ids)):
        lp = plps[p]
        assert lp.token_id == ids[p]
        assert abs(lp.logprob - ref_lps[p - 1, ids[p]].item()) <= TOL, p
        ref_top = ref_lps[p - 1].topk(top_n)
        assert [t for t, _ in lp.top] == ref_top.indices.tolist()
        assert (
            max(abs(v - r) for (_, v), r in zip(lp.top, ref_top.values.tolist(), strict=True))
            <= TOL
        )


def test_prompt_logprobs_across_chunks_equal_transformers(checkpoint):
    lm, ref = checkpoint
    ids = random_ids(150, VOCAB, seed=3)
    other = random_ids(40, VOCAB, seed=4)
    # A 32-token budget: the prompt is prefilled in five chunks, beside another request.
    engine = ContinuousBatchEngine(lm, max_num_batched_tokens=32, max_batch_size=4)
    req = Request(ids, SamplingParams(max_tokens=3, prompt_logprobs=5, logprobs=0))
    outs = run(engine, [req, Request(other, SamplingParams(max_tokens=5))])[req.request_id]
    assert engine.num_steps >= 5
    assert_prompt_logprobs(outs[0].prompt_logprobs, hf_logprobs(ref, ids), ids, 5)
    assert all(o.prompt_logprobs is None for o in outs[1:])  # sent once
    # The first sampled token's logprob continues the prompt's (position T-1).
    assert (
        abs(outs[0].logprobs[0].logprob - hf_logprobs(ref, ids + outs[0].token_ids)[-2].max()) < TOL
    )


def test_prompt_logprobs_of_a_cached_prefix_are_recomputed_and_equal(checkpoint):
    lm, ref = checkpoint
    ids = random_ids(200, VOCAB, seed=5)
    # One chunk of 200: its logits are taken in slices (LOGITS_SLICE).
    engine = ContinuousBatchEngine(lm, max_num_batched_tokens=256)
    run(engine, [Request(ids[:80], SamplingParams(max_tokens=2))])  # caches 5 blocks
    warm = Request(ids, SamplingParams(max_tokens=1))
    assert run(engine, [warm])[warm.request_id][-1].num_cached_tokens == 80
    req = Request(ids, SamplingParams(max_tokens=0, prompt_logprobs=2))
    (out,) = run(engine, [req])[req.request_id]
    assert out.finished and out.finish_reason == "length" and out.token_ids == []
    assert out.num_cached_tokens == 0  # recomputed, not served from the cache
    assert_prompt_logprobs(out.prompt_logprobs, hf_logprobs(ref, ids), ids, 2)


@pytest.mark.parametrize("pooling", [Pooling.MEAN, Pooling.LAST])
def test_embeddings_equal_transformers_pooled_hidden_states(checkpoint, pooling):
    lm, ref = checkpoint
    prompts = [random_ids(n, VOCAB, seed=n) for n in (1, 17, 90)]
    engine = ContinuousBatchEngine(lm, max_num_batched_tokens=32)
    gen = Request(random_ids(20, VOCAB, seed=9), SamplingParams(max_tokens=8, ignore_eos=True))
    reqs = [Request(p, SamplingParams(max_tokens=0), pooling=pooling) for p in prompts]
    outs = run(engine, [gen, *reqs])
    for p, r in zip(prompts, reqs, strict=True):
        (out,) = outs[r.request_id]
        h = hf_hidden(ref, p)
        want = h.mean(0) if pooling is Pooling.MEAN else h[-1]
        want = want / want.norm()
        got = torch.tensor(out.embedding, dtype=torch.float64)
        assert out.finished and out.token_ids == []
        assert abs(got.norm().item() - 1.0) < 1e-9
        assert (got - want).abs().max().item() <= TOL
    assert len(outs[gen.request_id][-1].token_ids) == 1 and len(outs[gen.request_id]) == 8


def test_an_engine_without_prompt_outputs_refuses_them(checkpoint):
    lm, _ = checkpoint
    with pytest.raises(InvalidRequestError):
        NaiveEngine(lm).add_request(Request([1, 2], SamplingParams(prompt_logprobs=1)))
