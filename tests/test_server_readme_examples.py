"""The README's curl and `openai` SDK examples, run verbatim against a live server.

The snippets below are the README's text (the README copies them from here). The only change a
test makes is the address: the README's http://127.0.0.1:8000 becomes the test server's free port.
The fast tests serve TinyGPT under the default model's name, so the snippets run unchanged; the
slow one runs them against the real SmolLM2-135M-Instruct when its file has been fetched.
"""

from __future__ import annotations

import contextlib
import io
import json
import shlex
import subprocess
import sys

import httpx
import pytest

from tests.helpers.servers import LiveServer, run_server, sse_events

README_URL = "http://127.0.0.1:8000"

README_CURL_CHAT = """\
curl http://127.0.0.1:8000/v1/chat/completions \\
  -H "Content-Type: application/json" \\
  -d '{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "What color is the sky on a clear day?"}], "max_tokens": 32}'
"""

README_CURL_STREAM = """\
curl -N http://127.0.0.1:8000/v1/completions \\
  -H "Content-Type: application/json" \\
  -d '{"model": "smollm2-135m-instruct", "prompt": "The capital of France is", "max_tokens": 16, "stream": true}'
"""

README_SDK = """\
from openai import OpenAI

client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")

reply = client.chat.completions.create(
    model="smollm2-135m-instruct",
    messages=[{"role": "user", "content": "Explain what a CPU does in one sentence."}],
    max_tokens=64,
)
print(reply.choices[0].message.content)

stream = client.chat.completions.create(
    model="smollm2-135m-instruct",
    messages=[{"role": "user", "content": "Name three fruits."}],
    max_tokens=32,
    stream=True,
)
for chunk in stream:
    print(chunk.choices[0].delta.content or "", end="", flush=True)
print()
"""

README_TOOLS = """\
from openai import OpenAI

client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
weather = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 32}},
            "required": ["city"],
        },
    },
}
messages = [{"role": "user", "content": "What is the weather in Paris?"}]
reply = client.chat.completions.create(
    model="smollm2-135m-instruct",
    messages=messages,
    tools=[weather],
    tool_choice="required",
    parallel_tool_calls=False,
    max_tokens=200,
)
call = reply.choices[0].message.tool_calls[0]
print(call.function.name, call.function.arguments)  # get_weather {"city": "Paris"}
messages += [
    reply.choices[0].message,
    {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees."},
]
final = client.chat.completions.create(
    model="smollm2-135m-instruct", messages=messages, tools=[weather], max_tokens=64
)
print(final.choices[0].message.content or final.choices[0].message.tool_calls)
"""

README_RESPONSES = """\
from openai import OpenAI

client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
response = client.responses.create(
    model="smollm2-135m-instruct",
    instructions="Answer in one sentence.",
    input="What does a CPU do?",
    max_output_tokens=64,
)
print(response.output_text)
"""


@pytest.fixture(scope="module")
def named_server(tiny_lm):
    """TinyGPT answering to the default model's name, so the snippets need no edits."""
    with run_server(tiny_lm, served_model_names=("smollm2-135m-instruct",)) as live:
        yield live


