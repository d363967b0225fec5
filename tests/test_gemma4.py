"""Gemma 4 (text) against transformers' own `Gemma4ForCausalLM` on a tiny random config with
everything E2B has: sliding layers (32-dim heads, window 8) and global ones (64-dim heads,
proportional RoPE), the last two layers sharing the K/V of the last owner of their kind, a
double-wide MLP on those two, per-layer inputs, layer scalars and a final soft cap (low enough to
bend these logits). Saved as a Hugging Face directory, and written as a GGUF by tools.synth_model
(as llama.cpp's converter writes one); both load here and give transformers' logits (full forward)
and its greedy tokens through the engine (prefill in chunks past the window, decode, preemption
under a small pool, a prefix-cache hit), with the CPU kernels and without.

Where llama.cpp is built (outside CI): its llama-server's greedy tokens on a synthetic file of
this shape equal ours.

Tolerance as tests/test_models_arch.py: 1e-3 absolute on float32 logits, argmax equal.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers: nothing here touches a hub

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import ContinuousBatchEngine, Request, SamplingParams
from models import ModelLoadError, kernels, load_model
from models.hf_loader import config_from_hf
from tests.helpers.attention_refs import (
    check_fused_attention,
    from_pool,
    rope_tables,
    rotate,
    to_pool,
)
from tests.helpers.engine_runs import engine_greedy
from tests.helpers.family_models import FULL, SLIDING, draw_layer_scalars
from tests.helpers.family_models import gemma4_config as family_gemma4_config
from tests.helpers.llama_cpp import llama_cpp_tool, llama_server_greedy
from tests.helpers.model_files import byte_level_tokenizer, random_ids, randomize_
from tests.helpers.oracles import (
    assert_logits_match,
    check_against,
    hf_greedy,
    hf_logits,
    our_logits,
)
from tools import synth_model

VOCAB, WINDOW, CAP = 272, 8, 1.5


def gemma4_config(**kw):
    """The served-families test's tiny Gemma 4 with this module's token ids."""
    return family_gemma4_config(**{"eos_token_id": 1, "bos_token_id": 2, **kw})


def write_checkpoint(path: Path, config, seed: int):
    """transformers' model of `config`, every parameter random and every layer scalar too (its
    buffer is 1 when initialised, which would hide a scalar left out)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize_(model, seed)
    draw_layer_scalars(model, seed)
    model.save_pretrained(path)
    byte_level_tokenizer("{% for m in messages %}{{ m['content'] }}{% endfor %}").save_pretrained(
        path
    )
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(HF directory, the transformers model that wrote it)."""
    path = tmp_path_factory.mktemp("gemma4")
    return path, write_checkpoint(path, gemma4_config(), seed=4)


def gguf_tokenizer() -> synth_model.Tokenizer:
    """A byte-level BPE vocabulary of VOCAB tokens in a GGUF's form (nothing fetched)."""
    from gguf import GGUFValueType as T
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    specials = ["<pad>", "<eos>", "<bos>"]
    tokens = specials + list(bytes_to_unicode().values()) + ["Ġt", "Ġth", "Ġthe"]
    tokens += [f"<unused{i}>" for i in range(VOCAB - len(tokens))]
    types = [3] * 3 + [1] * 259 + [5] * (VOCAB - 262)
    fields = {
        "tokenizer.ggml.model": ("gpt2", T.STRING, None),
        "tokenizer.ggml.pre": ("default", T.STRING, None),
        "tokenizer.ggml.tokens": (tokens, T.ARRAY, T.STRING),
        "tokenizer.ggml.token_type": (types, T.ARRAY, T.INT32),
        "tokenizer.ggml.merges": (["Ġ t", "Ġt h", "Ġth e"], T.ARRAY, T.STRING),
        "tokenizer.ggml.bos_token_id": (2, T.UINT32, None),
        "tokenizer.ggml.eos_token_id": (1, T.UINT32, None),
    }
    return synth_model.Tokenizer(fields, "test")


