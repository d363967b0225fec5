"""tools.synth_model: synthetic GGUFs of each architecture.

In CI: a tiny Llama-architecture Q4_K_M / Q8_0 file loads in our loader and generates varied
text; transformers' own tiny random Llama written to GGUF gives transformers' logits in our
loader; every architecture's file holds exactly the tensors and keys llama.cpp's architecture
table (gguf's constants) declares, in the layouts convert_hf_to_gguf.py writes (checked against
transformers' modules tensor by tensor). Where llama.cpp is built: each architecture loads and
generates in llama-server, and `synth F16` + `llama-quantize Q4_K_M` (or IQ4_XS) equals
`synth Q4_K_M` (IQ4_XS).
The tokenizer is SmolLM2's (fetched into the model cache if missing).
"""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.constants import MODEL_ARCH, MODEL_TENSORS, TENSOR_NAMES, GGMLQuantizationType

from models import gguf_loader, kernels, load_model
from models.hf_tokenizer import load_gguf_tokenizer
from models.hybrid import HybridForCausalLM
from tests.helpers.engine_runs import engine_greedy, engine_logits
from tests.helpers.llama_cpp import llama_cpp_tool, llama_server_greedy
from tests.helpers.oracles import our_logits
from tools import synth_model
from tools.synth_model import ARCHES, random_state_dict, write_gguf

Q = GGMLQuantizationType
TINY = dict(
    num_hidden_layers=2, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=512, head_dim=64, vocab_size=512, max_position_embeddings=1024,
)  # fmt: skip
PRESET = {"llama": "smollm2-360m", "qwen2": "qwen2.5-0.5b", "qwen3": "qwen3-0.6b",
          "qwen3moe": "qwen3-30b-a3b", "phi3": "phi-3-mini", "smollm3": "smollm3-3b",
          "gemma2": "gemma-2-2b", "gemma3": "gemma-3-270m", "gpt-oss": "gpt-oss-20b",
          "gemma4": "gemma-4-e2b", "lfm2": "lfm2-350m", "qwen35": "qwen3.5-0.8b",
          "granitehybrid": "granite-4.0-h-micro", "qwen35moe": "qwen3.5-35b-a3b",
          "lfm2moe": "lfm2-8b-a1b"}  # fmt: skip
# a mixture of experts' tiny experts (rows of 256 for the K-quant blocks); gpt-oss's size is
# its intermediate_size
TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256)
TINY_GPT_OSS = dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=256)
MOE = ("qwen3moe", "gpt-oss")
# Gemma 4's global layers: heads twice the sliding layers' (E2B: 512 and 256)
# The hybrids cut to enough layers to keep one attention layer (LFM2's third, Qwen3.5's fourth,
# Granite 4.0-H's sixth): llama.cpp allocates no KV buffer for a model without one and aborts.
# Granite's Mamba2 inner size is twice the hidden size (llama.cpp's rule): 8 heads of 64; its
# head untied (random layers times residual_multiplier 0.22 leave a tied head's argmax on the
# input token, embedded times 12: the same token again and again).
TINY_GRANITE = dict(num_hidden_layers=6, shared_intermediate_size=512, mamba_n_heads=8,
                    mamba_d_head=64, mamba_d_state=64, tie_word_embeddings=False)  # fmt: skip
TINY_EXTRA = {"qwen3moe": TINY_MOE, "gpt-oss": TINY_GPT_OSS, "gemma4": dict(global_head_dim=128),
              "lfm2": dict(num_hidden_layers=3), "qwen35": dict(num_hidden_layers=4),
              "granitehybrid": TINY_GRANITE,
              "qwen35moe": dict(TINY_MOE, num_hidden_layers=4, shared_expert_intermediate_size=256),
              "lfm2moe": dict(TINY_MOE, num_hidden_layers=3, num_dense_layers=1)}  # fmt: skip


