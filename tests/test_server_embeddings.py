"""/v1/embeddings and prompt logprobs (`echo`, `prompt_logprobs`) through a real server and the
OpenAI SDK, against transformers on a tiny random Llama (the oracle), and embeddings sharing
steps with generation without changing a generated token."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
import torch

from models import load_model
from tests.helpers.model_files import random_ids, small_config, write_hf_checkpoint
from tests.helpers.oracles import hf_hidden, hf_logprobs
from tests.helpers.servers import run_server

TOL = 1e-4
VOCAB = 259  # the tokenizer's ids (the model pads its embedding to 272)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("tiny-llama-server")
    ref = write_hf_checkpoint(path, small_config(LlamaConfig, tie_word_embeddings=False))
    lm = load_model(str(path))
    # A 32-token step budget: longer prompts are prefilled in chunks.
    with run_server(lm, engine_options={"max_num_batched_tokens": 32}) as live:
        yield live, lm, ref


def test_sdk_embeddings_of_64_inputs_equal_transformers_mean_pooled_hidden_states(llama):
    live, lm, ref = llama
    # 3 to 66 tokens: the longer half is prefilled in chunks of the 32-token step budget
    prompts = [random_ids(3 + i, VOCAB, seed=i) for i in range(64)]
    client = openai.OpenAI(base_url=live.v1, api_key="x")
    got = client.embeddings.create(model=lm.name, input=prompts)  # the SDK asks for base64
    assert [d.index for d in got.data] == list(range(64))
    assert got.usage.prompt_tokens == got.usage.total_tokens == sum(map(len, prompts))
    for p, d in zip(prompts, got.data, strict=True):
        want = hf_hidden(ref, p).mean(0)
        want = want / want.norm()
        assert (torch.tensor(d.embedding, dtype=torch.float64) - want).abs().max() <= TOL
    text = client.embeddings.create(model=lm.name, input="a string", encoding_format="float")
    ids = lm.tokenizer.encode("a string", add_special_tokens=True)
    want = hf_hidden(ref, ids).mean(0)
    assert (torch.tensor(text.data[0].embedding) - want / want.norm()).abs().max() <= TOL


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": [1, VOCAB + 5]}, "input"),
        ({"input": [0] * 300}, "input"),  # longer than the context (256)
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "dimensions": 8}, "dimensions"),
        ({"input": "x", "model": "nope"}, "model"),
    ],
)
def test_bad_embedding_requests_get_4xx_naming_the_field(llama, body, param):
    live, _, _ = llama
    r = httpx.post(live.url("/v1/embeddings"), json=body, timeout=30)
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["error"]["param"] == param


def test_sdk_echo_logprobs_with_max_tokens_0_equal_transformers(llama):
    """What lm-evaluation-harness's loglikelihood sends: echo, max_tokens 0, logprobs."""
    live, lm, ref = llama
    ids = random_ids(90, VOCAB, seed=11)  # three 32-token chunks
    client = openai.OpenAI(base_url=live.v1, api_key="x")
    r = client.completions.create(
        model=lm.name,
        prompt=ids,
        echo=True,
        max_tokens=0,
        logprobs=3,
        extra_body={"prompt_logprobs": 2},
    )
    (c,) = r.choices
    lp = c.logprobs
    want = hf_logprobs(ref, ids)
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None
    for p in range(1, len(ids)):
        assert abs(lp.token_logprobs[p] - want[p - 1, ids[p]].item()) <= TOL
        # Keyed by token text (OpenAI's shape), so tokens with equal text share a key.
        assert abs(max(lp.top_logprobs[p].values()) - want[p - 1].max().item()) <= TOL
    assert lp.text_offset == sorted(lp.text_offset)
    assert c.finish_reason == "length" and r.usage.completion_tokens == 0
    plps = c.model_extra["prompt_logprobs"]
    assert plps[0] is None and len(plps) == len(ids)
    for p in range(1, len(ids)):
        entry = plps[p][str(ids[p])]
        assert abs(entry["logprob"] - want[p - 1, ids[p]].item()) <= TOL
        assert entry["rank"] == int((want[p - 1] > want[p - 1, ids[p]]).sum()) + 1


def test_echo_logprobs_cover_prompt_then_completion_streamed_and_not(llama):
    live, lm, ref = llama
    ids = random_ids(40, VOCAB, seed=12)
    body = {
        "prompt": ids,
        "echo": True,
        "max_tokens": 3,
        "logprobs": 1,
        "ignore_eos": True,
        "temperature": 0,
    }
    full = httpx.post(live.url("/v1/completions"), json=body, timeout=60).json()["choices"][0]
    lp = full["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 3
    want = hf_logprobs(ref, ids)
    assert abs(lp["token_logprobs"][39] - want[38, ids[39]].item()) <= TOL
    # The first completion token is position 39's prediction.
    assert abs(lp["token_logprobs"][40] - want[39].max().item()) <= TOL
    with httpx.stream(
        "POST", live.url("/v1/completions"), json={**body, "stream": True}, timeout=60
    ) as r:
        chunks = [line for line in r.iter_lines() if line.startswith("data: {")]
    parts = [json.loads(c[6:])["choices"][0] for c in chunks]
    streamed = [t for p in parts for t in p["logprobs"]["token_logprobs"]]
    assert streamed == lp["token_logprobs"]
    assert "".join(p["text"] for p in parts) == full["text"]


async def _generate(base: str, model: str, prompts: list[list[int]]) -> list[list[int]]:
    client = openai.AsyncOpenAI(base_url=base, api_key="x")
    outs = await asyncio.gather(
        *(
            client.completions.create(
                model=model,
                prompt=p,
                max_tokens=12,
                temperature=0,
                logprobs=0,
                extra_body={"ignore_eos": True},
            )
            for p in prompts
        )
    )
    return [o.choices[0].logprobs.tokens for o in outs]


async def _mixed(base: str, model: str, prompts: list[list[int]]) -> list[list[int]]:
    client = openai.AsyncOpenAI(base_url=base, api_key="x")
    embeds = [
        client.embeddings.create(
            model=model, input=[random_ids(20 + j, VOCAB, seed=100 + j) for j in range(8)]
        )
        for _ in range(6)
    ]
    results = await asyncio.gather(_generate(base, model, prompts), *embeds)
    assert all(len(e.data) == 8 for e in results[1:])
    return results[0]


def test_embeddings_mixed_with_generation_change_no_generated_token(llama):
    live, lm, _ = llama
    prompts = [random_ids(10 + 7 * i, VOCAB, seed=50 + i) for i in range(6)]
    alone = asyncio.run(_generate(live.v1, lm.name, prompts))
    runner = live.engine.runner
    kinds: list[set[bool]] = []  # per step: embedding rows (True), generation rows (False)
    execute = runner.execute

    def spy(rows):
        kinds.append({r.state.request.pooling is not None for r in rows})
        return execute(rows)

    runner.execute = spy  # the engine thread looks it up per step
    try:
        mixed = asyncio.run(_mixed(live.v1, lm.name, prompts))
    finally:
        del runner.execute
    assert mixed == alone
    assert {True, False} in kinds  # some step ran embeddings and generation together
