"""The newer families served end to end: for each family (a row of `FAMILIES`) and each source
(the Hugging Face directory transformers saved, and a GGUF of the same weights and tokenizer
written by tools.synth_model as llama.cpp's converter writes one), a real server on a loopback
port, float32 activations and KV, asked through the `openai` SDK:

- /v1/completions: five prompts in one request, 32 greedy tokens each (EOS ignored): each
  token's text and log-probability are those of transformers' own greedy continuation
  (`generate` on its class, the logprob from its logits; within 1e-3);
- /v1/chat/completions: the conversation rendered by the family's chat-turn format (the
  tokenizer's template; /tokenize gives transformers' own rendering and ids), then 16 greedy
  tokens, again transformers';
- structured output: a `json_schema` response format gives JSON that the schema accepts.

One server per (family, source), every request against it. Where llama.cpp is built (CI has
it), llama-server's greedy tokens on the same GGUF equal transformers' and our server's, for the
families whose tiny files it runs exactly (`LLAMA_CPP_AGREES`).

The engine-level oracles (chunked prefill across recurrent state, preemption, prefix hits,
kernels on and off) are in tests/test_gemma4.py, tests/test_gpt_oss.py and
tests/test_models_hybrid.py; this module checks what the server adds on top.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers: nothing here touches a hub

import functools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
import torch

from models import load_model
from models.hf_tokenizer import load_gguf_tokenizer
from server.openai.logprobs import TokenText
from server.tooling.formats import HARMONY_TOKENS
from tests.helpers.family_models import (
    IDS,
    byte_bpe_tokenizer,
    draw_layer_scalars,
    draw_sinks,
    gemma4_config,
    gguf_tokenizer,
    gpt_oss_config,
)
from tests.helpers.hybrid_configs import lfm2_config, qwen35_config
from tests.helpers.llama_cpp import llama_cpp_tool, llama_server_greedy_each
from tests.helpers.model_files import random_ids, randomize_
from tests.helpers.oracles import hf_greedy, hf_logprobs
from tests.helpers.servers import LiveServer, run_server
from tools import synth_model

# (tiny models: one intra-op thread for transformers here; the servers' engines step on one)
pytestmark = pytest.mark.usefixtures("one_thread")

# -- the families ----------------------------------------------------------------------------------

# Each family's chat-turn format, cut to what a conversation of plain messages uses.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LFM2_CHAT = "{{ bos_token }}" + CHATML  # (LFM2's starts with <|startoftext|>, its bos)
GEMMA4_CHAT = (
    "{{ bos_token }}{% for m in messages %}"
    "<|turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}<turn|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)
# harmony (gpt-oss): an assistant turn's answer in the final channel; a template that names
# tools and channels is what the server takes for harmony (`server.tooling.formats.detect`)
HARMONY_CHAT = (
    "{% if tools %}<|start|>developer<|message|># Tools{% for t in tools %}\n"
    "{{ t['function']['name'] }}{% endfor %}<|end|>{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "<|start|>assistant<|channel|>final<|message|>{{ m['content'] }}<|end|>"
    "{% else %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


@dataclass(frozen=True)
class Family:
    config: Callable[[], Any]  # transformers' config of a tiny model
    gguf_arch: str  # tools.synth_model's architecture (llama.cpp's name)
    chat_template: str
    draw: Callable[[Any, int], None] | None = None  # random draws `randomize_` leaves out
    specials: tuple[str, ...] = ()  # the family's special tokens its template writes
    reasoning: str | None = None  # the reasoning parser its template makes the server take


FAMILIES: dict[str, Family] = {
    "gemma4": Family(gemma4_config, "gemma4", GEMMA4_CHAT, draw_layer_scalars, ("<|turn>", "<turn|>")),
    "gpt-oss": Family(gpt_oss_config, "gpt-oss", HARMONY_CHAT, draw_sinks, HARMONY_TOKENS,
                      "harmony"),
    "lfm2": Family(lfm2_config, "lfm2", LFM2_CHAT),
    "qwen35": Family(qwen35_config, "qwen35", CHATML),
}  # fmt: skip

# The families whose tiny GGUF here llama-server runs to transformers' greedy tokens. (Gemma 4:
# at token 30 of the shortest prompt its top two log-probabilities, 1e-3 apart in transformers
# and ours, come out the other way round in llama.cpp; tests/test_gemma4.py compares it on a
# synthetic file of its own.)
LLAMA_CPP_AGREES = ("gpt-oss", "lfm2", "qwen35")
# The tokens llama.cpp takes for ends of generation by their text (llama-vocab.cpp, its EOG
# list), which its ignore_eos bans.
LLAMA_EOG = ("<|endoftext|>", "<|im_end|>", "<|return|>", "<|call|>", "<turn|>")

N_TOKENS, CHAT_TOKENS = 32, 16
PROMPTS = [random_ids(n, 259, seed=40 + n) for n in (4, 9, 17, 26, 38)]  # (byte tokens)
MESSAGES = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is the theme of the tale?"},
]
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
    "required": ["city", "ok"],
    "additionalProperties": False,
}


def _continuation(
    ref, prompt: list[int], n: int, banned: list[int] | None = None
) -> tuple[list[int], list[float]]:
    """transformers' n greedy tokens after `prompt` (never one of `banned`) and each one's
    log-probability (of the whole distribution, as logprobs report it)."""
    if banned is None:
        tokens = hf_greedy(ref, prompt, n)
    else:
        ref.generation_config.eos_token_id = None
        with torch.inference_mode():
            out = ref.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                               pad_token_id=0, suppress_tokens=banned)  # fmt: skip
        tokens = out[0, len(prompt) :].tolist()
    lps = hf_logprobs(ref, prompt + tokens)[len(prompt) - 1 : -1]
    return tokens, lps.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


@dataclass
class Oracle:
    completions: list[list[int]]  # transformers' greedy tokens of each of PROMPTS
    completion_logprobs: list[list[float]]
    chat_prompt: list[int]  # MESSAGES rendered and tokenized by transformers
    chat: list[int]
    chat_logprobs: list[float]


@dataclass
class LlamaRun:
    banned: list[int]  # llama-server's end-of-generation tokens, which its ignore_eos bans
    want: list[tuple[list[int], list[float]]]  # transformers' greedy of PROMPTS without them
    theirs: list[list[int]]  # llama-server's


class Written:
    """A family's tiny random model in transformers, saved as a Hugging Face directory with its
    tokenizer and written as a GGUF; what transformers and llama-server make of it, computed
    on first use."""

    def __init__(self, name: str, root: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.name = name
        family = FAMILIES[name]
        config = family.config()
        for key, value in IDS.items():
            setattr(config, key, value)
        seed = len(name)
        torch.manual_seed(seed)
        self.ref = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        randomize_(self.ref, seed)
        if family.draw is not None:
            family.draw(self.ref, seed)
        self.hf_dir = root / "hf"
        self.ref.save_pretrained(self.hf_dir)
        self.tokenizer = byte_bpe_tokenizer(family.chat_template, family.specials)
        self.tokenizer.save_pretrained(self.hf_dir)
        state = {k: v.detach() for k, v in self.ref.state_dict().items()}
        if config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        self.gguf = synth_model.write_gguf(
            root / f"{name}.gguf", family.gguf_arch, config.to_dict(), state,
            gguf_tokenizer(self.tokenizer),
        )  # fmt: skip
        # The server reads a GGUF's tokenizer as transformers converts it, cached by content; a
        # server converts it in a child process on first use, which costs that process's
        # imports of torch and transformers (5-10 s on two busy cores) for a conversion of
        # 0.1 s: converted here by the same function, in this process that has them imported.
        load_gguf_tokenizer(self.gguf)

    @functools.cached_property
    def oracle(self) -> Oracle:
        runs = [_continuation(self.ref, p, N_TOKENS) for p in PROMPTS]
        chat_prompt = self.tokenizer.apply_chat_template(
            MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        chat, chat_lps = _continuation(self.ref, list(chat_prompt), CHAT_TOKENS)
        return Oracle([r[0] for r in runs], [r[1] for r in runs], list(chat_prompt), chat, chat_lps)

    @functools.cached_property
    def llama_run(self) -> LlamaRun:
        """llama-server on the GGUF (float32 K/V), its end-of-generation tokens banned."""
        vocab = self.tokenizer.get_vocab()
        banned = [vocab[t] for t in LLAMA_EOG if t in vocab]
        want = [_continuation(self.ref, p, N_TOKENS, banned) for p in PROMPTS]
        # (one thread: on two busy cores its spinning threads take seconds for what takes 0.3 s)
        theirs = llama_server_greedy_each(self.gguf, PROMPTS, N_TOKENS, threads=1, cache_type="f32")
        return LlamaRun(banned, want, theirs)


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Iterator[Callable[[str], Written]]:
    """Each family's files, written once (both of its servers use them), in a model cache of
    this module's own."""
    done: dict[str, Written] = {}

    def get(name: str) -> Written:
        if name not in done:
            done[name] = Written(name, tmp_path_factory.mktemp(name))
        return done[name]

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CBSERVE_MODEL_DIR", str(tmp_path_factory.mktemp("model-cache")))
        yield get