# Families with recurrent layers: their files' layer pattern, head order and values are checked
# against transformers in tests/test_models_hybrid.py; the per-architecture checks below assume
# attention in every layer.
ATTENTION_ARCHES = tuple(
    a for a in ARCHES if not issubclass(synth_model.SPECS[a].model_class, HybridForCausalLM)
)


def tiny(arch: str, **fields) -> dict:
    return {**TINY, **TINY_EXTRA.get(arch, {}), **fields}


def greedy(lm, prompts: list[str], n: int) -> list[list[int]]:
    from engine import ContinuousBatchEngine, Request, SamplingParams

    engine = ContinuousBatchEngine(lm.model)
    reqs = []
    for p in prompts:
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        reqs.append(Request(prompt_token_ids=lm.tokenizer.encode(p), params=params))
        engine.add_request(reqs[-1])
    out: dict = {}
    while engine.has_work():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
    return [out[r.request_id] for r in reqs]


@pytest.mark.parametrize("fmt", ["Q4_K_M", "Q8_0", "IQ4_XS"])
def test_a_tiny_llama_synthetic_file_loads_and_generates_varied_text(tmp_path, smol_tokenizer, fmt):
    path = synth_model.write_synthetic(
        tmp_path / "tiny.gguf", "smollm2-360m", fmt, seed=3, tokenizer=smol_tokenizer,
        **dict(TINY, vocab_size=4096),  # SmolLM2's first 4096 tokens: bytes and common merges
    )  # fmt: skip
    types = {t.name: t.tensor_type for t in GGUFReader(str(path)).tensors}
    if fmt == "Q4_K_M":
        assert {Q.Q4_K, Q.Q6_K} <= set(types.values())
        assert types["token_embd.weight"] == Q.Q6_K  # the tied head
    elif fmt == "IQ4_XS":
        assert {Q.IQ4_XS, Q.Q6_K} <= set(types.values())
    else:
        assert {t for n, t in types.items() if "norm" not in n} == {Q.Q8_0}
    lm = load_model(str(path))
    assert lm.config.vocab_size == 4096
    outs = greedy(lm, ["The quick brown fox", "def main():", "Paris is", "1, 2, 3,"], 16)
    # Random weights scaled as a real model's give varied argmaxes, not one token repeated.
    assert all(len(tokens) == 16 and len(set(tokens)) >= 2 for tokens in outs), outs
    assert len({t for tokens in outs for t in tokens}) >= 16, outs
    assert len({tuple(tokens) for tokens in outs}) == 4


