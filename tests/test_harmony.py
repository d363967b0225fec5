"""gpt-oss's harmony format on the OpenAI surfaces: the analysis channel as reasoning, the final
channel as content, commentary calls to `functions.NAME` as tool calls.

The tokenizer: no o200k_harmony vocabulary is available offline (tiktoken and openai-harmony
download it), so the tests use the byte-level BPE the other model tests use, with harmony's
special tokens added as special tokens (each one id, as in o200k_harmony, where they are 200002
to 200012; nothing here depends on their values). Token streams are that tokenizer's encoding of
harmony text, decoded by the server's own detokenizer and `Choice` (its stop-token handling
included).

End to end: a tiny random gpt-oss (transformers' class, as tests/test_gpt_oss.py writes it)
with that tokenizer and the published chat template (llama.cpp's copy; skipped where absent),
served by a real uvicorn server and called with the `openai` SDK. Random weights say nothing
sensible, so the harmony shape is forced by a grammar (the tool grammar of `tool_choice:
"required"`, or a request's own grammar with harmony's tokens): what the tests prove is that
whatever tokens the model generates in that shape come back split correctly (the generated
tokens themselves, read from logprobs, are the oracle), streamed and whole alike, with finish
reasons, the Responses API's items and multi-turn rendering; not that a model chooses well.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import re
from pathlib import Path

import pytest

from engine import StepOutput
from models.hf_tokenizer import HFTokenizer, end_token_ids
from server.generation.text import Choice
from server.tooling.formats import HARMONY_TOKENS, detect
from server.tooling.harmony import special_ids
from server.tooling.output import ChoiceParsers, finish_reason

TEMPLATE = Path(
    "/work/peers/src/llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates/"
    "openai-gpt-oss-120b.jinja"
)
SPECIALS = ["<|startoftext|>", "<|endoftext|>", *HARMONY_TOKENS]


def harmony_hf_tokenizer(chat_template: str | None = None):
    """Byte-level BPE (256 byte ids) plus harmony's special tokens, in transformers form."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {t: i for i, t in enumerate(bytes_to_unicode().values())}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token="<|startoftext|>",
        eos_token="<|return|>",
        pad_token="<|endoftext|>",
        chat_template=chat_template,
    )


@pytest.fixture(scope="module")
def tok() -> HFTokenizer:
    hf = harmony_hf_tokenizer()
    return HFTokenizer(hf, end_token_ids(hf, [hf.convert_tokens_to_ids("<|return|>")]))


def ids_of(tok: HFTokenizer, text: str) -> list[int]:
    return tok.encode(text)


def run_tokens(tok: HFTokenizer, ids: list[int], tools: bool, step: int = 1):
    """The ids generated `step` at a time through a server `Choice` (its detokenizer keeping
    harmony's tokens, its stop ids the tokenizer's ends) and a chat choice's parsers: the
    joined deltas, the calls, the finish reason, and the whole text parsed at once."""
    from server.tooling.plan import ToolPlan

    plan = None
    if tools:
        fn = {"name": "get_weather", "parameters": {"type": "object"}}
        plan = ToolPlan(
            ({"type": "function", "function": fn},), "auto", None, True, "harmony", False
        )
    stop = frozenset(tok.eos_token_ids)
    c = Choice(index=0, request_id="r", prompt_index=0, tokenizer=tok, prompt_ids=[1, 2],
               stops=(), stop_ids=stop, kept_ids=special_ids(tok))  # fmt: skip
    p = ChoiceParsers(plan, "harmony")
    got = {"reasoning": "", "content": "", "calls": []}
    for k in range(0, len(ids), step):
        chunk = ids[k : k + step]
        last = k + step >= len(ids)
        reason = ("stop" if chunk[-1] in stop else "length") if last else None
        c.update(StepOutput(request_id="r", token_ids=chunk, finished=last, finish_reason=reason))
        r, t, calls = p.feed(c.take_delta(), c.finished)
        got["reasoning"] += r
        got["content"] += t
        got["calls"] += calls
    whole = ChoiceParsers(plan, "harmony")
    r, t, _ = whole.feed(c.text, final=True)
    assert (r, t) == (got["reasoning"], got["content"]), "streamed and whole disagree"
    assert [x["function"] for x in whole.calls] == [x["function"] for x in p.calls]
    return got, p, finish_reason(c.finish_reason, p.made_calls), c.text


