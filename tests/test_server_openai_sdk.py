"""The official `openai` SDK against a live TinyGPT server: completions and chat, streamed and
not, n > 1, stop strings and stop token ids, seeds, logprobs, echo, token prompts, models."""

from __future__ import annotations

import openai
import pytest
import torch

from engine import Request, SamplingParams, make_engine
from tests.helpers.servers import LiveServer


def oracle_greedy(lm, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy token ids from the naive engine (no batching, no KV cache): the reference."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two OpenMP threads on two busy cores run this 50x slower
    try:
        engine = make_engine("naive", lm.model)
        engine.add_request(
            Request(prompt_ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        )
        out: list[int] = []
        while engine.has_work():
            for step in engine.step():
                out += step.token_ids
        return out
    finally:
        torch.set_num_threads(threads)


# TinyGPT's greedy continuation of this prompt is long, printable in places, and never hits EOS
# within a few dozen tokens; ignore_eos makes the lengths exact anyway.
PROMPT = "Hello world"


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=60)


def greedy(client: openai.OpenAI, **kw) -> openai.types.Completion:
    args = {
        "model": "tinygpt",
        "prompt": PROMPT,
        "max_tokens": 24,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    return client.completions.create(**{**args, **kw})


def test_completion_returns_text_finish_reason_and_token_usage(client, tiny_lm):
    out = greedy(client, max_tokens=7)
    assert out.object == "text_completion"
    assert out.model == "tinygpt"
    assert len(out.choices) == 1
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].text
    assert out.usage.prompt_tokens == len(tiny_lm.tokenizer.encode(PROMPT, add_special_tokens=True))
    assert out.usage.completion_tokens == 7
    assert out.usage.total_tokens == out.usage.prompt_tokens + 7


def test_greedy_completion_is_deterministic(client):
    assert greedy(client).choices[0].text == greedy(client).choices[0].text


def test_streamed_completion_concatenates_to_the_non_streamed_text(client):
    full = greedy(client)
    chunks = list(greedy(client, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length"
    assert all(f is None for f in finishes[:-1])


def test_stream_include_usage_sends_a_final_usage_chunk_with_no_choices(client):
    chunks = list(greedy(client, max_tokens=5, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_completion_returns_an_assistant_message_with_usage(client, tiny_lm):
    messages = [{"role": "user", "content": "Hi there"}]
    out = client.chat.completions.create(
        model="tinygpt", messages=messages, max_tokens=6, temperature=0
    )
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason in ("length", "stop")
    rendered = tiny_lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert out.usage.prompt_tokens == len(tiny_lm.tokenizer.encode(rendered))
    assert 1 <= out.usage.completion_tokens <= 6


def test_streamed_chat_sends_role_first_then_content_then_one_finish(client):
    kw = {
        "model": "tinygpt",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 12,
        "temperature": 0,
    }
    full = client.chat.completions.create(**kw, extra_body={"ignore_eos": True})
    chunks = list(
        client.chat.completions.create(**kw, stream=True, extra_body={"ignore_eos": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    )
    finishes = [c.choices[0].finish_reason for c in chunks]
    assert finishes[-1] == "length" and finishes.count("length") == 1


def test_max_completion_tokens_limits_chat_output(client):
    out = client.chat.completions.create(
        model="tinygpt",
        messages=[{"role": "user", "content": "Hi"}],
        max_completion_tokens=3,
        extra_body={"ignore_eos": True},
    )
    assert out.usage.completion_tokens == 3
    assert out.choices[0].finish_reason == "length"


def test_n_returns_that_many_indexed_choices(client):
    out = greedy(client, n=3, temperature=1.0, seed=1, max_tokens=8)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert out.usage.completion_tokens == 24
    assert len({c.text for c in out.choices}) > 1  # seed + i per choice: not three copies


def test_n_streamed_gives_each_choice_its_own_finish(client):
    chunks = list(greedy(client, n=2, max_tokens=5, stream=True))
    for index in (0, 1):
        finishes = [
            c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].index == index
        ]
        assert finishes[-1] == "length" and finishes.count("length") == 1


def test_same_seed_reproduces_sampled_text_and_another_seed_differs(client):
    a = greedy(client, temperature=1.0, seed=1234, max_tokens=16)
    b = greedy(client, temperature=1.0, seed=1234, max_tokens=16)
    c = greedy(client, temperature=1.0, seed=4321, max_tokens=16)
    assert a.choices[0].text == b.choices[0].text
    assert a.choices[0].text != c.choices[0].text


def _stop_string(text: str) -> tuple[str, str]:
    """A 2-character stop string from the middle of `text`, and the text before its first match."""
    for start in range(4, len(text) - 2):
        stop = text[start : start + 2]
        if "\ufffd" not in stop and stop.strip():
            return stop, text[: text.find(stop)]
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_string_truncates_before_the_match_and_finishes_with_stop(client):
    text = greedy(client, max_tokens=32).choices[0].text
    stop, expected = _stop_string(text)
    out = greedy(client, max_tokens=32, stop=[stop, "never-generated-xyz"])
    assert out.choices[0].text == expected
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens < 32


def test_streamed_stop_string_is_never_sent(client):
    text = greedy(client, max_tokens=32).choices[0].text
    stop, expected = _stop_string(text)
    chunks = list(greedy(client, max_tokens=32, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.fixture(scope="module")
def oracle_ids(tiny_lm) -> list[int]:
    return oracle_greedy(tiny_lm, tiny_lm.tokenizer.encode(PROMPT, add_special_tokens=True), 24)


def test_greedy_completion_matches_the_engine_run_directly(client, tiny_lm, oracle_ids):
    ids = oracle_ids
    assert greedy(client, max_tokens=24).choices[0].text == tiny_lm.tokenizer.decode(ids)


def test_stop_token_id_ends_generation_without_its_text(client, tiny_lm, oracle_ids):
    ids = oracle_ids
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])  # first repeat-free position
    out = greedy(client, max_tokens=24, extra_body={"ignore_eos": True, "stop_token_ids": [ids[k]]})
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == k + 1  # the stop token is counted...
    assert out.choices[0].text == tiny_lm.tokenizer.decode(ids[:k])  # ...but not shown


def test_completion_logprobs_cover_every_token_with_top_alternatives(client):
    out = greedy(client, max_tokens=6, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(1 <= len(top) <= 4 for top in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs_have_top_logprobs_with_bytes(client):
    out = client.chat.completions.create(
        model="tinygpt",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 2
        assert entry.bytes is not None


def test_echo_prepends_the_prompt(client):
    out = greedy(client, max_tokens=4, echo=True)
    plain = greedy(client, max_tokens=4)
    assert out.choices[0].text == PROMPT + plain.choices[0].text


def test_token_id_prompts_and_prompt_lists_give_choices_in_prompt_order(client, tiny_lm):
    ids = tiny_lm.tokenizer.encode(PROMPT, add_special_tokens=True)
    by_ids = greedy(client, prompt=ids, max_tokens=5)
    assert by_ids.choices[0].text == greedy(client, max_tokens=5).choices[0].text
    many = greedy(client, prompt=[ids, [65, 66, 67]], max_tokens=5, n=2)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == many.choices[1].text == by_ids.choices[0].text  # greedy
    assert many.usage.prompt_tokens == len(ids) + 3


def test_models_lists_the_served_model_with_size_and_context(client, tiny_lm):
    models = client.models.list().data
    assert [m.id for m in models] == ["tinygpt"]
    entry = models[0].model_dump()
    assert entry["parameter_count"] == tiny_lm.num_parameters() == 5_838_080
    assert entry["max_model_len"] == 2048
    assert entry["torch_version"]
    assert client.models.retrieve("tinygpt").id == "tinygpt"


def test_usage_reports_prompt_tokens_served_from_the_prefix_cache(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.url("/v1"), api_key="unused")
    prompt = "A shared system prompt long enough to fill a few KV blocks. " * 3  # 180 bytes
    first = client.completions.create(model="tinygpt", prompt=prompt, max_tokens=2)
    again = client.completions.create(model="tinygpt", prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 176  # 11 full blocks of 16