@pytest.mark.parametrize("arch", ATTENTION_ARCHES)
def test_each_architecture_multiplies_its_file_blocks_in_place(
    tmp_path, smol_tokenizer, arch, monkeypatch
):
    """With the kernels, every projection, the embedding and the head of a K-quant file of each
    architecture (Phi-3's fused qkv / gate_up, Qwen2's biases, Gemma's tied head and scaled
    embedding) run on the file's own blocks, no float copy (loading dequantizes none of them
    either), and give the logits of the float model dequantized from the same blocks (gguf's
    dequantize, pure torch)."""
    if not kernels.available():
        pytest.skip(kernels.unavailable_reason() or "no kernels")
    # Gemma: five windowed layers and a global one; SmolLM3: a fourth layer, without RoPE
    # Gemma 4: four sliding layers, a global one, and a global one reading its K/V
    layers = {"gemma2": 3, "gemma3": 6, "smollm3": 4, "gemma4": 6}.get(arch, 2)
    path = synth_model.write_synthetic(
        tmp_path / f"{arch}.gguf", PRESET[arch], "Q4_K_M", seed=4, tokenizer=smol_tokenizer,
        **tiny(arch, num_hidden_layers=layers, sliding_window=8),
    )  # fmt: skip
    dequantized: list[tuple[str, int]] = []
    real_dequantize = gguf_loader._dequantize

    def recording(t, dtype):
        dequantized.append((t.name, len(t.shape)))
        return real_dequantize(t, dtype)

    with monkeypatch.context() as m:
        m.setattr(gguf_loader, "_dequantize", recording)
        packed = load_model(str(path), activations="float32", kv_cache_dtype="float32")
    # only norms and biases (a Phi-3 file's fused ffn_up was dequantized whole and dropped:
    # 0.8 s a layer at 3.8B); and a MoE router, float32 in the file as llama-quantize leaves it
    floats = [name for name, dims in dequantized if dims > 1]
    # (and Gemma 4's per-layer model projection, never quantised: llama-quantize's rule)
    kept = ("ffn_gate_inp.weight", "per_layer_model_proj.weight")
    assert dequantized and all(n.endswith(kept) for n in floats), floats
    formats = packed.model.weight_formats()
    if arch in MOE:  # (the router: float32 panels, its scores choose the experts)
        assert formats.pop("f32") > 0
        assert all(layer.mlp.fused is not None for layer in packed.model.layers)  # one op
    if arch == "gemma4":  # (the per-layer model projection, float32 in the file)
        assert formats.pop("f32") > 0
    assert formats and all(name.startswith("q") for name in formats), formats
    assert type(packed.model.embed_tokens).__name__ in ("RowsEmbedding", "PanelEmbedding")
    # the module-free layer loop (a sparse MLP's layers run as modules, as do Gemma 4's with
    # their per-layer inputs and shared K/V)
    assert (packed.model._plan is not None) == (arch not in (*MOE, "gemma4"))
    floats = load_model(str(path), use_kernels=False)
    ids = [1, *range(40, 70)]  # 31 tokens: past the window of 8
    want = our_logits(floats, ids)
    torch.testing.assert_close(our_logits(packed, ids), want, rtol=0, atol=2e-4 * want.abs().max())
    # in the engine (the planned loop over the paged pool: prefill chunks with a past, decode
    # rows), each sampled position's logits are the float model's over the same tokens
    got, rows = engine_logits(packed, ids[:20], 12)
    want = our_logits(floats, ids[:20] + got)[19:-1]
    torch.testing.assert_close(torch.stack(rows), want, rtol=0, atol=2e-4 * want.abs().max())


def _hf_llama(tied: bool, rope_scaling: dict | None):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-5, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2,
        pad_token_id=None, rope_scaling=rope_scaling,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from 1, so a misplaced norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    return model