def write_gguf(path: Path, ref, fmt: str = "F32") -> Path:
    """`ref`'s weights written by tools.synth_model as llama.cpp's converter would."""
    state = {k: v.detach() for k, v in ref.state_dict().items() if k != "lm_head.weight"}
    config = ref.config.to_dict()
    return synth_model.write_gguf(path, "gemma4", config, state, gguf_tokenizer(), fmt)


def _kernels(use: bool) -> None:
    if use and not kernels.available():
        pytest.skip(kernels.unavailable_reason() or "no kernels")


# -- the config -----------------------------------------------------------------------------------


def test_config_reads_shapes_kv_sharing_rope_and_per_layer_inputs(checkpoint):
    path, _ = checkpoint
    c = load_model(str(path), use_kernels=False).config
    assert c.layer_windows == (WINDOW,) * 5 + (0, WINDOW, 0)
    assert c.layer_head_dims == (32,) * 5 + (64, 32, 64) and c.layer_kv_heads is None
    assert c.kv_sources == (0, 1, 2, 3, 4, 5, 4, 5)  # the last owner of each kind
    assert c.layer_intermediate_sizes == (96,) * 6 + (192, 192)
    assert (c.rope_theta, c.rope_local_theta) == (1_000_000.0, 10_000.0)
    # proportional: 8 of the global heads' 32 frequencies, exponents over the whole 64
    assert c.rope_freq_factors == (1.0,) * 8 + (math.inf,) * 24
    assert c.attention_scale == 1.0 and c.qk_norm and c.v_norm
    assert (c.per_layer_input_size, c.per_layer_vocab_size) == (16, VOCAB)
    assert c.final_logit_softcapping == CAP and c.embedding_scale == pytest.approx(8.0)


def test_published_config_spelling_reads_as_e2b():
    """E2B's config.json spelling (the global head size as `global_head_dim`, no per-layer
    config; a multimodal file's text model in `text_config`): its shapes, and the KV each layer
    reads (15 layers own theirs; the 20 after read layer 13's or 14's)."""
    _, e2b = synth_model.PRESETS["gemma-4-e2b"]
    outer = {"model_type": "gemma4", "text_config": {**e2b, "model_type": "gemma4_text"}}
    c = config_from_hf(outer, "e2b", "config.json")
    assert c.num_layers == 35 and (c.head_dim, c.num_kv_heads) == (256, 1)
    assert [c.head_dim_of(i) for i in (3, 4, 34)] == [256, 512, 512]
    assert c.kv_sources[:15] == tuple(range(15))
    assert all(c.kv_sources[i] == (14 if i % 5 == 4 else 13) for i in range(15, 35))
    assert [c.intermediate_size_of(i) for i in (14, 15)] == [6144, 12288]
    assert c.rope_freq_factors[63:65] == (1.0, math.inf)
    # the pool: 15 layers own K/V (3 global of 512, 12 sliding of 256), float32
    assert c.kv_bytes_per_token == 2 * (3 * 512 + 12 * 256) * 4
    for bad, words in (({"attention_k_eq_v": True}, "V = K"),
                       ({"enable_moe_block": True}, "mixture-of-experts"),
                       ({"num_kv_shared_layers": 35}, "leave none")):  # fmt: skip
        with pytest.raises(ModelLoadError, match=words):
            config_from_hf({**e2b, "model_type": "gemma4_text", **bad}, "e2b", "config.json")


# -- against transformers -------------------------------------------------------------------------


@pytest.mark.parametrize("use_kernels", [False, True], ids=["torch", "kernels"])
def test_hf_directory_matches_transformers(checkpoint, use_kernels):
    _kernels(use_kernels)
    path, ref = checkpoint
    lm = load_model(str(path), use_kernels=use_kernels, activations="float32")
    assert lm.model.kernels == use_kernels
    check_against(lm, ref, seed=11)


