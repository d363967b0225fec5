"""Per-model default sampling parameters: where they come from, the CLI flags, and that a request's
own fields always win."""

from __future__ import annotations

import dataclasses
import json

import openai
import pytest

from models import LoadedModel, ModelLoadError
from models.generation_config import (
    model_generation_defaults,
    preset_for,
    read_generation_config,
    resolve_generation_defaults,
)
from server.cli import build_parser, generation_defaults
from server.openai.protocol import ChatCompletionRequest, CompletionRequest
from server.openai.sampling_params import chat_sampling_params, completion_sampling_params
from tests.helpers.servers import run_server


def hf_like(lm: LoadedModel, directory) -> LoadedModel:
    """TinyGPT dressed as if loaded from a Hugging Face directory (what hf_loader records)."""
    config = dataclasses.replace(lm.config, extra={"source": str(directory)})
    return LoadedModel("my-hf-model", lm.model, lm.tokenizer, config)


def write_generation_config(directory, **values) -> None:
    (directory / "generation_config.json").write_text(json.dumps(values))


def test_generation_config_json_maps_vllms_fields_and_ignores_the_rest(tmp_path):
    write_generation_config(
        tmp_path,
        temperature=0.6,
        top_p=0.95,
        top_k=20,
        max_new_tokens=128,
        bos_token_id=1,
        eos_token_id=[2, 3],
        do_sample=True,
    )
    assert read_generation_config(tmp_path) == {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "max_tokens": 128,
    }


def test_auto_reads_the_model_directory_then_the_preset_then_nothing(tiny_lm, tmp_path):
    write_generation_config(tmp_path, temperature=0.3)
    assert model_generation_defaults(hf_like(tiny_lm, tmp_path)) == {"temperature": 0.3}
    assert model_generation_defaults(tiny_lm) == {}  # TinyGPT: OpenAI's defaults
    smollm2 = dataclasses.replace(tiny_lm, name="smollm2-135m-instruct")
    assert model_generation_defaults(smollm2) == {"temperature": 0.2, "top_p": 0.9}
    # A GGUF file of it loaded by path is named after the file's stem.
    assert preset_for("SmolLM2-135M-Instruct.Q4_1") == {"temperature": 0.2, "top_p": 0.9}
    assert preset_for("SmolLM2-360M-Instruct") == {}


def test_none_a_directory_and_overrides(tiny_lm, tmp_path):
    smollm2 = dataclasses.replace(tiny_lm, name="smollm2-135m-instruct")
    assert resolve_generation_defaults(smollm2, "none") == {}
    write_generation_config(tmp_path, temperature=0.5, top_k=0)  # transformers' "top_k off"
    assert resolve_generation_defaults(smollm2, str(tmp_path)) == {"temperature": 0.5}
    assert resolve_generation_defaults(
        smollm2, "auto", '{"temperature": 0.7, "top_k": 40, "max_new_tokens": 64}'
    ) == {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "max_tokens": 64}


@pytest.mark.parametrize(
    "source, override, complaint",
    [
        ("auto", "{not json", "not JSON"),
        ("auto", "[1, 2]", "JSON object"),
        ("auto", '{"temprature": 0.5}', "unknown sampling field 'temprature'"),
        ("auto", '{"top_k": 1.5}', "top_k must be an integer"),
        ("auto", '{"temperature": "hot"}', "temperature must be a number"),
        ("/no/such/dir", None, "expected auto, none or a directory"),
    ],
)
def test_bad_sources_and_overrides_are_startup_errors(tiny_lm, source, override, complaint):
    with pytest.raises(ModelLoadError, match=complaint):
        resolve_generation_defaults(tiny_lm, source, override)


def test_cli_flags_parse_and_out_of_range_defaults_fail_at_startup(tiny_lm):
    args = build_parser().parse_args(
        ["--generation-config", "none", "--override-generation-config", '{"temperature": 0.4}']
    )
    assert generation_defaults(
        tiny_lm, args.generation_config, args.override_generation_config
    ) == {"temperature": 0.4}
    assert build_parser().parse_args([]).generation_config == "auto"
    with pytest.raises(ModelLoadError, match="temperature"):
        generation_defaults(tiny_lm, "none", '{"temperature": -1}')
    with pytest.raises(ModelLoadError, match="top_p"):
        generation_defaults(tiny_lm, "none", '{"top_p": 0}')


DEFAULTS = {"temperature": 0.2, "top_p": 0.9, "top_k": 40, "max_tokens": 24}


def test_only_fields_the_client_did_not_send_take_defaults():
    req = CompletionRequest.model_validate({"prompt": "x", "temperature": 0.0, "top_p": None})
    (p,) = completion_sampling_params(req, vocab_size=260, defaults=DEFAULTS)
    assert p.temperature == 0.0  # sent: wins, even though it is falsy
    assert p.top_p == 0.9  # sent as null: the default
    assert p.top_k == 40
    assert p.max_tokens == 24  # not sent: the model's default, not OpenAI's 16
    req = CompletionRequest.model_validate({"prompt": "x", "max_tokens": 16, "top_k": -1})
    (p,) = completion_sampling_params(req, vocab_size=260, defaults=DEFAULTS)
    assert p.max_tokens == 16 and p.top_k is None and p.temperature == 0.2
    # Without defaults: OpenAI's.
    (p,) = completion_sampling_params(CompletionRequest(prompt="x"), vocab_size=260)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (1.0, 1.0, None, 16)


def test_chat_default_max_tokens_only_lowers_what_the_context_leaves():
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})
    (p,) = chat_sampling_params(req, 260, max_tokens=1000, defaults=DEFAULTS)
    assert p.max_tokens == 24 and p.temperature == 0.2
    (p,) = chat_sampling_params(req, 260, max_tokens=10, defaults=DEFAULTS)
    assert p.max_tokens == 10
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 100}
    )
    (p,) = chat_sampling_params(req, 260, max_tokens=100, defaults=DEFAULTS)
    assert p.max_tokens == 100


@pytest.mark.slow
def test_server_applies_and_shows_its_defaults(tiny_lm):
    """A greedy default makes an unspecified request deterministic and equal to an explicit
    temperature 0; a request's own temperature still samples; /v1/models shows the defaults."""
    with run_server(tiny_lm, default_sampling_params={"temperature": 0.0}) as live:
        client = openai.OpenAI(base_url=live.v1, api_key="x", max_retries=0)
        (card,) = client.models.list().data
        assert card.model_extra["default_sampling_params"] == {"temperature": 0.0}
        plain = [
            client.completions.create(model=tiny_lm.name, prompt="Hello", max_tokens=12)
            .choices[0]
            .text
            for _ in range(2)
        ]
        explicit = (
            client.completions.create(
                model=tiny_lm.name, prompt="Hello", max_tokens=12, temperature=0
            )
            .choices[0]
            .text
        )
        assert plain[0] == plain[1] == explicit
        sampled = {
            client.completions.create(
                model=tiny_lm.name, prompt="Hello", max_tokens=12, temperature=1.0, seed=s
            )
            .choices[0]
            .text
            for s in range(4)
        }
        assert len(sampled) > 1  # the request's temperature won over the greedy default