def joined_args(deltas: list[dict]) -> dict[int, str]:
    out: dict[int, str] = {}
    for d in deltas:
        out[d["index"]] = out.get(d["index"], "") + d["function"].get("arguments", "")
    return out


# -- the vocabulary: which tokens end a turn ----------------------------------------------------


def test_harmony_turns_end_on_return_and_call_not_on_end(tok):
    ids = {t: tok.hf.convert_tokens_to_ids(t) for t in SPECIALS}
    assert set(tok.eos_token_ids) >= {ids["<|return|>"], ids["<|call|>"]}
    assert ids["<|end|>"] not in tok.eos_token_ids  # it closes the reasoning message, not the turn
    assert special_ids(tok) == frozenset(ids[t] for t in HARMONY_TOKENS)
    # A vocabulary with <|end|> but not harmony's turn ends keeps it as an end (Phi-3's).
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(vocab={"a": 0}, merges=[]))
    tk.add_special_tokens(["<|end|>"])
    phi = PreTrainedTokenizerFast(tokenizer_object=tk)
    assert end_token_ids(phi, []) == (1,)


def test_a_gguf_vocabulary_with_harmonys_tokens(tmp_path, monkeypatch):
    """A gpt-oss GGUF (tools.synth_model) whose vocabulary holds harmony's tokens as control
    tokens, as converted files do, declaring <|return|> its EOS and <|end|> its EOT: the
    loaded tokenizer ends turns on <|return|> and <|call|>, not on <|end|>, and keeps each
    marker one id whose text decodes when asked."""
    from gguf import GGUFValueType as T
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from models import load_model
    from tests.helpers.family_models import VOCAB, write_gpt_oss
    from tools import synth_model

    monkeypatch.setenv("CBSERVE_MODEL_DIR", str(tmp_path / "cache"))
    ref = write_gpt_oss(tmp_path / "hf")
    tokens = [*bytes_to_unicode().values(), "Ġt", *SPECIALS]
    unused = VOCAB - len(tokens)
    types = [1] * 257 + [3] * len(SPECIALS) + [5] * unused
    tokens += [f"<unused{i}>" for i in range(unused)]
    ids = {t: tokens.index(t) for t in SPECIALS}
    fields = {
        "tokenizer.ggml.model": ("gpt2", T.STRING, None),
        "tokenizer.ggml.pre": ("default", T.STRING, None),
        "tokenizer.ggml.tokens": (tokens, T.ARRAY, T.STRING),
        "tokenizer.ggml.token_type": (types, T.ARRAY, T.INT32),
        "tokenizer.ggml.merges": (["Ġ t"], T.ARRAY, T.STRING),
        "tokenizer.ggml.bos_token_id": (ids["<|startoftext|>"], T.UINT32, None),
        "tokenizer.ggml.eos_token_id": (ids["<|return|>"], T.UINT32, None),
        "tokenizer.ggml.eot_token_id": (ids["<|end|>"], T.UINT32, None),
    }
    path = synth_model.write_gguf(tmp_path / "harmony.gguf", "gpt-oss", ref.config.to_dict(),
                                  ref.state_dict(), synth_model.Tokenizer(fields, "byte-level"),
                                  "F32")  # fmt: skip
    t = load_model(str(path), use_kernels=False).tokenizer
    assert {ids["<|return|>"], ids["<|call|>"]} <= set(t.eos_token_ids)
    assert ids["<|end|>"] not in t.eos_token_ids
    assert special_ids(t) == frozenset(ids[m] for m in HARMONY_TOKENS)
    text = "<|channel|>final<|message|>hi"
    assert t.decode(t.encode(text), skip_special_tokens=False) == text
    assert t.decode(t.encode(text)) == "finalhi"


# -- the parser on token streams -----------------------------------------------------------------

REASONING_THEN_ANSWER = (
    "<|channel|>analysis<|message|>The user wants 2+2. Easy: 4.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>2 + 2 = **4** <é>!<|return|>"
)