@dataclass
class Served:
    files: Written
    live: LiveServer
    client: openai.OpenAI
    model: str
    tokens: TokenText  # each token's text as the server shows it in logprobs


# One parametrization, family by family (a fixture per family and one per source would have
# pytest write a family's files twice to keep its sources together).
CASES = [(name, source) for name in FAMILIES for source in ("hf", "gguf")]


@pytest.fixture(scope="module", params=CASES, ids=[f"{n}-{s}" for n, s in CASES])
def served(request, written) -> Iterator[Served]:
    name, source = request.param
    files = written(name)
    path = files.hf_dir if source == "hf" else files.gguf
    lm = load_model(str(path), activations="float32", kv_cache_dtype="float32")
    with run_server(lm, default_sampling_params={}) as live:
        client = openai.OpenAI(base_url=live.v1, api_key="unused", max_retries=0, timeout=60)
        yield Served(files, live, client, lm.name, TokenText(lm.tokenizer))


def _check_tokens(served: Served, got: list[str], got_lps: list[float], want, want_lps) -> None:
    """The server's tokens (as its logprobs show them) are transformers' `want`, with its
    log-probabilities: the texts alone could coincide (specials, unused ids show as "")."""
    assert got == [served.tokens(t)[0] for t in want]
    diff = max(abs(a - b) for a, b in zip(got_lps, want_lps, strict=True))
    assert diff <= 1e-3, f"max |logprob difference| {diff:.2e}"


