"""gpt-oss against transformers' own GptOssForCausalLM on a tiny random config (nothing
downloaded): three layers (windowed, full, windowed; a window of 8 that the prompts pass), attention
biases and sinks large enough to matter, four experts of which two a token with biases and the
clamped SwiGLU, YaRN. Saved as a Hugging Face directory and written as a GGUF as llama.cpp's
converter writes it (tools.synth_model; in F32, and in MXFP4_MOE as the published files are),
both load here and must give transformers' logits through a full forward and through the engine
(chunked prefill past the window, decode, preemption, a prefix-cache hit), with the kernels and
without; a model without its sinks must not.

Tolerance as tests/test_models_real.py: 1e-3 absolute on float32 logits, argmax equal.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers: nothing here touches a hub

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFValueType

from engine import ContinuousBatchEngine
from models import kernels, load_model
from tests.helpers.engine_runs import engine_logits, run_greedy
from tests.helpers.family_models import gpt_oss_config, write_gpt_oss
from tests.helpers.kquant_rows import round_activations
from tests.helpers.model_files import byte_level_tokenizer, random_ids
from tests.helpers.oracles import (
    ATOL,
    assert_logits_match,
    check_against,
    hf_greedy,
    hf_logits,
    our_logits,
)
from tests.helpers.tiny_archs import VOCAB
from tools import synth_model

WINDOW = 8
USE_KERNELS = pytest.mark.parametrize("use_kernels", [False, True], ids=["torch", "kernels"])


def byte_level_gguf_tokenizer() -> synth_model.Tokenizer:
    """A GGUF BPE vocabulary of VOCAB tokens (three specials, the 256 bytes, a few merges,
    unused tokens to the embedding's size), as `tests.test_models_arch` writes it."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + list(bytes_to_unicode().values()) + ["Ġt", "Ġth", "Ġthe"]
    unused = VOCAB - len(tokens)
    tokens += [f"<unused{i}>" for i in range(unused)]
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials) - unused) + [5] * unused
    a, s, u, i32 = (
        GGUFValueType.ARRAY,
        GGUFValueType.STRING,
        GGUFValueType.UINT32,
        GGUFValueType.INT32,
    )
    fields = {
        "tokenizer.ggml.model": ("gpt2", s, None),
        "tokenizer.ggml.pre": ("default", s, None),
        "tokenizer.ggml.tokens": (tokens, a, s),
        "tokenizer.ggml.token_type": (types, a, i32),
        "tokenizer.ggml.merges": (["Ġ t", "Ġt h", "Ġth e"], a, s),
        "tokenizer.ggml.bos_token_id": (1, u, None),
        "tokenizer.ggml.eos_token_id": (2, u, None),
    }
    return synth_model.Tokenizer(fields, "byte-level")