@pytest.mark.parametrize("step", [1, 3, 100])
def test_analysis_is_reasoning_and_final_is_content(tok, step):
    got, p, reason, text = run_tokens(tok, ids_of(tok, REASONING_THEN_ANSWER), False, step)
    assert got["reasoning"] == "The user wants 2+2. Easy: 4."
    assert got["content"] == "2 + 2 = **4** <é>!"
    assert got["calls"] == [] and reason == "stop"
    assert "<|channel|>" in text and "<|return|>" not in text  # kept; the stop token cut


CALL = (
    "<|channel|>analysis<|message|>Need weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris", "unit": "°C"}<|call|>'
)
# The template's own spelling: the recipient in the header before the channel.
CALL_RECIPIENT_FIRST = (
    ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
)


@pytest.mark.parametrize("step", [1, 4, 100])
def test_a_commentary_message_to_a_function_is_a_tool_call(tok, step):
    got, p, reason, _ = run_tokens(tok, ids_of(tok, CALL), True, step)
    assert got["reasoning"] == "Need weather."
    assert got["content"] == ""
    assert reason == "tool_calls"
    [call] = p.calls
    assert call["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Paris", "unit": "°C"}',
    }
    first = got["calls"][0]
    assert first["id"] == call["id"] and first["function"]["name"] == "get_weather"
    assert joined_args(got["calls"]) == {0: call["function"]["arguments"]}
    if step == 1:  # the arguments streamed in fragments, not at the end
        assert len([d for d in got["calls"] if d["function"].get("arguments")]) > 3


def test_the_recipient_may_come_before_the_channel(tok):
    got, p, reason, _ = run_tokens(tok, ids_of(tok, CALL_RECIPIENT_FIRST), True)
    assert [c["function"] for c in p.calls] == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    ]
    assert got["content"] == got["reasoning"] == "" and reason == "tool_calls"


def test_a_preamble_is_content_and_without_tools_a_call_is_not_one(tok):
    text = (
        "<|channel|>commentary<|message|>Checking the weather.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Oslo"}<|call|>'
    )
    got, p, reason, _ = run_tokens(tok, ids_of(tok, text), True)
    assert got["content"] == "Checking the weather." and len(p.calls) == 1
    got, p, reason, _ = run_tokens(tok, ids_of(tok, text), False)
    assert p.calls == [] and reason == "stop"
    assert got["content"] == "Checking the weather."
    assert got["reasoning"] == '{"city": "Oslo"}'  # the model's own action: not the answer


def test_cut_off_outputs_leak_no_markers(tok):
    """max_tokens anywhere in the stream: no special token text in content or reasoning, a
    cut header is dropped, a cut call keeps what its arguments had."""
    ids = ids_of(tok, REASONING_THEN_ANSWER)[:-1]
    for n in range(1, len(ids) + 1):
        got, _, reason, _ = run_tokens(tok, ids[:n], False)
        assert reason == "length"
        for part in (got["reasoning"], got["content"]):
            assert not any(m in part for m in HARMONY_TOKENS), (n, got)
    got, p, reason, _ = run_tokens(tok, ids_of(tok, CALL)[:-3], True)
    assert (
        reason == "length"
        and p.calls[0]["function"]["arguments"] == '{"city": "Paris", "unit": "°C'
    )


def test_text_without_harmony_is_content(tok):
    got, _, _, _ = run_tokens(tok, ids_of(tok, "plain words, no channels"), False)
    assert got == {"reasoning": "", "content": "plain words, no channels", "calls": []}


# -- the format row: detection, grammar, template handling --------------------------------------


def published_template() -> str:
    if not TEMPLATE.is_file():
        pytest.skip(f"no harmony template at {TEMPLATE}")
    return TEMPLATE.read_text()


def test_the_published_template_is_detected_as_harmony():
    from server.tooling.formats import implied_reasoning

    fmt, generic = detect(published_template())
    assert fmt.name == "harmony" and not generic
    assert implied_reasoning("auto", published_template()) == "harmony"
    assert implied_reasoning("auto", "{{ messages }} {{ tools }}") is None


