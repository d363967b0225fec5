"""Server options on live servers: several API keys (--api-key repeated,
--api-key-file), CORS off by default and on for --allowed-origins, --chat-template with the
request's tools and chat_template_kwargs reaching the template, and --reasoning-parser."""

from __future__ import annotations

import httpx
import jinja2.sandbox
import openai
import pytest

from server.cli import build_parser
from server.http.app import ServerSettings
from server.http.options import settings_fields
from server.tooling.chat_template import load_chat_template
from tests.helpers.servers import run_server

# A template that renders tools natively (so not generic mode) and a template kwarg.
TEMPLATE = (
    "{% if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if greeting is defined %}{{ greeting }}{% endif %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TOOL = {
    "type": "function",
    "function": {
        "name": "f",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["a"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "hi"}]


def test_api_keys_from_repeated_flags_and_a_file(tmp_path, monkeypatch):
    monkeypatch.delenv("CBSERVE_API_KEY", raising=False)
    keys = tmp_path / "keys"
    keys.write_text("# team keys\nk-file-1\n\nk-file-2\n")
    args = build_parser().parse_args(
        ["--api-key", "k1", "--api-key", "k2", "--api-key-file", str(keys)]
    )
    assert settings_fields(args)["api_keys"] == ("k1", "k2", "k-file-1", "k-file-2")


def test_every_configured_key_is_accepted_and_others_are_401(tiny_lm):
    settings = ServerSettings(api_keys=("alpha", "beta"))
    with run_server(tiny_lm, settings=settings) as live:
        for key in ("alpha", "beta"):
            client = openai.OpenAI(base_url=live.v1, api_key=key, max_retries=0)
            assert client.models.list().data
        r = httpx.get(live.url("/v1/models"), headers={"Authorization": "Bearer gamma"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def preflight(live, origin: str) -> httpx.Response:
    return httpx.options(
        live.url("/v1/chat/completions"),
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )


def test_cors_is_off_by_default(server):
    r = preflight(server, "https://app.example")
    assert "access-control-allow-origin" not in r.headers


def test_allowed_origins_get_cors_headers_before_the_key_check(tiny_lm):
    settings = ServerSettings(api_key="k", allowed_origins=("https://app.example",))
    with run_server(tiny_lm, settings=settings) as live:
        r = preflight(live, "https://app.example")
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        assert "access-control-allow-origin" not in preflight(live, "https://evil.example").headers
        r = httpx.get(
            live.url("/v1/models"),
            headers={"Origin": "https://app.example", "Authorization": "Bearer k"},
        )
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "https://app.example"


def test_chat_template_flag_takes_a_file_or_the_text(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE
    assert load_chat_template(TEMPLATE) == TEMPLATE
    with pytest.raises(ValueError, match="no such file"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def rendered_tokens(tiny_lm, **variables) -> int:
    # jinja2 renders the oracle prompt; TinyGPT's tokens are its UTF-8 bytes.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    text = env.from_string(TEMPLATE).render(messages=ASK, add_generation_prompt=True, **variables)
    return len(tiny_lm.tokenizer.encode(text))


def test_the_override_template_gets_the_tools_and_the_kwargs(tiny_lm):
    with run_server(tiny_lm, settings=ServerSettings(chat_template=TEMPLATE)) as live:
        client = openai.OpenAI(base_url=live.v1, api_key="x", max_retries=0)
        out = client.chat.completions.create(
            model=tiny_lm.name,
            messages=ASK,
            tools=[TOOL],
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=120,
            extra_body={"chat_template_kwargs": {"greeting": "Bonjour"}},
        )
        assert out.usage.prompt_tokens == rendered_tokens(
            tiny_lm, tools=[{"type": "function", "function": TOOL["function"]}], greeting="Bonjour"
        )
        # The template renders tools natively: hermes calls, constrained by the grammar.
        assert out.choices[0].finish_reason == "tool_calls"
        plain = client.chat.completions.create(model=tiny_lm.name, messages=ASK, max_tokens=1)
        assert plain.usage.prompt_tokens == rendered_tokens(tiny_lm)
        r = httpx.post(
            live.url("/v1/chat/completions"),
            json={"messages": ASK, "chat_template_kwargs": {"messages": []}},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


def test_reasoning_parser_returns_the_text_before_think_end_as_reasoning(tiny_lm):
    # deepseek_r1: the output starts inside the reasoning; TinyGPT never closes it.
    settings = ServerSettings(reasoning_parser="deepseek_r1")
    with run_server(tiny_lm, settings=settings) as live:
        client = openai.OpenAI(base_url=live.v1, api_key="x", max_retries=0)
        args = dict(
            model=tiny_lm.name,
            messages=ASK,
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        out = client.chat.completions.create(**args)
        text = (
            client.completions.create(
                model=tiny_lm.name,
                prompt=[int(t) for t in tiny_lm.tokenizer.encode("<|user|>hi\n<|assistant|>")],
                max_tokens=12,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            .choices[0]
            .text
        )
        message = out.choices[0].message
        assert message.model_extra["reasoning_content"] == text
        assert message.content == ""
        streamed = "".join(
            (c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
            for c in client.chat.completions.create(**args, stream=True)
            if c.choices
        )
        assert streamed == text
        # The Responses API gives it as a reasoning item.
        r = client.responses.create(
            model=tiny_lm.name,
            input="hi",
            max_output_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert [o.type for o in r.output] == ["reasoning"]
        assert r.output[0].content[0].text == text