@pytest.mark.parametrize(
    "tied,rope_scaling",
    [
        (False, None),
        (
            True,
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ],  # fmt: skip
    ids=["untied", "tied-llama3-rope"],
)
def test_transformers_tiny_llama_written_to_gguf_gives_its_logits(
    tmp_path, smol_tokenizer, tied, rope_scaling
):
    model = _hf_llama(tied, rope_scaling)
    path = write_gguf(
        tmp_path / "hf.gguf", "llama", model.config.to_dict(), model.state_dict(), smol_tokenizer
    )
    names = {t.name for t in GGUFReader(str(path)).tensors}
    assert ("output.weight" in names) != tied
    assert ("rope_freqs.weight" in names) == (rope_scaling is not None)
    lm = load_model(str(path), activations="float32", kv_cache_dtype="float32")
    ids = [int(i) for i in np.random.default_rng(5).integers(0, 300, 48)]
    with torch.inference_mode():
        ref = model(torch.tensor([ids])).logits[0].float()
    ours = our_logits(lm, ids)
    assert (ours - ref).abs().max().item() < 1e-3
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_transformers_tiny_smollm3_written_to_gguf_gives_its_logits(tmp_path, smol_tokenizer):
    """SmolLM3 as llama.cpp's converter writes it (q/k permuted, no NoPE key: llama.cpp fixes
    every fourth layer) gives transformers' logits, with the kernels and without."""
    model = _hf_model("smollm3")
    assert model.config.no_rope_layers == [1, 1, 1, 0]
    path = write_gguf(
        tmp_path / "s3.gguf", "smollm3", model.config.to_dict(), model.state_dict(), smol_tokenizer
    )
    ids = [int(i) for i in np.random.default_rng(6).integers(0, 300, 40)]
    with torch.inference_mode():
        ref = model(torch.tensor([ids])).logits[0].float()
    for use_kernels in (False, True) if kernels.available() else (False,):
        lm = load_model(str(path), use_kernels=use_kernels, kv_cache_dtype="float32")
        assert lm.config.nope_layers == (False, False, False, True)
        ours = our_logits(lm, ids)
        assert (ours - ref).abs().max().item() < 1e-3
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def _hf_model(arch: str):
    """transformers' own tiny random model of an architecture."""
    import transformers as tf

    common = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
    classes = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {}),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {}),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, {"head_dim": 32}),
        "qwen3moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM,
                     {"head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2,
                      "moe_intermediate_size": 32}),
        "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM, {"pad_token_id": 0}),
        "smollm3": (tf.SmolLM3Config, tf.SmolLM3ForCausalLM,
                    {"num_hidden_layers": 4, "pad_token_id": 0}),
        "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM,
                   {"head_dim": 32, "sliding_window": 16, "query_pre_attn_scalar": 32}),
        "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM,
                   {"head_dim": 32, "sliding_window": 16, "query_pre_attn_scalar": 32}),
        "gpt-oss": (tf.GptOssConfig, tf.GptOssForCausalLM,
                    {"head_dim": 32, "sliding_window": 16, "num_local_experts": 4,
                     "num_experts_per_tok": 2, "intermediate_size": 32}),
        # (a sliding layer, a global one, and a global one reading the second's K/V)
        "gemma4": (tf.Gemma4TextConfig, tf.Gemma4ForCausalLM,
                   {"num_hidden_layers": 3, "head_dim": 32, "global_head_dim": 64,
                    "sliding_window": 16, "num_kv_shared_layers": 1,
                    "layer_types": ["sliding_attention", "full_attention", "full_attention"],
                    "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 300,
                    "pad_token_id": 0}),
    }  # fmt: skip
    config_cls, model_cls, extra = classes[arch]
    torch.manual_seed(1)
    return model_cls(config_cls(**{**common, **extra})).eval()