def test_parallel_calls_render_one_per_turn_each_with_its_result(tok):
    """An assistant message with two calls and their results (in the other order): the
    template renders one call per message and names a result by the call before it, so the
    calls are split and each result follows its call; the reasoning sent back as
    reasoning_content is the analysis before the first call."""
    from server.openai.protocol import ChatCompletionRequest
    from server.tooling.chat_template import ChatTemplate

    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"role": "assistant", "content": None, "reasoning_content": "Two cities.", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "b", "content": "12:00"},
        {"role": "tool", "tool_call_id": "a", "content": "21C"},
    ]})  # fmt: skip
    hf = harmony_hf_tokenizer(published_template())
    text = ChatTemplate(HFTokenizer(hf, (0,))).render(req.messages, True)
    want = (
        "<|start|>assistant<|channel|>analysis<|message|>Two cities.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        '{"city": "Paris"}<|call|>'
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
        '"21C"<|end|>'
        "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>"
        '{"city": "Oslo"}<|call|>'
        "<|start|>functions.get_time to=assistant<|channel|>commentary<|message|>"
        '"12:00"<|end|>'
        "<|start|>assistant"
    )
    assert text.endswith(want), text


def test_a_responses_reasoning_item_renders_as_the_analysis_before_its_call():
    """Responses input items as the Agents SDK sends output back: the reasoning item becomes
    the next assistant turn's reasoning, rendered (by the published template) as the analysis
    before the call it led to."""
    from server.openai.responses import ResponsesRequest, to_chat
    from server.tooling.chat_template import ChatTemplate

    req = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Call the tool."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "21C"},
    ]})  # fmt: skip
    chat = to_chat(req)
    text = ChatTemplate(HFTokenizer(harmony_hf_tokenizer(published_template()), (0,))).render(
        chat.messages, True
    )
    assert text.endswith(
        "<|start|>assistant<|channel|>analysis<|message|>Call the tool.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        '{"city": "Paris"}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"21C"<|end|>'
        "<|start|>assistant"
    ), text


def test_the_required_grammar_is_a_harmony_call_of_special_tokens(tok):
    """tool_choice "required": a grammar whose markers are the special tokens themselves, that
    llguidance compiles for the tokenizer, accepts a call and refuses the markers' spelling."""
    import llguidance

    from engine.grammar import Vocabulary, vocabulary
    from server.tooling.plan import ToolPlan

    fn = {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}  # fmt: skip
    plan = ToolPlan(
        ({"type": "function", "function": fn},), "required", None, True, "harmony", False
    )
    assert "<|channel|>" in plan.grammar and '"<|channel|>' not in plan.grammar
    assert isinstance(vocabulary(tok, tok.vocab_size), Vocabulary)
    import llguidance.hf

    ll = llguidance.hf.from_tokenizer(tok.hf, n_vocab=tok.vocab_size)

    def accepts(ids: list[int]) -> bool:
        m = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_lark(plan.grammar))
        return all(m.consume_token(i) for i in ids) and m.is_accepting()

    call = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    assert accepts(ids_of(tok, call + '{"city": "Rome"}<|call|>'))
    spelled = tok.hf.encode("<|channel|>", split_special_tokens=True)
    assert len(spelled) > 1 and not accepts(spelled)


# -- end to end: a real server, the openai SDK ----------------------------------------------------


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    from models import load_model
    from tests.helpers.family_models import gpt_oss_config
    from tests.helpers.model_files import write_hf_checkpoint
    from tests.helpers.servers import run_server

    template = published_template()
    path = tmp_path_factory.mktemp("gpt_oss_harmony")
    hf = harmony_hf_tokenizer(template)
    config = gpt_oss_config()
    config.eos_token_id = hf.convert_tokens_to_ids("<|return|>")
    config.pad_token_id = hf.pad_token_id
    config.bos_token_id = hf.bos_token_id
    write_hf_checkpoint(path, config, seed=3)
    hf.save_pretrained(path)  # (over the default tokenizer)
    lm = load_model(str(path), use_kernels=False)
    with run_server(lm, default_sampling_params={}) as server:
        yield server


@pytest.fixture
def client(live):
    import openai

    return openai.OpenAI(base_url=live.v1, api_key="x", max_retries=0, timeout=60)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 8}},
                "required": ["city"],
            },
        },
    }
]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
# Harmony's shape with bounded free text: an analysis message, then the final answer.
SHAPE = (
    'start: <|channel|> "analysis" <|message|> WORDS <|end|> <|start|> "assistant" '
    '<|channel|> "final" <|message|> WORDS <|return|>\n'
    "WORDS: /[a-z][a-z ]{2,12}/\n"
)