def run_curl(live: LiveServer, command: str) -> str:
    assert README_URL in command
    done = subprocess.run(
        ["bash", "-c", command.replace(README_URL, live.base_url)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return done.stdout


README_EMBEDDINGS = """\
from openai import OpenAI

client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")

vectors = client.embeddings.create(
    model="smollm2-135m-instruct",
    input=["The cat sat on the mat.", "A kitten rested on the rug."],
)
print(len(vectors.data), len(vectors.data[0].embedding))  # 2 576

scored = client.completions.create(
    model="smollm2-135m-instruct",
    prompt="The capital of France is Paris",
    echo=True,
    max_tokens=0,
    logprobs=1,
)
print(sum(scored.choices[0].logprobs.token_logprobs[1:]))  # the prompt's log-likelihood
"""


def run_sdk(live: LiveServer, snippet: str = README_SDK) -> str:
    assert README_URL in snippet
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(snippet.replace(README_URL, live.base_url), {})
    return out.getvalue()


def check_curl_chat(stdout: str) -> None:
    body = json.loads(stdout)
    assert body["model"] == "smollm2-135m-instruct"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    assert 1 <= body["usage"]["completion_tokens"] <= 32


def check_curl_stream(stdout: str) -> str:
    payloads = sse_events(stdout)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    return "".join(c["choices"][0]["text"] for c in chunks)


def test_readme_curl_chat_example(named_server):
    check_curl_chat(run_curl(named_server, README_CURL_CHAT))


def test_readme_curl_streaming_example(named_server):
    check_curl_stream(run_curl(named_server, README_CURL_STREAM))


def test_readme_openai_sdk_example(named_server):
    printed = run_sdk(named_server)
    assert printed.endswith("\n") and printed.count("\n") >= 2


def test_readme_tool_call_example(named_server):
    # TinyGPT's city is random text held to the schema by the grammar; it may be cut by
    # max_tokens (JSON escapes of random bytes are long), so only the call's shape is checked
    # here: the slow test checks SmolLM2's whole call.
    first_line = run_sdk(named_server, README_TOOLS).split("\n")[0]  # not splitlines: U+0085
    name, arguments = first_line.split(" ", 1)
    assert name == "get_weather" and arguments.startswith('{"city": "')


def test_readme_responses_example(named_server):
    assert run_sdk(named_server, README_RESPONSES)


def test_readme_embeddings_and_prompt_logprobs_example(named_server):
    sizes, loglikelihood = run_sdk(named_server, README_EMBEDDINGS).splitlines()
    width = named_server.engine.model.config.hidden_size
    assert sizes == f"2 {width}"
    assert float(loglikelihood) < 0


README_CLIENT = '.venv/bin/python -m clients "Give me one tip for staying healthy."'


def looks_english(text: str) -> bool:
    """Loose, for sampled text: mostly ASCII, and common English words among the words. At
    temperature 1.0 SmolLM2 fails this often ("LifeAdogleyby: CPU'sa life ofprocess...")."""
    words = text.lower().split()
    common = {"the", "a", "is", "and", "of", "to", "in", "that", "it", "for", "are", "your"}
    ascii_share = sum(c.isascii() for c in text) / max(len(text), 1)
    return ascii_share > 0.95 and len(words) >= 3 and any(w.strip(".,:") in common for w in words)


@pytest.mark.slow
def test_readme_examples_with_the_real_smollm2_model(smollm2_lm):
    # Sampled with the model's defaults (temperature 0.2, top_p 0.9): none of the snippets sets a
    # temperature, so each answer may differ, and each must still read as English.
    with run_server(smollm2_lm, engine_options={"kv_cache_memory_gib": 0.1}) as live:
        models = httpx.get(live.url("/v1/models"), timeout=10).json()["data"][0]
        assert models["default_sampling_params"] == {"temperature": 0.2, "top_p": 0.9}
        body = run_curl(live, README_CURL_CHAT)
        check_curl_chat(body)
        assert looks_english(json.loads(body)["choices"][0]["message"]["content"])
        streamed = check_curl_stream(run_curl(live, README_CURL_STREAM))
        assert streamed.strip()  # a real model says something
        printed = run_sdk(live)
        assert looks_english(printed), printed
        name, arguments = run_sdk(live, README_TOOLS).split("\n")[0].split(" ", 1)
        assert name == "get_weather" and "Paris" in json.loads(arguments)["city"], arguments
        assert looks_english(run_sdk(live, README_RESPONSES))
        command = README_CLIENT.replace(".venv/bin/python", sys.executable)
        answer = subprocess.run(
            [*shlex.split(command), "--base-url", live.base_url, "--max-tokens", "64"],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout
        assert looks_english(answer), answer


def test_readme_shows_exactly_these_snippets():
    # The snippets above are what the README shows: if either side changes, this fails.
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    snippets = (README_CURL_CHAT, README_CURL_STREAM, README_SDK, README_CLIENT)
    for snippet in (*snippets, README_TOOLS, README_RESPONSES, README_EMBEDDINGS):
        assert snippet in readme