@pytest.mark.parametrize("arch", ATTENTION_ARCHES)
def test_each_architecture_has_the_tensors_keys_and_layouts_of_llama_cpp(
    tmp_path, smol_tokenizer, arch
):
    model = _hf_model(arch)
    config = model.config.to_dict()
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    path = write_gguf(tmp_path / f"{arch}.gguf", arch, config, sd, smol_tokenizer)
    reader = GGUFReader(str(path))
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    # Every tensor is one llama.cpp's table declares for the architecture.
    declared = {
        TENSOR_NAMES[t].format(bid=i) + suffix
        for t in MODEL_TENSORS[getattr(MODEL_ARCH, arch.upper().replace("-", "_"))]
        for i in range(model.config.num_hidden_layers)
        for suffix in (".weight", ".bias")
    }
    assert set(tensors) <= declared, set(tensors) - declared
    keys = set(reader.fields)
    for key in ("context_length", "embedding_length", "block_count", "feed_forward_length",
                "attention.head_count", "attention.head_count_kv", "rope.freq_base",
                "attention.layer_norm_rms_epsilon"):  # fmt: skip
        assert f"{arch}.{key}" in keys, key
    assert reader.fields["general.architecture"].contents() == arch
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == 300

    hf = {k: v.astype(np.float32) for k, v in sd.items()}
    b0 = "model.layers.0."
    if arch in synth_model.PERMUTED:
        # Q rows in llama.cpp's RoPE order: per head, the two halves interleaved.
        q = hf[b0 + "self_attn.q_proj.weight"].reshape(4, 2, 8, 64)
        assert np.array_equal(tensors["blk.0.attn_q.weight"], q.swapaxes(1, 2).reshape(64, 64))
    else:
        name = "attn_qkv" if arch == "phi3" else "attn_q"
        proj = "qkv_proj" if arch == "phi3" else "q_proj"
        assert np.array_equal(tensors[f"blk.0.{name}.weight"], hf[b0 + f"self_attn.{proj}.weight"])
    if arch == "qwen2":
        assert np.array_equal(
            tensors["blk.1.attn_k.bias"], hf["model.layers.1.self_attn.k_proj.bias"]
        )
    if arch in ("qwen3", "qwen3moe", "gemma3"):
        assert tensors["blk.0.attn_q_norm.weight"].shape == (32,)
    if arch == "qwen3moe":  # transformers' stacked [gate; up] split as the converter does
        gate_up = hf["model.layers.1.mlp.experts.gate_up_proj"]
        assert np.array_equal(tensors["blk.1.ffn_gate_exps.weight"], gate_up[:, :32])
        assert np.array_equal(tensors["blk.1.ffn_up_exps.weight"], gate_up[:, 32:])
        down = hf["model.layers.1.mlp.experts.down_proj"]
        assert np.array_equal(tensors["blk.1.ffn_down_exps.weight"], down)
        assert np.array_equal(
            tensors["blk.1.ffn_gate_inp.weight"], hf["model.layers.1.mlp.gate.weight"]
        )
        for key, value in (("expert_count", 4), ("expert_used_count", 2),
                           ("expert_feed_forward_length", 32)):  # fmt: skip
            assert reader.fields[f"qwen3moe.{key}"].contents() == value
    if arch == "gpt-oss":  # transformers' (experts, d, 2f), gate and up interleaved by column
        gate_up = hf["model.layers.1.mlp.experts.gate_up_proj"]
        np.testing.assert_array_equal(
            tensors["blk.1.ffn_gate_exps.weight"], gate_up[..., 0::2].transpose(0, 2, 1)
        )
        np.testing.assert_array_equal(
            tensors["blk.1.ffn_up_exps.weight"], gate_up[..., 1::2].transpose(0, 2, 1)
        )
        bias = hf["model.layers.1.mlp.experts.gate_up_proj_bias"]
        np.testing.assert_array_equal(tensors["blk.1.ffn_up_exps.bias"], bias[..., 1::2])
        down = hf["model.layers.1.mlp.experts.down_proj"]
        np.testing.assert_array_equal(
            tensors["blk.1.ffn_down_exps.weight"], down.transpose(0, 2, 1)
        )
        sinks = hf["model.layers.0.self_attn.sinks"]
        np.testing.assert_array_equal(tensors["blk.0.attn_sinks.weight"], sinks)
        for key, value in (("expert_count", 4), ("expert_feed_forward_length", 32),
                           ("attention.sliding_window", 16), ("rope.scaling.factor", 32.0),
                           ("rope.scaling.original_context_length", 4096)):  # fmt: skip
            assert reader.fields[f"gpt-oss.{key}"].contents() == value
        assert reader.fields["gpt-oss.rope.scaling.type"].contents() == "yarn"
    if arch == "phi3":
        assert tensors["blk.1.ffn_up.weight"].shape == (256, 64)  # gate and up, as HF fuses them
        assert reader.fields["phi3.rope.dimension_count"].contents() == 16
    if arch in ("gemma2", "gemma3"):
        # Gemma's RMSNorm scales by (1 + weight): the file stores weight + 1, as the converter does.
        for hf_name, gguf_name in (("post_feedforward_layernorm", "post_ffw_norm"),
                                   ("pre_feedforward_layernorm", "ffn_norm"),
                                   ("post_attention_layernorm", "post_attention_norm")):  # fmt: skip
            got = tensors[f"blk.1.{gguf_name}.weight"]
            np.testing.assert_array_equal(got, hf[f"model.layers.1.{hf_name}.weight"] + 1)
        assert reader.fields[f"{arch}.attention.sliding_window"].contents() == 16
        assert reader.fields[f"{arch}.attention.key_length"].contents() == 32
        assert "output.weight" not in tensors
    if arch == "gemma3":
        assert reader.fields["gemma3.rope.freq_base_swa"].contents() == 10000.0
    if arch == "gemma4":
        # plain RMSNorm weights, stored as they are; the global layers' head size and
        # proportional RoPE (a quarter of the 32 frequencies rotated, the rest factor 1e30)
        np.testing.assert_array_equal(
            tensors["blk.1.post_ffw_norm.weight"],
            hf["model.layers.1.post_feedforward_layernorm.weight"],
        )
        np.testing.assert_array_equal(
            tensors["blk.2.layer_output_scale.weight"], hf["model.layers.2.layer_scalar"]
        )
        assert "blk.2.attn_k.weight" not in tensors and "blk.1.attn_k.weight" in tensors
        assert tensors["per_layer_token_embd.weight"].shape == (300, 3 * 8)
        assert list(tensors["rope_freqs.weight"]) == [1.0] * 8 + [1e30] * 24
        fields = {"attention.key_length": 64, "attention.key_length_swa": 32,
                  "attention.sliding_window": 16, "attention.shared_kv_layers": 1,
                  "embedding_length_per_layer_input": 8}  # fmt: skip
        for key, value in fields.items():
            assert reader.fields[f"gemma4.{key}"].contents() == value, key
        pattern = reader.fields["gemma4.attention.sliding_window_pattern"].contents()
        assert pattern == [True, False, False]
        assert "output.weight" not in tensors
    if arch == "gemma2":
        assert reader.fields["gemma2.attn_logit_softcapping"].contents() == 50.0
        assert reader.fields["gemma2.final_logit_softcapping"].contents() == 30.0


