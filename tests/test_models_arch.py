"""Gemma 3, Gemma 2, Qwen3, Qwen3-MoE, Qwen2, Phi-3 (3.5, 4-mini), SmolLM3 and Llama 3 against transformers' own classes, on tiny random
configs (nothing downloaded): a random model of each is saved as a Hugging Face directory, and,
written by the llama.cpp converter's rules, as a GGUF file; both load here and must give
transformers' logits over a prompt, through a full forward and through the engine (chunked
prefill over small blocks, then decode over the paged pool), with the CPU kernels where they run
and without. Gemma's prompts are longer than its sliding window (8) so the window matters.

Tolerance (tests/helpers/oracles.py): 1e-3 absolute on fp32 logits, argmax equal everywhere.
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers: nothing here touches a hub

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter

from models import AttentionMetadata, ModelLoadError, PrefillChunk, kernels, load_model, ops
from tests.helpers.engine_runs import engine_logits
from tests.helpers.model_files import (
    byte_level_tokenizer,
    random_ids,
    randomize_,
    write_hf_checkpoint,
)
from tests.helpers.oracles import ATOL, assert_logits_match, check_against, hf_logits, our_logits
from tests.helpers.real_models import gemma3_270m_path
from tests.helpers.tiny_archs import (
    ARCHS,
    LOGIT_CAP,
    ORIGINAL,
    SCORE_CAP,
    VOCAB,
    WINDOW,
    arch_names,
    gemma3_config,
)


@pytest.fixture(scope="module")
def checkpoint(request, tmp_path_factory):
    """(name, HF directory, the transformers model that wrote it), for the architecture a test's
    `on(...)` parametrization names."""
    name = request.param
    path = tmp_path_factory.mktemp(name)
    ref = write_hf_checkpoint(path, ARCHS[name].config(), seed=len(name))
    return name, path, ref


def on(names: list[str]):
    """Runs a test once per architecture in `names` (tests/helpers/tiny_archs.py's table says
    which have what the test checks)."""
    return pytest.mark.parametrize("checkpoint", names, indirect=True)


@on(arch_names())
@pytest.mark.parametrize("use_kernels", [False, True], ids=["torch", "kernels"])
def test_hf_directory_matches_transformers(checkpoint, use_kernels):
    name, path, ref = checkpoint
    if use_kernels and not kernels.available():
        pytest.skip(kernels.unavailable_reason() or "no kernels")
    lm = load_model(str(path), use_kernels=use_kernels)
    assert getattr(lm.model, "kernels", False) == use_kernels
    check_against(lm, ref, seed=len(name), short_lm=_short(name, path, use_kernels))


def _short(name: str, path: Path, use_kernels: bool):
    """A LongRoPE checkpoint loaded to serve its original context (short factors), else None."""
    if not ARCHS[name].longrope:
        return None
    lm = load_model(str(path), use_kernels=use_kernels, max_model_len=ORIGINAL)
    assert not lm.config.rope_long and lm.config.max_position_embeddings == ORIGINAL
    return lm


def _layers_op_by_op(model, x, positions, pools, meta) -> torch.Tensor:
    """What `ops.decoder_layers` claims to compute: its layer lists run as the single ops, one
    call at a time (the loop the one op replaced)."""
    c, eps = model.config, model.config.rms_norm_eps
    weights, layout = model._plan
    rope = model.rotary.halves(positions)
    local = rope if model.rotary_local is None else model.rotary_local.halves(positions)
    for i, (kc, vc) in enumerate(pools):
        w = weights[i * ops.Layer.TENSORS : (i + 1) * ops.Layer.TENSORS]
        ints = layout[i * ops.Layer.INTS : (i + 1) * ops.Layer.INTS]

        def linear(j, inp, residual, act, w=w, ints=ints):
            qs, d, m, bias = w[5 + 4 * j : 9 + 4 * j]
            kind, n = ints[2 * j : 2 * j + 2]
            op = ops.ggml_linear if kind in (ops.Kind.GGML, ops.Kind.GGML_A8) else ops.packed_linear
            return op(inp, qs, d, m, kind, n, bias, residual, act)

        qkv = linear(0, ops.rms_norm(x, w[0], eps), None, ops.Act.NONE)
        if w[4] is not None:
            ops.head_rms_norm(qkv, w[4], c.head_dim, eps)
        o = ops.attention(
            qkv, *(local if ints[8] else rope), kc, vc, *meta.kernel_args(), c.num_heads,
            c.num_kv_heads, c.head_dim, model.layers[0].self_attn.scale, ints[9],
            softcap=model.layers[0].self_attn.softcap,
        )  # fmt: skip
        if w[2] is None:  # Llama's layer
            x = linear(1, o, x, ops.Act.NONE)
            x = linear(3, linear(2, ops.rms_norm(x, w[1], eps), None, ints[10]), x, ops.Act.NONE)
        else:  # Gemma 3's
            x = ops.rms_norm(linear(1, o, None, ops.Act.NONE), w[1], eps, x)
            g = linear(2, ops.rms_norm(x, w[2], eps), None, ints[10])
            x = ops.rms_norm(linear(3, g, None, ops.Act.NONE), w[3], eps, x)
    return ops.rms_norm(x, model.norm.weight, eps)


@on(arch_names(lambda arch: not arch.moe))  # (a sparse MLP's: test_moe_rows_...)
def test_the_layer_stack_in_one_op_is_the_single_ops_bit_for_bit(checkpoint):
    """`ops.decoder_layers` (the path the engine runs) against its lists run op by op: a prefill
    chunk past Gemma's window, then a decode row, over fresh pools each; every value equal.
    (That path against transformers: the tests above.)"""
    _, path, _ = checkpoint
    if not kernels.available():
        pytest.skip(kernels.unavailable_reason() or "no kernels")
    model = load_model(str(path)).model
    assert model._plan is not None
    c, t = model.config, 20
    ids = torch.tensor(random_ids(t + 1, VOCAB, seed=3))
    table = torch.arange(8)
    steps = [
        (ids[:t], torch.arange(t),
         AttentionMetadata(torch.arange(t), 0, None, None, [PrefillChunk(0, t, t, table)])),
        (ids[t:], torch.tensor([t]),
         AttentionMetadata(torch.tensor([t]), 1, table[None], torch.tensor([t + 1]), [])),
    ]  # fmt: skip

    def pools() -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (8, 4, c.num_kv_heads, c.kv_layout.row_width)
        return [(torch.zeros(shape, dtype=c.kv_dtype), torch.zeros(shape, dtype=c.kv_dtype))
                for _ in range(c.num_layers)]  # fmt: skip

    ours, ref = pools(), pools()
    with torch.inference_mode():
        for tokens, positions, meta in steps:
            x = model.embed_tokens(tokens)
            if c.embedding_scale is not None:
                x = x * model._embedding_scale(x.dtype)
            want = _layers_op_by_op(model, x, positions, ref, meta)
            assert torch.equal(model(tokens, positions, ours, meta), want)


@on(["gemma3"])
def test_gemma3_config_reads_windows_scales_and_rope_bases(checkpoint):
    _, path, _ = checkpoint
    c = load_model(str(path), use_kernels=False).config
    assert c.layer_windows == (WINDOW,) * 5 + (0, WINDOW)
    assert (c.rope_theta, c.rope_local_theta) == (100_000.0, 1_000.0)
    assert c.attention_scale == pytest.approx(24**-0.5) and c.qk_norm
    assert c.embedding_scale == pytest.approx(8.0) and c.hidden_act == "gelu_tanh"
    assert c.tie_word_embeddings


@on(["gemma2"])
def test_gemma2_config_reads_windows_caps_and_scales(checkpoint):
    _, path, _ = checkpoint
    c = load_model(str(path), use_kernels=False).config
    assert c.layer_windows == (WINDOW, 0, WINDOW) and c.rope_local_theta is None
    assert (c.attn_logit_softcapping, c.final_logit_softcapping) == (SCORE_CAP, LOGIT_CAP)
    assert c.attention_scale == pytest.approx(24**-0.5) and not c.qk_norm
    assert c.embedding_scale == pytest.approx(8.0) and c.hidden_act == "gelu_tanh"


@on(["gemma2"])
@pytest.mark.parametrize("use_kernels", [False, True], ids=["torch", "kernels"])
def test_gemma2_soft_caps_change_what_it_computes(checkpoint, use_kernels, monkeypatch):
    """Without either soft cap this random Gemma 2 is far from transformers (so the tests above
    would catch a cap left out), in the full forward and in the engine's paged attention."""
    from dataclasses import replace

    _, path, ref = checkpoint
    if use_kernels and not kernels.available():
        pytest.skip(kernels.unavailable_reason() or "no kernels")
    ids = random_ids(40, VOCAB, seed=7)
    want = hf_logits(ref, ids)
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        lm = load_model(str(path), use_kernels=use_kernels)
        lm.model.config = replace(lm.model.config, **{field: None})
        for layer in lm.model.layers:
            layer.self_attn.softcap = lm.model.config.attn_logit_softcapping or 0.0
        assert (our_logits(lm, ids) - want).abs().max().item() > 20 * ATOL, field
        prompt = ids[:30]
        _, rows = engine_logits(lm, prompt, 2)
        expected = hf_logits(ref, prompt + [0])[len(prompt) - 1]
        assert (rows[0] - expected).abs().max().item() > 20 * ATOL, field