def write_gguf(path: Path, ref, fmt: str = "F32") -> Path:
    return synth_model.write_gguf(
        path, "gpt-oss", ref.config.to_dict(), ref.state_dict(), byte_level_gguf_tokenizer(), fmt
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss")
    return path, write_gpt_oss(path)


@pytest.fixture(scope="module")
def gguf_file(checkpoint, tmp_path_factory):
    _, ref = checkpoint
    return write_gguf(tmp_path_factory.mktemp("gpt_oss_gguf") / "tiny.gguf", ref)


@pytest.fixture(autouse=True)
def _model_cache(model_cache):
    """The GGUF tokenizer's cache: the session's for written files (each file converted once)."""


def _load(path: Path, use_kernels: bool, **kw):
    if use_kernels and not kernels.available():
        pytest.skip(kernels.unavailable_reason() or "no kernels")
    return load_model(str(path), use_kernels=use_kernels, **kw)


def test_configs_read_as_gpt_oss(checkpoint, gguf_file):
    path, _ = checkpoint
    for source in (path, gguf_file):
        c = load_model(str(source), use_kernels=False).config
        assert c.layer_windows == (WINDOW, 0, WINDOW)
        assert c.attention_sinks and c.attention_bias and c.attention_out_bias and c.mlp_bias
        assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (4, 2, 32)
        assert (c.moe_gating, c.moe_router_bias, c.hidden_act) == (
            "topk_softmax",
            True,
            "swiglu_oai",
        )
        assert c.rope_yarn is not None and c.rope_yarn.factor == 32.0 and c.rope_yarn.truncate
        assert c.rope_yarn.original_max_position_embeddings == 4096
        assert c.rope_attention_factor == pytest.approx(0.1 * np.log(32) + 1)


@USE_KERNELS
def test_hf_directory_matches_transformers(checkpoint, use_kernels):
    path, ref = checkpoint
    check_against(_load(path, use_kernels), ref, seed=11)


@USE_KERNELS
def test_gguf_file_matches_transformers(checkpoint, gguf_file, use_kernels):
    _, ref = checkpoint
    lm = _load(gguf_file, use_kernels)
    assert lm.config.rope_yarn.truncate  # (ggml's rounding: the checkpoint's too)
    check_against(lm, ref, seed=12)


@USE_KERNELS
def test_without_its_sinks_the_model_is_not_transformers(checkpoint, use_kernels):
    """The sinks are what the oracle tests above rest on: dropped (every layer's), the logits
    are far from transformers' in the full forward and in the engine's paged attention."""
    path, ref = checkpoint
    lm = _load(path, use_kernels)
    for layer in lm.model.layers:
        layer.self_attn.sinks = None
    ids = random_ids(30, VOCAB, seed=13)
    assert (our_logits(lm, ids) - hf_logits(ref, ids)).abs().max().item() > 20 * ATOL
    _, rows = engine_logits(lm, ids, 2)
    assert (rows[0] - hf_logits(ref, ids + [0])[len(ids) - 1]).abs().max().item() > 20 * ATOL


@pytest.mark.parametrize("source", ["hf", "gguf", "hf-mxfp4"])
def test_greedy_in_the_engine_through_preemption_and_prefix_hits_is_transformers(
    request, checkpoint, gguf_file, source
):
    """Five prompts (some past the window), 32 greedy tokens each, float32 activations and KV,
    in a pool small enough that requests are preempted and recomputed, then the same prompts
    again from the prefix cache: every token transformers' own greedy (for the MXFP4
    checkpoint, transformers' model of what it holds, its experts multiplied in place)."""
    path, ref = checkpoint
    if source == "hf-mxfp4":
        path, ref = request.getfixturevalue("mxfp4_checkpoint")
    lm = _load(gguf_file if source == "gguf" else path, kernels.available(),
               activations="float32", kv_cache_dtype="float32")  # fmt: skip
    prompts = [random_ids(n, VOCAB, seed=20 + n) for n in (5, 11, 17, 23, 30)]
    want = [hf_greedy(ref, p, 32) for p in prompts]
    engine = ContinuousBatchEngine(
        lm.model, max_batch_size=5, block_size=4, max_num_batched_tokens=16, num_blocks=40,
        enable_prefix_caching=True,
    )  # fmt: skip

    def run(batch: list[list[int]]) -> list[list[int]]:
        return run_greedy(engine, batch, 32)

    assert run(prompts) == want
    assert engine.stats().num_preemptions > 0
    hits = engine.stats().prefix_cache_hits
    assert run(prompts[3:]) == want[3:]
    assert engine.stats().prefix_cache_hits > hits


def test_transformers_exact_yarn_range_and_ggmls_rounding(tmp_path):
    """The published config's truncate=False: the directory gives transformers' logits with the
    exact correction range; its GGUF runs ggml's rounded range (as llama.cpp does), which is
    transformers with truncate=True, a small but real difference from the exact one."""
    ref = write_gpt_oss(tmp_path / "exact", truncate=False, seed=6)
    ids = random_ids(40, VOCAB, seed=14)
    exact = hf_logits(ref, ids)
    lm = load_model(str(tmp_path / "exact"), use_kernels=False)
    assert not lm.config.rope_yarn.truncate
    assert_logits_match(our_logits(lm, ids), exact)
    gguf = load_model(str(write_gguf(tmp_path / "exact.gguf", ref)), use_kernels=False)
    assert gguf.config.rope_yarn.truncate
    ours = our_logits(gguf, ids)
    assert (ours - exact).abs().max().item() > ATOL / 100
    from transformers import GptOssForCausalLM

    twin = GptOssForCausalLM(gpt_oss_config(truncate=True)).eval()
    twin.load_state_dict(ref.state_dict())
    assert_logits_match(ours, hf_logits(twin, ids))


class _Int8Input(torch.nn.Module):
    """A float `Linear` whose input is first rounded as the kernels' int8 activations stand for
    it (per 32 inputs, `tests.test_kquant.round_activations`): the oracle of a projection the
    kernels multiply with int8 activations."""

    def __init__(self, linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x, residual=None):
        return self.linear(round_activations(x.contiguous(), 32), residual)

    def gated(self, x, act):
        return self.linear.gated(round_activations(x.contiguous(), 32), act)


def int8_oracle(lm, experts_only: bool):
    """The pure-torch model `lm` with the inputs of its quantized projections rounded as int8
    activations: every expert's (`experts_only`, a checkpoint whose experts alone are blocks), or
    also attention's and the head's (a file whose other projections are Q8_0); the router (float32
    in every file) takes float activations as in the kernels."""
    for layer in lm.model.layers:
        for expert in layer.mlp.experts:
            expert.gate_up_proj = _Int8Input(expert.gate_up_proj)
            expert.down_proj = _Int8Input(expert.down_proj)
        if not experts_only:
            attn = layer.self_attn
            attn.qkv_proj, attn.o_proj = _Int8Input(attn.qkv_proj), _Int8Input(attn.o_proj)
    if not experts_only:
        lm.model.lm_head = _Int8Input(lm.model.lm_head)
    return lm


def test_an_mxfp4_moe_file_runs_its_experts_in_place(checkpoint, tmp_path, monkeypatch):
    """MXFP4_MOE, as llama-quantize writes gpt-oss: experts MXFP4, the other projections Q8_0,
    router, sinks, norms and biases float32. Through the kernels its experts run as the file's
    blocks in one op, and the logits are the pure-torch model's of the same file (gguf's
    dequantize) with its projections' inputs rounded as the int8 activations are (the oracle of
    those dots); with float32 activations, the pure-torch model's as it is."""
    if not kernels.available():
        pytest.skip(kernels.unavailable_reason() or "no kernels")
    _, ref = checkpoint
    path = write_gguf(tmp_path / "mxfp4.gguf", ref, "MXFP4_MOE")
    types = {t.name: t.tensor_type for t in GGUFReader(str(path)).tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == types["blk.2.ffn_down_exps.weight"] == Q.MXFP4
    assert types["blk.0.attn_q.weight"] == types["output.weight"] == Q.Q8_0
    assert types["blk.0.ffn_gate_inp.weight"] == types["blk.0.attn_sinks.weight"] == Q.F32
    assert types["blk.0.ffn_gate_exps.bias"] == Q.F32
    packed = load_model(str(path))
    assert all(layer.mlp.fused is not None for layer in packed.model.layers)
    assert "mxfp4+a8" in packed.model.weight_formats()
    ids = random_ids(30, VOCAB, seed=15)
    got = our_logits(packed, ids)
    floats = our_logits(load_model(str(path), use_kernels=False), ids)
    rounded = our_logits(int8_oracle(load_model(str(path), use_kernels=False), False), ids)
    assert_logits_match(got, rounded)
    exact = our_logits(load_model(str(path), activations="float32"), ids)
    torch.testing.assert_close(exact, floats, rtol=1e-4, atol=1e-4)


def _hf_mxfp4(rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts, out, k) float rows as transformers' MXFP4 (`_blocks` (experts, out, k / 32, 16),
    `_scales`), quantized by llama.cpp's rule (`models.gguf_quantize`) and laid out as the
    published checkpoints hold them: byte i of a block holds elements 2i (low) and 2i + 1."""
    from models.gguf_quantize import quantize

    e, n, k = rows.shape
    gguf = quantize(np.ascontiguousarray(rows, dtype=np.float32), Q.MXFP4).reshape(
        e, n, k // 32, 17
    )
    scales, qs = gguf[..., 0], gguf[..., 1:]
    values = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # (…, 32) in element order
    blocks = values[..., 0::2] | (values[..., 1::2] << 4)
    return torch.from_numpy(blocks.copy()), torch.from_numpy(scales.copy())


@pytest.fixture(scope="module")
def mxfp4_checkpoint(checkpoint, tmp_path_factory):
    """The tiny model as the published gpt-oss checkpoints are: its experts MXFP4 blocks and
    scales, `quantization_config` mxfp4; and transformers' model of what it holds (its experts
    dequantized by transformers' own MXFP4 reader, `_convert_moe_packed_tensors`: loading the
    directory itself needs the accelerate package)."""
    import json

    from safetensors.torch import save_file
    from transformers import GptOssForCausalLM
    from transformers.integrations.mxfp4 import _convert_moe_packed_tensors

    src, ref = checkpoint
    path = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    tensors, state = {}, {}
    for name, t in ref.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = _hf_mxfp4(t.float().numpy().transpose(0, 2, 1))  # rows: outputs
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
            state[name] = _convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        else:
            tensors[name] = state[name] = t.detach().contiguous()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (path / "config.json").write_text(json.dumps(config))
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            (path / f.name).write_bytes(f.read_bytes())
    theirs = GptOssForCausalLM(ref.config).eval()
    theirs.load_state_dict(state)
    return path, theirs


@pytest.mark.parametrize("mode", ["torch", "kernels-f32", "kernels"])
def test_an_mxfp4_checkpoint_matches_transformers_reading_it(mxfp4_checkpoint, mode):
    """A published-form checkpoint (MXFP4 experts): without the kernels its experts dequantized;
    with them the blocks re-laid as GGUF's MXFP4 and multiplied in place in one op, with float32
    activations (the same numbers: transformers' logits) and int8 ones (transformers' model with
    its experts' inputs rounded as the int8 activations are)."""
    path, theirs = mxfp4_checkpoint
    if mode == "torch":
        lm = _load(path, False)
    else:
        lm = _load(path, True, activations="float32" if mode == "kernels-f32" else "auto")
        assert all(layer.mlp.fused is not None for layer in lm.model.layers)
        assert {k.split("+")[0] for k in lm.model.weight_formats()} >= {"mxfp4"}
    ids = random_ids(40, VOCAB, seed=16)
    if mode == "kernels":
        oracle = int8_oracle(_load(path, False), experts_only=True)  # (its float path: mode torch)
        assert_logits_match(our_logits(lm, ids), our_logits(oracle, ids))
        return
    check_against(lm, theirs, seed=17)


def test_a_quantized_checkpoint_of_another_method_is_refused(checkpoint, tmp_path):
    import json
    import shutil

    from models import ModelLoadError

    src, _ = checkpoint
    shutil.copytree(src, tmp_path / "awq")
    config = json.loads((tmp_path / "awq" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq"}
    (tmp_path / "awq" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="quantized checkpoints \\(awq\\)"):
        load_model(str(tmp_path / "awq"), use_kernels=False)


HARMONY_TEMPLATE = Path(
    "/work/peers/src/llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates/"
    "openai-gpt-oss-120b.jinja"
)


def test_the_published_harmony_chat_template_renders_as_transformers_renders_it():
    """gpt-oss's chat template (the published files', llama.cpp's copy; skipped where it is
    absent): a system prompt, tools, a reasoning turn, a tool call and its result rendered by the
    project's sandbox (what the server and a GGUF's tokenizer use) exactly as transformers
    renders it, in the harmony format (channels, `to=functions.NAME`, `<|call|>`)."""
    from models.tokenizer import render_chat_template

    if not HARMONY_TEMPLATE.is_file():
        pytest.skip(f"no harmony template at {HARMONY_TEMPLATE}")
    template = HARMONY_TEMPLATE.read_text()
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}]  # fmt: skip
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "thinking": "I should call the tool.",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },  # fmt: skip
        {"role": "tool", "content": '{"temp": 21}'},
    ]
    ours = render_chat_template(template, messages, True, tools=tools)
    theirs = byte_level_tokenizer().apply_chat_template(
        messages, tools=tools, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    assert ours == theirs
    assert ours.startswith("<|start|>system<|message|>You are ChatGPT")
    assert "<|start|>developer<|message|># Instructions\n\nBe brief." in ours
    assert "type get_weather = (_: {" in ours
    assert "<|start|>assistant<|channel|>analysis<|message|>I should call the tool.<|end|>" in ours
    assert (
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>" in ours
    )
    assert '{"city": "Paris"}<|call|>' in ours
    # (the template passes a tool's result through tojson: a string comes out quoted)
    result = '"{\\"temp\\": 21}"'
    tool_turn = "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
    assert f"{tool_turn}{result}<|end|>" in ours
    assert ours.endswith("<|start|>assistant")


@pytest.mark.parametrize("f", [32, 12])
def test_a_biased_gate_up_projection_packs_as_it_computes(f):
    """gpt-oss's experts of a float checkpoint: their fused [gate; up] bias follows the panels'
    row order (gate 8p..8p+8, then up), so the packed clamped SwiGLU is the float one's; an
    expert size that leaves a partial last panel stays unpacked rather than miss up's bias."""
    from models.decoder import Linear, PackedLinear
    from models.ops import Act
    from models.packing import Packer

    if not kernels.available():
        pytest.skip(kernels.unavailable_reason() or "no kernels")
    torch.manual_seed(f)
    linear = Linear(64, 2 * f, bias=True)
    with torch.no_grad():
        linear.bias.normal_()
    packed = Packer("none", None, "float32")(linear, [["unused"]], gate_up=True)
    assert isinstance(packed, PackedLinear) == (f % 8 == 0)
    x = 3 * torch.randn(5, 64)
    want = linear.gated(x, Act.SWIGLU_OAI)
    torch.testing.assert_close(packed.gated(x, Act.SWIGLU_OAI), want, rtol=1e-5, atol=1e-5)