def test_random_weights_are_initialised_like_a_real_model():
    arch, config = synth_model.make_config("llama-3.2-1b", num_hidden_layers=1, vocab_size=1000)
    q = random_state_dict(arch, config, seed=0)["model.layers.0.self_attn.q_proj.weight"]
    assert q.shape == (2048, 2048) and abs(float(q.std()) - 0.02) < 0.001
    arch, config = synth_model.make_config("qwen3-0.6b", num_hidden_layers=1, vocab_size=1000)
    sd = random_state_dict(arch, config, seed=0)
    # Narrower than 2048: the std that keeps a 2048-wide model's activation sizes.
    q = sd["model.layers.0.self_attn.q_proj.weight"]
    assert q.shape == (2048, 1024) and abs(float(q.std()) - 0.9 / 32) < 0.001
    assert abs(float(sd["model.embed_tokens.weight"].std()) - 0.02) < 0.001
    norm = sd["model.layers.0.input_layernorm.weight"]
    assert abs(float(norm.mean()) - 1) < 0.01
    assert np.array_equal(sd["model.embed_tokens.weight"], sd["model.embed_tokens.weight"])
    gemma_arch, gemma = synth_model.make_config("gemma-3-270m", num_hidden_layers=1)
    g = random_state_dict(gemma_arch, gemma, seed=0)["model.layers.0.input_layernorm.weight"]
    assert abs(float(g.mean())) < 0.01  # stored as norm - 1 in HF, + 1 in the file


def test_cli_lists_presets_and_refuses_bad_arguments(capsys, tmp_path):
    assert synth_model.main(["--list"]) == 0
    out = capsys.readouterr().out
    for preset in ("smollm2-360m", "llama-3.2-1b", "qwen3-0.6b", "qwen2.5-0.5b", "phi-3-mini",
                   "gemma-3-1b", "gemma-3-270m"):  # fmt: skip
        assert preset in out
    with pytest.raises(SystemExit):
        synth_model.main(["--preset", "qwen3-0.6b", "--arch", "llama", "-o", str(tmp_path / "x")])
    with pytest.raises(SystemExit):
        synth_model.main(["--preset", "llama-4", "-o", str(tmp_path / "x")])