@pytest.mark.parametrize("use_kernels", [False, True], ids=["torch", "kernels"])
@pytest.mark.usefixtures("model_cache")  # the GGUF tokenizer's conversions
def test_gguf_file_matches_transformers(checkpoint, use_kernels, tmp_path):
    _kernels(use_kernels)
    _, ref = checkpoint
    path = write_gguf(tmp_path / "g4.gguf", ref)
    lm = load_model(str(path), use_kernels=use_kernels, activations="float32")
    assert lm.config.kv_sources == (0, 1, 2, 3, 4, 5, 4, 5)
    check_against(lm, ref, seed=12)


def test_each_feature_changes_what_it_computes(checkpoint):
    """Left out one at a time, the soft cap, the layer scalars, the per-layer inputs, the V norm
    and the KV sharing each move the logits far from transformers' (so the tests above would
    catch any of them missing)."""
    from dataclasses import replace

    path, ref = checkpoint
    ids = random_ids(30, VOCAB, seed=3)
    want = hf_logits(ref, ids)

    def far(lm) -> bool:
        return (our_logits(lm, ids) - want).abs().max().item() > 20 * 1e-3

    lm = load_model(str(path), use_kernels=False)
    assert_logits_match(our_logits(lm, ids), want)
    lm.model.config = replace(lm.config, final_logit_softcapping=None)
    assert far(lm)
    lm = load_model(str(path), use_kernels=False)
    for layer in lm.model.layers:
        layer.layer_scalar.data.fill_(1.0)
    assert far(lm)
    lm = load_model(str(path), use_kernels=False)
    lm.model.per_layer_inputs = lambda ids, x: None
    assert far(lm)
    lm = load_model(str(path), use_kernels=False)
    for layer in lm.model.layers:
        layer.self_attn.v_norm = False
    assert far(lm)


# -- the engine -----------------------------------------------------------------------------------