# -- the tests -------------------------------------------------------------------------------------


def test_completions_are_transformers_greedy_tokens(served):
    """Five prompts of token ids in one request, batched in the engine: 32 greedy tokens each."""
    oracle = served.files.oracle
    out = served.client.completions.create(
        model=served.model, prompt=PROMPTS, max_tokens=N_TOKENS, temperature=0, logprobs=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert len(out.choices) == len(PROMPTS)
    for choice in out.choices:
        i = choice.index
        assert choice.finish_reason == "length"
        lp = choice.logprobs
        _check_tokens(
            served,
            lp.tokens,
            lp.token_logprobs,
            oracle.completions[i],
            oracle.completion_logprobs[i],
        )
    assert out.usage.completion_tokens == N_TOKENS * len(PROMPTS)
    assert out.usage.prompt_tokens == sum(map(len, PROMPTS))


def test_chat_renders_the_family_template_and_is_transformers_greedy(served):
    """The conversation as transformers renders and tokenizes it (the template and tokenizer
    the server read from the directory, or from the GGUF's metadata), then 16 greedy tokens."""
    import httpx

    oracle = served.files.oracle
    body = {"model": served.model, "messages": MESSAGES, "add_generation_prompt": True}
    r = httpx.post(served.live.url("/tokenize"), json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == oracle.chat_prompt
    out = served.client.chat.completions.create(
        model=served.model, messages=MESSAGES, max_tokens=CHAT_TOKENS, temperature=0,
        logprobs=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    choice = out.choices[0]
    assert choice.finish_reason == "length"
    # (a random model writes no harmony channels: all of it is the answer)
    assert served.live.app.state.serving.reasoning_parser == FAMILIES[served.files.name].reasoning
    assert choice.message.content == served.files.tokenizer.decode(
        oracle.chat, skip_special_tokens=True
    )
    content = choice.logprobs.content
    _check_tokens(
        served, [c.token for c in content], [c.logprob for c in content], oracle.chat,
        oracle.chat_logprobs,
    )  # fmt: skip
    assert out.usage.prompt_tokens == len(oracle.chat_prompt)
    assert out.usage.completion_tokens == CHAT_TOKENS


def test_structured_output_is_json_the_schema_accepts(served):
    out = served.client.chat.completions.create(
        model=served.model, messages=MESSAGES, max_tokens=64, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}},
    )  # fmt: skip
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


@pytest.mark.slow  # (starts llama-server)
def test_llama_server_on_the_gguf_gives_our_greedy_tokens(served):
    """llama-server (skipped where it is not built) runs the GGUF to transformers' 32 greedy
    tokens of each prompt, and so does our server (from either source), each with
    llama-server's end-of-generation tokens banned (what its ignore_eos does; ours: a logit
    bias of -100)."""
    llama_cpp_tool("llama-server")
    if served.files.name not in LLAMA_CPP_AGREES:
        pytest.skip(f"llama.cpp is not compared on the tiny {served.files.name} file here")
    llama_run = served.files.llama_run
    assert llama_run.theirs == [w[0] for w in llama_run.want]
    out = served.client.completions.create(
        model=served.model, prompt=PROMPTS, max_tokens=N_TOKENS, temperature=0, logprobs=0,
        logit_bias={str(t): -100 for t in llama_run.banned}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    for choice in out.choices:
        lp = choice.logprobs
        _check_tokens(served, lp.tokens, lp.token_logprobs, *llama_run.want[choice.index])
