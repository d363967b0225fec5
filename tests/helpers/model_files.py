"""Model files the tests write: Hugging Face directories of random transformers models (with a
byte-level tokenizer), GGUF files of random weights in any block format, GGUF files of a
transformers model's weights as llama.cpp's converter stores them, and a Gemma vocabulary.
Nothing is downloaded.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import quantize


def random_ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# -- Hugging Face directories ---------------------------------------------------------------------


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
        for name, b in model.named_buffers():  # (LFM2-MoE's expert bias, a buffer, steers routing)
            if name.endswith("expert_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


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


def small_config(cls, **kw):
    """A 2-layer, 64-wide config of transformers' `cls` (vocabulary 272), fields overridden by `kw`."""
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


# -- GGUF files of random weights ----------------------------------------------------------------

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


# -- a Gemma 3 vocabulary -------------------------------------------------------------------------

CONTROL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
TURNS = ["<start_of_turn>", "<end_of_turn>", "<unused0>", "<unused1>", "<unused12>"]
USER = ["[multimodal]", "\n", "\n\n", "\n\n\n", "\t", "\t\t", "</div>", "<div>", "<b>", "</s>"]
SPACES = ["  ", "   ", "    "]  # Gemma stores these with real spaces, as user-defined tokens
CHARS = list("abcdehilnorstwxyzT.,!?<>/éü東京") + ["\u2581"]
# Merged tokens in an order that is not by length, with scores that disagree with it: the
# conversion ranks merges by file order, so a score-ranked BPE gives other ids.
MERGED = ["\u2581the", "th", "he", "\u2581t", "\u2581th", "ll", "lo", "hello", "hell", "hel",
          "el", "aba", "ab", "ba", "\u2581a", "\u2581b", "\u2581ab", "wor", "or",
          "ld", "rld", "world", "\u2581world", "<d", "iv", "div", "东京", "東京", "x\u2581",
          "Th", "Thé", "s.", "t,"]  # fmt: skip


def write_gemma_vocab_gguf(path: Path) -> Path:
    """A small Gemma 3 vocabulary (no tensors) with every kind of token Gemma's has: control,
    user-defined, byte fallback, spaces stored as real spaces, merges whose file order disagrees
    with their scores."""
    tokens = CONTROL + ["[multimodal]"] + TURNS + USER[1:] + SPACES
    tokens += [f"<0x{b:02X}>" for b in range(256)] + CHARS + MERGED
    types = [3] * len(CONTROL) + [4] + [3] * len(TURNS) + [4] * (len(USER) - 1 + len(SPACES))
    types += [6] * 256 + [1] * (len(CHARS) + len(MERGED))
    rng = random.Random(0)
    scores = [0.0 if t == 1 else -1000.0 for t in types]
    scores[-len(MERGED) :] = [-rng.uniform(0, 100) for _ in MERGED]
    w = GGUFWriter(str(path), "gemma3")
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