def test_a_vocabulary_larger_than_the_tokenizer_is_padded_with_unused_tokens(
    tmp_path, smol_tokenizer, smollm2_file
):
    n = smol_tokenizer.vocab_size + 1000  # a preset's real head size, e.g. Llama 3.2's 128,256
    shape = dict(TINY, num_hidden_layers=1, hidden_size=64, head_dim=16, intermediate_size=128)
    path = synth_model.write_synthetic(
        tmp_path / "pad.gguf", "smollm2-360m", "Q8_0", tokenizer=smol_tokenizer,
        **dict(shape, vocab_size=n),
    )  # fmt: skip
    reader = GGUFReader(str(path))
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    assert len(tokens) == len(types) == n and types[-1] == 5 and types[100] == 1
    lm = load_model(str(path))
    assert lm.config.vocab_size == n
    ids = lm.tokenizer.encode("Hello world")
    assert ids == load_gguf_tokenizer(smollm2_file).encode("Hello world")
    assert max(ids) < smol_tokenizer.vocab_size


# -- against llama.cpp (where it is built) ---------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHES)
def test_each_architecture_loads_and_generates_in_llama_cpp(tmp_path, smol_tokenizer, arch):
    llama_cpp_tool("llama-server")
    path = synth_model.write_synthetic(
        tmp_path / f"{arch}.gguf",
        PRESET[arch],
        "Q4_K_M",
        seed=2,
        tokenizer=smol_tokenizer,
        **tiny(arch),
    )
    tokens = llama_server_greedy(path, [1, 400, 17, 99, 250], 12)
    assert len(tokens) == 12 and all(0 <= t < 512 for t in tokens)
    assert len(set(tokens)) >= 3, tokens


GEMMA2_CAPS = (2.0, 1.0)


@pytest.mark.slow
@pytest.mark.parametrize(
    "preset,fmt",
    [("phi-3.5-mini", "F32"), ("phi-4-mini", "F32"), ("smollm3-3b", "F32"),
     ("qwen3-30b-a3b", "F32"), ("gemma-2-2b", "F32"), ("gpt-oss-20b", "F32"),
     ("granite-4.0-h-micro", "F32"), ("qwen3.5-35b-a3b", "F32"), ("lfm2-8b-a1b", "F32")],
)  # fmt: skip
def test_synthetic_files_generate_as_llama_cpp(tmp_path, smol_tokenizer, preset, fmt):
    """Greedy 16 tokens equal to llama-server's on each prompt. LongRoPE (and Phi-4-mini's
    partial rotary): served within the original context (4096; llama-server -c 4096) both take
    the short factors, beyond it (-c 8192) the long ones, and the two contexts' tokens differ.
    SmolLM3: its fourth layer without RoPE. Qwen3-MoE: each token's experts as llama.cpp routes
    them (softmax, top k, renormalized). Gemma 2: soft caps low enough to bend this model's
    scores and logits, and a window the longer prompt passes. gpt-oss: sinks, biases, YaRN (the
    file's rounded correction range, as ggml's), a window the longer prompt passes, the clamped
    SwiGLU, in F32. Granite 4.0-H: Mamba2 layers, no RoPE, its four multipliers. (As published, MXFP4_MOE, the tokens part after a few: this random model's
    near ties flip under int8 activation rounding, ours against our own float32 activations as
    much as llama.cpp's Q8_0 ones; tests/test_gpt_oss.py checks that file against exact oracles.)"""
    llama_cpp_tool("llama-server")
    shape = dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=2,
                 num_key_value_heads=1, intermediate_size=512)  # fmt: skip
    # (a small vocabulary: a random model's top logits stand further apart than over 49k)
    if preset == "qwen3-30b-a3b":
        shape |= TINY_MOE
    if preset == "qwen3.5-35b-a3b":  # (Gated DeltaNet layers 0-2, attention at 3)
        shape |= dict(TINY_MOE, shared_expert_intermediate_size=256)
    if preset == "lfm2-8b-a1b":  # (conv, conv, attention, conv; the first layer dense)
        shape |= dict(TINY_MOE, num_dense_layers=1)
    if preset == "gemma-2-2b":
        shape |= dict(attn_logit_softcapping=GEMMA2_CAPS[0], final_logit_softcapping=GEMMA2_CAPS[1],
                      sliding_window=16)  # fmt: skip
    if preset == "gpt-oss-20b":
        shape |= dict(TINY_GPT_OSS, head_dim=64, sliding_window=16)
    if preset == "granite-4.0-h-micro":  # (five Mamba2 layers, then attention)
        shape |= dict(TINY_GRANITE, intermediate_size=512)
    arch, config = synth_model.make_config(preset, vocab_size=512, **shape)
    lazy = random_state_dict(arch, config, seed=3)
    state = {name: lazy[name] for name in lazy}
    # SmolLM2's 17 special tokens score 0: llama-server bans the ones it takes for ends of
    # generation (its FIM tokens among them) under ignore_eos, and random logits are ~ +-1.
    head = "lm_head.weight" if "lm_head.weight" in state else "model.embed_tokens.weight"
    state[head] = state[head].copy()
    state[head][:17] = 0
    path = write_gguf(tmp_path / f"{preset}.gguf", arch, config, state, smol_tokenizer, fmt)
    rng = np.random.default_rng(7)
    prompts = [[int(i) for i in rng.integers(17, 512, n)] for n in (12, 30)]
    longrope = preset.startswith("phi")
    runs = {}
    for ctx in (4096, 8192) if longrope else (1024,):
        lm = load_model(str(path), max_model_len=ctx)
        assert lm.config.rope_long == (ctx > 4096)
        ours = engine_greedy(lm, prompts, 16)
        theirs = [llama_server_greedy(path, p, 16, ctx=ctx) for p in prompts]
        assert ours == theirs, ctx
        runs[ctx] = ours
    if longrope:
        assert all(a != b for a, b in zip(runs[4096], runs[8192], strict=True))
    elif arch == "smollm3":
        assert lm.config.nope_layers == (False, False, False, True)