# -- GGUF files, written as llama.cpp's converter writes them ------------------------------------

_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",  # Phi-3: [gate; up] in one tensor
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",  # a mixture of experts' router
    "input_layernorm": "attn_norm",
}


def _gguf_block_name(arch: str, hf: str) -> str:
    if arch in ("gemma2", "gemma3"):
        special = {
            "post_attention_layernorm": "post_attention_norm",
            "pre_feedforward_layernorm": "ffn_norm",
            "post_feedforward_layernorm": "post_ffw_norm",
        }
        if hf in special:
            return special[hf]
    if hf == "post_attention_layernorm":
        return "ffn_norm"
    return _GGUF_NAMES[hf]


def write_gguf_from_hf(path: Path, arch: str, ref, experts_q8_0: bool = False) -> Path:
    """`ref`'s weights as a float32 GGUF of `arch` with the byte-level tokenizer; with
    `experts_q8_0`, a mixture of experts' stacked expert tensors in Q8_0."""
    from gguf.quants import quantize as gguf_quantize
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    cfg = ref.config
    w = GGUFWriter(str(path), arch)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + list(bytes_to_unicode().values()) + ["Ġt", "Ġth", "Ġthe"]
    tokens += [f"<unused{i}>" for i in range(cfg.vocab_size - len(tokens))]  # one per row
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    n_bytes = len(tokens) - len(specials) - (cfg.vocab_size - 262)
    w.add_token_types([3] * len(specials) + [1] * n_bytes + [5] * (cfg.vocab_size - 262))
    w.add_token_merges(["Ġ t", "Ġt h", "Ġth e"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if arch == "qwen3moe":
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_key_length(hd)
    w.add_value_length(hd)
    rope = cfg.rope_parameters
    if arch == "gemma3":
        w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        w.add_sliding_window(cfg.sliding_window)
        w.add_float32("gemma3.rope.freq_base_swa", rope["sliding_attention"]["rope_theta"])
    else:
        w.add_rope_freq_base(rope["rope_theta"])
    if arch == "gemma2":
        w.add_sliding_window(cfg.sliding_window)
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if arch == "phi3" and cfg.sliding_window:
        w.add_sliding_window(cfg.sliding_window)
    if arch == "phi3":  # as llama.cpp's Phi-3 converter: rotated dims, LongRoPE's factors
        w.add_rope_dimension_count(int(hd * rope.get("partial_rotary_factor", 1.0)))
    if rope.get("rope_type") == "longrope":
        original = rope["original_max_position_embeddings"]
        scale = cfg.max_position_embeddings / original
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        for kind in ("long", "short"):
            values = np.array(rope[f"{kind}_factor"], dtype=np.float32)
            w.add_tensor(f"rope_factors_{kind}.weight", values)

    def add_experts(name: str, arr: np.ndarray) -> None:
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if experts_q8_0:
            w.add_tensor(name, gguf_quantize(arr, Q.Q8_0), raw_dtype=Q.Q8_0)
        else:
            w.add_tensor(name, arr)

    for name, t in ref.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        arr = t.float().numpy()
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            arr = arr + 1  # llama.cpp's Gemma converter stores 1 + w
        if name.endswith("mlp.experts.gate_up_proj"):  # (experts, 2 ff, in): [gate; up]
            gate, up = np.split(arr, 2, axis=1)
            prefix = f"blk.{name.split('.')[2]}."
            add_experts(prefix + "ffn_gate_exps.weight", gate)
            add_experts(prefix + "ffn_up_exps.weight", up)
            continue
        if name.endswith("mlp.experts.down_proj"):  # (experts, out, in), stacked as converted
            add_experts(f"blk.{name.split('.')[2]}.ffn_down_exps.weight", arr)
            continue
        if name == "model.embed_tokens.weight":
            gguf = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf = "output_norm.weight"
        elif name == "lm_head.weight":
            gguf = "output.weight"
        else:
            parts = name.split(".")  # model.layers.N.<module...>.weight|bias
            gguf = f"blk.{parts[2]}.{_gguf_block_name(arch, '.'.join(parts[3:-1]))}.{parts[-1]}"
        w.add_tensor(gguf, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@on(arch_names(lambda arch: arch.gguf_arch is not None))
@pytest.mark.parametrize("use_kernels", [False, True], ids=["torch", "kernels"])
@pytest.mark.usefixtures("model_cache")  # the GGUF tokenizer's conversions
def test_gguf_file_matches_transformers(checkpoint, use_kernels, tmp_path, monkeypatch):
    name, _, ref = checkpoint
    if use_kernels and not kernels.available():
        pytest.skip(kernels.unavailable_reason() or "no kernels")
    path = write_gguf_from_hf(tmp_path / f"{name}.gguf", ARCHS[name].gguf_arch, ref)
    lm = load_model(str(path), use_kernels=use_kernels)
    short = _short(name, path, use_kernels)
    if name in ("gemma2", "gemma3"):
        # A GGUF carries no query_pre_attn_scalar: llama.cpp (and so the loader) scale by
        # head_dim ** -0.5, so the reference runs with that scale here.
        attns = [layer.self_attn for layer in ref.model.layers]
        monkeypatch.setattr(attns[0], "scaling", attns[0].scaling)  # restored after the test
        for a in attns:
            monkeypatch.setattr(a, "scaling", a.head_dim**-0.5)
    check_against(lm, ref, seed=len(name) + 1, short_lm=short)


@on(["gemma3"])
def test_gemma3_gguf_as_transformers_reads_it(checkpoint, tmp_path, monkeypatch):
    """transformers' own GGUF reader (its name map and its norm - 1) on the file written here
    gives back the checkpoint's tensors: the writer above is this test's own, so a second
    reader keeps its names and its + 1 honest."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from models.gguf_reader import transformers_reads_fast

    _, _, ref = checkpoint
    path = write_gguf_from_hf(tmp_path / "g.gguf", "gemma3", ref)
    with transformers_reads_fast():
        cfg = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        with torch.device("meta"):
            shell = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        theirs = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=shell)
    theirs = theirs["tensors"]
    expected = ref.state_dict()
    assert set(expected) - {"lm_head.weight"} <= set(theirs)
    for key, value in theirs.items():
        if key in expected:
            assert torch.allclose(value, expected[key], atol=1e-6), key


@on(arch_names(lambda arch: arch.longrope))
def test_longrope_factors_depend_on_the_context_served(checkpoint, tmp_path):
    """Loaded for its full context a LongRoPE model runs the long factors on every sequence (as
    llama.cpp with a context beyond the original), so on a short one it is not transformers'
    (short factors): the two sets differ enough for the tests above to tell them apart."""
    name, path, ref = checkpoint
    lm = load_model(str(path), use_kernels=False)
    assert lm.config.rope_long and lm.config.rope_attention_factor > 1
    ids = random_ids(12, VOCAB, seed=5)
    assert (our_logits(lm, ids) - hf_logits(ref, ids)).abs().max().item() > 20 * ATOL
    short = _short(name, path, False)
    assert_logits_match(our_logits(short, ids), hf_logits(ref, ids))
    # a context above the original keeps the long factors
    assert load_model(str(path), use_kernels=False, max_model_len=ORIGINAL + 1).config.rope_long


def test_phi_config_json_as_published_reads_longrope_and_partial_rotary():
    """The published config.json spelling (transformers 4.x: `rope_scaling` with `type`,
    `original_max_position_embeddings` and `partial_rotary_factor` at the top level), as
    Phi-3.5-mini-instruct's and Phi-4-mini-instruct's files have it."""
    from models.hf_loader import config_from_hf

    base = dict(model_type="phi3", hidden_size=3072, num_attention_heads=24,
                num_key_value_heads=8, num_hidden_layers=32, intermediate_size=8192,
                vocab_size=200064, max_position_embeddings=131072,
                original_max_position_embeddings=4096, rope_theta=10000.0,
                sliding_window=262144, tie_word_embeddings=True)  # fmt: skip
    short, long = [1.0 + i / 100 for i in range(48)], [1.0 + i for i in range(48)]
    cfg = config_from_hf(
        {**base, "partial_rotary_factor": 0.75,
         "rope_scaling": {"long_factor": long, "short_factor": short, "type": "longrope"}},
        "phi4", "config.json",
    )  # fmt: skip
    assert (cfg.head_dim, cfg.rotary_dim, cfg.rope_dims) == (128, 96, 96)
    assert cfg.rope_freq_factors == tuple(short) and cfg.rope_long_factors == tuple(long)
    assert cfg.rope_original_context == 4096 and cfg.rope_long
    assert cfg.rope_attention_factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    with pytest.raises(ModelLoadError, match="rope scaling lacks"):
        config_from_hf(
            {**base, "rope_scaling": {"type": "longrope", "long_factor": long}}, "x", "x"
        )


# -- the real Gemma 3 270M file ------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma3_270m():
    """(our pure-torch load, transformers' Gemma3ForCausalLM reading the same file)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from models.gguf_reader import transformers_reads_fast

    path = gemma3_270m_path()  # fetched if missing; fails in CI without it
    with transformers_reads_fast():
        cfg = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        with torch.device("meta"):  # skip random init; every weight is assigned below
            ref = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=ref)
    ref.load_state_dict(tensors["tensors"], strict=False, assign=True)
    # buffers built on meta above
    ref.model.rotary_emb = type(ref.model.rotary_emb)(config=cfg)
    ref.model.embed_tokens.embed_scale = torch.tensor(cfg.hidden_size**0.5)
    ref.tie_weights()
    return load_model(str(path), use_kernels=False), ref.eval()


@pytest.mark.slow
def test_gemma3_270m_gguf_matches_transformers_past_its_window(gemma3_270m):
    """The real file (Q5_0 / Q4_K / Q6_K / Q8_0 blocks, window 512, 262k vocabulary) against
    transformers reading the same file, over 600 tokens: beyond the window."""
    lm, ref = gemma3_270m
    assert lm.config.layer_windows == ((512,) * 5 + (0,)) * 3
    assert lm.config.vocab_size == 262_144 and lm.config.head_dim == 256
    ids = lm.tokenizer.encode(Path("README.md").read_text() * 3, add_special_tokens=True)[:600]
    assert ids[0] == lm.config.bos_token_id == 2
    assert_logits_match(our_logits(lm, ids), hf_logits(ref, ids))


@pytest.mark.slow
def test_gemma3_270m_completes_the_fox_and_chats(gemma3_270m):
    lm, _ = gemma3_270m
    tok = lm.tokenizer
    out, _ = engine_logits(lm, tok.encode("The quick brown fox", add_special_tokens=True), 6)
    assert tok.decode(out) == " jumps over the lazy dog."  # as llama.cpp on the same file
    rendered = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert rendered == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert tok.encode(rendered)[:2] == [2, 105]  # BOS and <start_of_turn> as single ids
    assert 106 in lm.eos_token_ids  # <end_of_turn> ends a chat turn


def test_multimodal_gemma3_directory_loads_its_language_model(tmp_path):
    """model_type "gemma3" (image-text): the decoder is its text_config, its tensors sit under
    the language model's prefix, and the vision tower's are left out."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = gemma3_config().to_dict()
    vision = dict(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    cfg = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        boi_token_index=VOCAB - 3,
        eoi_token_index=VOCAB - 2,
        image_token_index=VOCAB - 1,
    )
    torch.manual_seed(0)
    ref = Gemma3ForConditionalGeneration(cfg).eval()
    randomize_(ref, 7)
    ref.save_pretrained(tmp_path)
    byte_level_tokenizer().save_pretrained(tmp_path)
    lm = load_model(str(tmp_path), use_kernels=False)
    assert lm.config.layer_windows == (WINDOW,) * 5 + (0, WINDOW)
    ids = random_ids(30, VOCAB - 3, seed=7)  # no image tokens
    assert_logits_match(our_logits(lm, ids), hf_logits(ref, ids))


def test_a_gemma_vocabulary_without_a_template_chats_in_gemma_turns():
    """Gemma GGUFs may carry no chat template (the 270M one does not): the turn format follows
    from the vocabulary; a system message opens the first user turn."""
    from models.hf_tokenizer import HFTokenizer

    hf = byte_level_tokenizer()
    hf.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    assert hf.chat_template is None
    tok = HFTokenizer(hf)
    rendered = tok.apply_chat_template(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi "},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Bye"},
        ]
    )
    assert rendered == (
        "<|im_start|><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    )
    # other vocabularies without a template still have none
    assert HFTokenizer(byte_level_tokenizer()).chat_template is None


@on(arch_names(lambda arch: arch.moe))
def test_moe_rows_do_not_depend_on_the_batch(checkpoint):
    """A token's sparse-MLP output is the same bits alone as in any batch: its experts' rows,
    weighted and summed in expert order, whoever else the step's experts serve. (The layers run
    one by one: a sparse MLP has no one-op layer plan.)"""
    _, path, _ = checkpoint
    if not kernels.available():
        pytest.skip(kernels.unavailable_reason() or "no kernels")
    model = load_model(str(path)).model
    assert model._plan is None
    mlp = model.layers[1].mlp
    x = torch.randn(13, mlp.gate.in_features, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        experts, _ = mlp.route(x)
        assert len(set(experts.flatten().tolist())) > mlp.top_k  # rows share and differ
        batch = mlp(x)
        for i in range(len(x)):
            assert torch.equal(mlp(x[i : i + 1]), batch[i : i + 1])
        assert torch.equal(mlp(x[3:9]), batch[3:9])


@on(arch_names(lambda arch: arch.moe))
@pytest.mark.usefixtures("model_cache")  # the GGUF tokenizer's conversions
def test_moe_experts_in_a_quantized_file_run_as_one_op(checkpoint, tmp_path, monkeypatch):
    """Experts stored in a block format run through `ops.moe_experts`; the model's logits are
    those of the same experts run one at a time (the sparse MLP's torch loop over the packed
    projections), and near transformers' (Q8_0 rounding)."""
    _, _, ref = checkpoint
    if not kernels.available():
        pytest.skip(kernels.unavailable_reason() or "no kernels")
    path = write_gguf_from_hf(tmp_path / "q8.gguf", "qwen3moe", ref, experts_q8_0=True)
    lm = load_model(str(path))
    mlps = [layer.mlp for layer in lm.model.layers]
    assert all(m.fused is not None for m in mlps)
    ids = random_ids(24, VOCAB, seed=5)
    fused = our_logits(lm, ids)
    for m in mlps:
        monkeypatch.setattr(m, "fused", None)
    one_by_one = our_logits(lm, ids)
    torch.testing.assert_close(fused, one_by_one, rtol=1e-5, atol=1e-5)
    assert (fused - hf_logits(ref, ids)).abs().max().item() < 0.02