def raw_text(logprobs) -> str:
    """The generated tokens' own text (the oracle of the split): logprobs keep special tokens."""
    return "".join(t.token for t in logprobs.content)


def test_chat_reasoning_and_answer_whole_and_streamed(client):
    served = client.models.list().data[0].id
    kw = dict(model=served, messages=MESSAGES, max_tokens=60, temperature=0, logprobs=True)
    r = client.chat.completions.create(extra_body={"guided_grammar": SHAPE}, **kw)
    choice = r.choices[0]
    raw = raw_text(choice.logprobs)
    m = re.fullmatch(
        r"<\|channel\|>analysis<\|message\|>(.*)<\|end\|><\|start\|>assistant"
        r"<\|channel\|>final<\|message\|>(.*)<\|return\|>",
        raw,
        re.S,
    )
    assert m, raw
    msg = choice.message
    assert msg.reasoning_content == m.group(1)
    assert msg.content == m.group(2)
    assert not msg.tool_calls and choice.finish_reason == "stop"
    reasoning, content, reasons, pieces = "", "", [], 0
    for chunk in client.chat.completions.create(
        extra_body={"guided_grammar": SHAPE}, stream=True, **kw
    ):
        for c in chunk.choices:
            d = c.delta
            r = getattr(d, "reasoning_content", None) or ""
            assert not (r and content)  # the reasoning comes first, whole
            reasoning += r
            content += d.content or ""
            pieces += bool(r)
            reasons.append(c.finish_reason)
            for part in (r, d.content or ""):
                assert "<|" not in part
    assert (reasoning, content) == (m.group(1), m.group(2))
    assert pieces > 1  # streamed as it came, not at the end
    assert reasons[-1] == "stop"


def test_chat_tool_call_whole_and_streamed(client):
    served = client.models.list().data[0].id
    kw = dict(model=served, messages=MESSAGES, tools=TOOLS, tool_choice="required",
              max_tokens=120, temperature=0)  # fmt: skip
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert set(args) == {"city"} and isinstance(args["city"], str)
    assert not choice.message.content
    for field in (choice.message.content or "", call.function.arguments):
        assert "<|" not in field
    deltas, reasons = [], []
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            deltas += c.delta.tool_calls or []
            reasons.append(c.finish_reason)
            assert not c.delta.content
    assert reasons[-1] == "tool_calls"
    assert deltas[0].function.name == "get_weather" and deltas[0].id
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments

    # The next turn: the call and its result rendered back into harmony, accepted by the
    # template, and a new answer in harmony's shape.
    follow = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
    ]
    r = client.chat.completions.create(model=served, messages=follow, tools=TOOLS, max_tokens=60,
                                       temperature=0, extra_body={"guided_grammar": SHAPE})  # fmt: skip
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content
    assert r.usage.prompt_tokens > 0


def test_responses_api_function_call_and_reasoning_sent_back(client):
    served = client.models.list().data[0].id
    tools = [{"type": "function", **TOOLS[0]["function"]}]
    r = client.responses.create(model=served, input="Weather in Paris?", tools=tools,
                                tool_choice="required", max_output_tokens=120, temperature=0)  # fmt: skip
    assert r.status == "completed"
    [item] = r.output
    assert item.type == "function_call" and item.name == "get_weather"
    assert set(json.loads(item.arguments)) == {"city"}
    events = list(
        client.responses.create(
            model=served,
            input="Weather in Paris?",
            tools=tools,
            tool_choice="required",
            max_output_tokens=120,
            temperature=0,
            stream=True,
        )  # fmt: skip
    )
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds
    done = events[-1]
    assert done.type == "response.completed"
    assert done.response.output[0].arguments == item.arguments
    # A conversation carried as items, a reasoning item among them (as the Agents SDK sends
    # output back): accepted, the reasoning rendered as the analysis before the call.
    inputs = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Call the tool."}]},
        {"type": "function_call", "call_id": item.call_id, "name": item.name,
         "arguments": item.arguments},
        {"type": "function_call_output", "call_id": item.call_id, "output": '{"temp": 21}'},
    ]  # fmt: skip
    r = client.responses.create(model=served, input=inputs, tools=tools, max_output_tokens=8,
                                temperature=0)  # fmt: skip
    assert r.status in ("completed", "incomplete")