@pytest.mark.slow
@pytest.mark.parametrize(
    "preset,fmt",
    [("smollm2-360m", "Q4_K_M"), ("smollm2-360m", "IQ4_XS"), ("qwen3-30b-a3b", "Q4_K_M")],
)
def test_synth_f16_then_llama_quantize_is_synth_quantized(tmp_path, smol_tokenizer, preset, fmt):
    tool = llama_cpp_tool("llama-quantize")
    shape = dict(TINY, num_hidden_layers=4, intermediate_size=352)  # fallback rows too
    if fmt == "IQ4_XS":
        # Eight layers: layer 0's ffn_down goes up; one KV head for four: so do the attn_v.
        shape |= dict(num_hidden_layers=8, num_key_value_heads=1)
    if preset == "qwen3-30b-a3b":  # stacked experts (3-D tensors), a float32 router
        shape |= TINY_MOE
    common = dict(seed=4, tokenizer=smol_tokenizer, **shape)
    f16 = synth_model.write_synthetic(tmp_path / "f16.gguf", preset, "F16", **common)
    ours = synth_model.write_synthetic(tmp_path / "q.gguf", preset, fmt, **common)
    theirs = tmp_path / "theirs.gguf"
    done = subprocess.run([str(tool), str(f16), str(theirs), fmt], capture_output=True)
    assert done.returncode == 0, done.stderr[-2000:]
    a = {t.name: t for t in GGUFReader(str(ours)).tensors}
    b = {t.name: t for t in GGUFReader(str(theirs)).tensors}
    assert set(a) == set(b)
    for name, t in a.items():
        assert t.tensor_type == b[name].tensor_type, name
        assert np.array_equal(np.asarray(t.data), np.asarray(b[name].data)), name
    if fmt == "IQ4_XS":  # attn_v in Q5_K; ffn_down's 352-value rows in IQ4_NL, layer 0's in Q5_1
        assert {Q.IQ4_XS, Q.IQ4_NL, Q.Q5_K, Q.Q5_1} <= {t.tensor_type for t in a.values()}