def serve(engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    reqs = [Request(list(p), SamplingParams(max_tokens=n, ignore_eos=True)) for p in prompts]
    out: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    for r in reqs:
        engine.add_request(r)
    with torch.inference_mode():
        while engine.has_work():
            for o in engine.step():
                out[o.request_id].extend(o.token_ids)
    return [out[r.request_id] for r in reqs]


PROMPTS = [random_ids(n, VOCAB, seed=20 + n) for n in (9, 14, 23, 30, 37)]
AGAIN = PROMPTS[3][:24] + random_ids(6, VOCAB, seed=99)  # 24 tokens (6 blocks) of the fourth


@pytest.fixture(scope="module")
def greedy_want(checkpoint) -> list[list[int]]:
    """transformers' 32 greedy tokens of each prompt, then of AGAIN (its `generate`, over its
    own cache of shared and sliding layers; the full forward's argmaxes are checked on the first
    prompt, which `generate` matches)."""
    _, ref = checkpoint
    want = [hf_greedy(ref, p, 32) for p in [*PROMPTS, AGAIN]]
    seq = PROMPTS[0] + want[0]
    assert hf_logits(ref, seq)[len(PROMPTS[0]) - 1 : -1].argmax(-1).tolist() == want[0]
    return want


@pytest.mark.parametrize("use_kernels", [False, True], ids=["torch", "kernels"])
def test_greedy_32_tokens_of_5_prompts_under_preemption_and_a_prefix_hit(
    checkpoint, greedy_want, use_kernels
):
    """Five prompts at once in a pool too small for all of them (so requests are preempted and
    recomputed), prefilled in chunks of 16 over blocks of 4, 32 tokens each, float32
    activations and KV; then a prompt sharing 24 tokens of the first, served from the prefix
    cache. Every token equal to transformers' greedy continuation."""
    _kernels(use_kernels)
    path, _ = checkpoint
    lm = load_model(str(path), use_kernels=use_kernels, activations="float32",
                    kv_cache_dtype="float32")  # fmt: skip
    engine = ContinuousBatchEngine(
        lm.model, max_batch_size=5, block_size=4, max_num_batched_tokens=16, num_blocks=40
    )
    assert serve(engine, PROMPTS, 32) == greedy_want[:5]
    stats = engine.stats()
    assert stats.num_preemptions > 0, stats
    assert serve(engine, [AGAIN], 32) == greedy_want[5:]
    assert engine.stats().prefix_cache_hits >= 20


def test_shared_layers_read_their_source_pools_and_own_none(checkpoint):
    """The runner's pool: one tensor per head size, of layers 0-5 only (five sliding, one
    global); layers 6 and 7 get layer 4's and 5's pools (the same memory), and the budget counts
    the owners only."""
    path, _ = checkpoint
    lm = load_model(str(path), use_kernels=False)
    engine = ContinuousBatchEngine(lm.model, block_size=4, num_blocks=10)
    runner = engine.runner
    shapes = sorted(tuple(p.shape) for p in runner.pools)
    assert shapes == [(1, 2, 10, 4, 2, 64), (5, 2, 10, 4, 2, 32)]
    caches = runner.kv_caches
    for shared, source in ((6, 4), (7, 5)):
        assert caches[shared][0].data_ptr() == caches[source][0].data_ptr()
        assert caches[shared][1].data_ptr() == caches[source][1].data_ptr()
    owned = {c[0].data_ptr() for c in caches}
    assert len(owned) == 6
    assert lm.config.kv_bytes_per_token == 2 * 2 * (5 * 32 + 1 * 64) * 4
    assert runner.kv is None
    with pytest.raises(ValueError, match="several shapes"):
        runner.read_blocks([1])


def test_engines_that_move_kv_between_pools_refuse_it_plainly(checkpoint):
    """The disaggregated engine moves K/V as one tensor of every layer's blocks, which a pool of
    several shapes is not: it refuses the model when built, not at a request."""
    from engine import DisaggregatedEngine

    path, _ = checkpoint
    lm = load_model(str(path), use_kernels=False)
    with pytest.raises(ValueError, match="cannot move between pools"):
        DisaggregatedEngine(lm.model, block_size=4, num_blocks=10)


# -- GGUF tables ----------------------------------------------------------------------------------


@pytest.mark.usefixtures("model_cache")  # the GGUF tokenizer's conversions
def test_the_per_layer_table_is_read_by_rows_where_it_lies(checkpoint, tmp_path, monkeypatch):
    """In a Q8_0 file the per-layer table stays the file's blocks: loading never dequantizes it
    (and, with the kernels, no tensor held in blocks: a shared layer's lone q, the per-layer
    gates), a lookup decodes the rows it reads (the kernel, or gguf's dequantize without it:
    the same floats), and the model's logits are the float model's over the same weights."""
    from models import gguf_loader
    from models.quant import GGMLTensor

    _, ref = checkpoint
    path = write_gguf(tmp_path / "q8.gguf", ref, "Q8_0")
    dequantized: list[tuple[str, str]] = []
    real = gguf_loader._dequantize

    def recording(t, dtype):
        dequantized.append((t.name, t.tensor_type.name))
        return real(t, dtype)

    monkeypatch.setattr(gguf_loader, "_dequantize", recording)
    floats = load_model(str(path), use_kernels=False)
    assert "per_layer_token_embd.weight" not in {name for name, _ in dequantized}
    table = floats.model.embed_tokens_per_layer
    assert isinstance(table.source, GGMLTensor) and table.nbytes() == VOCAB * 128 // 32 * 34
    ids = torch.tensor([5, 200, 5, 17])
    rows = table(ids)
    assert rows.shape == (4, 128) and torch.equal(rows[0], rows[2])
    ids_all = random_ids(30, VOCAB, seed=5)
    want = our_logits(floats, ids_all)
    if not kernels.available():
        return
    dequantized.clear()
    packed = load_model(str(path), activations="float32", kv_cache_dtype="float32")
    # (float16 / float32 in the file: norms, scalars, the never-quantized per-layer model
    # projection, and here the per-layer projections, whose 16 inputs fit no block)
    assert {typ for _, typ in dequantized} <= {"F32", "F16"}, dequantized
    assert torch.equal(packed.model.embed_tokens_per_layer(ids), rows)
    torch.testing.assert_close(our_logits(packed, ids_all), want, rtol=0, atol=2e-4)


# -- llama.cpp (outside CI) -----------------------------------------------------------------------


def llama_style_tokenizer():
    """A SentencePiece-style BPE vocabulary of VOCAB tokens with byte fallback, as Gemma's
    tokenizer.json is (what llama.cpp's Gemma 4 converter reads; nothing fetched)."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<pad>", "<eos>", "<bos>", "<unk>", *(f"<0x{b:02X}>" for b in range(256))]
    pieces += ["\u2581", "\u2581t", "\u2581th", "\u2581the", "t", "h", "e"]
    pieces += [f"<unused{i}>" for i in range(VOCAB - len(pieces))]
    merges = [("\u2581", "t"), ("\u2581t", "h"), ("\u2581th", "e")]
    bpe = models.BPE({p: i for i, p in enumerate(pieces)}, merges, byte_fallback=True,
                     unk_token="<unk>", fuse_unk=True)  # fmt: skip
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>")  # fmt: skip


@pytest.mark.usefixtures("model_cache")  # the GGUF tokenizer's conversions
def test_llama_cpp_converters_file_matches_transformers(checkpoint, tmp_path):
    """llama.cpp's own convert_hf_to_gguf.py (outside CI: skipped where it is not built) writes
    the checkpoint as F32 with a Gemma-style vocabulary ("gemma4" BPE): our loader reads it to
    transformers' logits and greedy tokens, with the CPU kernels and without, and tokenizes as
    transformers does."""
    import shutil
    import subprocess
    import sys

    root = llama_cpp_tool("llama-server").parents[2]
    script = root / "convert_hf_to_gguf.py"
    if not script.is_file():
        pytest.skip(f"no {script}")
    src, ref = checkpoint
    hf = tmp_path / "hf"
    hf.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(src / name, hf / name)
    tokenizer = llama_style_tokenizer()
    tokenizer.save_pretrained(hf)
    out = tmp_path / "conv.gguf"
    env = {**os.environ, "PYTHONPATH": str(root / "gguf-py")}
    cmd = [sys.executable, str(script), str(hf), "--outfile", str(out), "--outtype", "f32"]
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=600)
    for use_kernels in (False, True):
        if use_kernels and not kernels.available():
            continue
        lm = load_model(str(out), use_kernels=use_kernels, activations="float32")
        assert lm.config.kv_sources == (0, 1, 2, 3, 4, 5, 4, 5)
        check_against(lm, ref, seed=13)
    text = "the cat, the theme \u00e9"
    assert lm.tokenizer.encode(text) == tokenizer(text, add_special_tokens=False).input_ids


@pytest.mark.slow
def test_a_synthetic_file_generates_as_llama_cpp(tmp_path):
    """The E2B preset's layer kinds, KV sharing, double-wide MLP, per-layer inputs and soft cap
    at a tiny width (four layers: sliding, global, then two sharing their K/V), written F32 by
    tools.synth_model: greedy 16 tokens equal llama-server's on five prompts, one past the
    window."""

    llama_cpp_tool("llama-server")
    shape = dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=64, global_head_dim=128,
                 intermediate_size=512, layer_types=[SLIDING, FULL, SLIDING, FULL],
                 num_kv_shared_layers=2, hidden_size_per_layer_input=32, sliding_window=16,
                 vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB,
                 final_logit_softcapping=2.0, max_position_embeddings=1024)  # fmt: skip
    arch, config = synth_model.make_config("gemma-4-e2b", **shape)
    lazy = synth_model.random_state_dict(arch, config, seed=3)
    state = {name: lazy[name] for name in lazy}
    path = synth_model.write_gguf(tmp_path / "e2b.gguf", arch, config, state, gguf_tokenizer())
    rng = np.random.default_rng(7)
    prompts = [[int(i) for i in rng.integers(3, 259, n)] for n in (5, 9, 12, 20, 30)]
    lm = load_model(str(path), activations="float32", kv_cache_dtype="float32")
    ours = engine_greedy(lm, prompts, 16)
    theirs = [llama_server_greedy(path, p, 16, ctx=1024) for p in prompts]
    assert ours == theirs
    assert json.dumps(ours)  # (printable for the report)


# -- the attention kernel at Gemma 4's shapes ------------------------------------------------------


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.float16, torch.int8])
@pytest.mark.parametrize("shape", [(8, 1, 512), (8, 1, 256)], ids=["global", "sliding"])
@pytest.mark.parametrize("window", [0, 6])
def test_fused_attention_at_e2b_head_sizes(pool_dtype, shape, window):
    """E2B's attention shapes (8 query heads on one kv head; 512-dim global, 256-dim sliding
    heads) through the C++ op: decode rows and prefill chunks with and without a past, against
    RoPE in torch and `paged_attention` (the checks of tests/test_kernels.py)."""
    _kernels(True)

    check_fused_attention(pool_dtype, *shape, window=window)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.float16, torch.int8])
@pytest.mark.parametrize("head_dim", [64, 512])
@pytest.mark.parametrize("window", [0, 6])
def test_queries_only_attention_reads_the_pool_and_writes_nothing(pool_dtype, head_dim, window):
    """A shared-KV layer's step: the op given queries alone (H * D columns) ropes them and
    attends over K/V its source layer already wrote to the pool this step (decode rows, a chunk
    with a past, a fresh chunk), against `paged_attention` with no K/V of its own over the same
    pool; the pool is left byte for byte as it was."""
    _kernels(True)
    from models import ops
    from models.attention import AttentionMetadata, PrefillChunk, paged_attention

    torch.manual_seed(7)
    h, kvh, d, bs, nb = 4, 2, head_dim, 4, 40
    seqs = {  # name: (block table, tokens before this step, new tokens this step)
        "dec_a": ([3, 9, 21], 9, 1),
        "dec_b": ([7], 2, 1),
        "chunk": ([11, 12, 30, 31], 6, 5),
        "fresh": ([14, 15], 0, 7),
    }
    kvals, vvals = torch.zeros(nb, bs, kvh, d), torch.zeros(nb, bs, kvh, d)
    positions, slots, prefills, token = [], [], [], 0
    for name, (table, past, n) in seqs.items():
        for p in range(past + n):  # the source layer's K/V, this step's included
            kvals[table[p // bs], p % bs] = torch.randn(kvh, d)
            vvals[table[p // bs], p % bs] = torch.randn(kvh, d)
        pos = list(range(past, past + n))
        positions += pos
        slots += [table[p // bs] * bs + p % bs for p in pos]
        if not name.startswith("dec"):
            nbk = -(-(past + n) // bs)
            prefills.append(PrefillChunk(token, n, past + n, torch.tensor(table[:nbk])))
        token += n
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        num_decode_tokens=2,
        decode_block_tables=torch.tensor([[3, 9, 21], [7, 0, 0]]),
        decode_context_lens=torch.tensor([10, 3]),
        prefills=prefills,
    )
    kpool, vpool = to_pool(kvals, pool_dtype), to_pool(vvals, pool_dtype)
    before = (kpool.clone(), vpool.clone())
    q = torch.randn(token, h * d)
    cos, sin = rope_tables(torch.tensor(positions), d)
    scale = d**-0.5
    ref_pools = (from_pool(kpool, d), from_pool(vpool, d))
    roped = rotate(q.view(token, h, d), cos, sin)
    want = paged_attention(roped, None, None, ref_pools, meta, scale, window=window)
    got = ops.attention(
        q.clone(), cos, sin, kpool, vpool, meta.slot_mapping, 2, meta.decode_block_tables,
        meta.decode_context_lens, meta.chunk_meta(), meta.chunk_tables(), h, kvh, d, scale,
        window,
    )  # fmt: skip
    torch.testing.assert_close(got, want.reshape(token, h * d), rtol=1e-4, atol=1e-4)
    assert torch.equal(kpool, before[0]) and torch.equal(vpool, before[1])
