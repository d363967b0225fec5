"""Loading GGUF files (llama.cpp's format) into their `models.registry` class.

Owns: reading each architecture's GGUF metadata (`{arch}.*` keys) into a `ModelConfig`,
dequantizing tensors to the compute dtype with `gguf.quants.dequantize` (numpy), undoing llama.cpp's
Q/K row permutation (only the "llama" and "smollm3" architectures have it: their converter
interleaves the rotary halves; NEOX-style families such as Qwen2/3, Phi-3 and Gemma 3 are written as Hugging Face holds
them), and mapping each architecture's GGUF tensor names to Hugging Face names (and values: Gemma's
norms are stored as w + 1) for the model's `load_hf_weights`. With the kernels, tensors in a format they multiply in place
are never dequantized: `GGUFWeights.blocks` hands the model the file's rows (`models.quant`), and
the float "weight" it sees is a zero-memory stand-in. The tokenizer and chat template come from
the same file: Gemma's SentencePiece vocabularies through `models.spm_tokenizer` (no derived
merges table), every other one converted by transformers once, in a child process, and then
served from the saved copy without it (`models.hf_tokenizer`, `models.saved_tokenizer`).

Architectures: llama (Llama 1-3, Mistral, SmolLM2 convert to it), qwen2, qwen3, phi3 (Phi-3, 3.5,
4-mini: LongRoPE's factors and partial rotary dimensions), smollm3 (NoPE every fourth layer, as
llama.cpp fixes it), gemma2 (soft-capped attention scores and logits), gemma3, qwen3moe (its
stacked expert tensors read as one matrix an expert, views of the file). What is refused, by name: others, other mixtures of experts, RoPE scaling
other than llama.cpp's frequency factors (and linear scaling of Gemma 3's global layers), partial
rotary dimensions of the permuted architectures, tensor types outside `SUPPORTED_TYPES`, and
tensors the decoder has no place for.
"""

from __future__ import annotations

import mmap
import re
import struct
import time
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from models.base import LoadedModel, ModelLoadError
from models.config import ModelConfig
from models.gguf_reader import GGUFHeaderReader
from models.hf_loader import check_weight_names
from models.hf_tokenizer import end_ids, load_gguf_bpe_tokenizer
from models.packing import pack_for_kernels
from models.quant import GGML_BLOCKS, GGMLTensor, KernelOptions, gguf_rows
from models.registry import model_class
from models.spm_tokenizer import SPMTokenizer, read_gguf_tokenizer_metadata, uses_spm_tokenizer
from models.tokenizer import Tokenizer

Q = GGMLQuantizationType
# Types we dequantize and have checked against transformers / round trips; others are refused by
# name rather than trusted blindly.
SUPPORTED_TYPES = frozenset(
    {
        Q.F32,
        Q.F16,
        Q.BF16,
        Q.Q8_0,
        Q.Q4_0,
        Q.Q4_1,
        Q.Q5_0,
        Q.Q5_1,
        Q.Q2_K,
        Q.Q3_K,
        Q.Q4_K,
        Q.Q5_K,
        Q.Q6_K,
        Q.IQ4_NL,
        Q.IQ4_XS,
    }
)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Per architecture, the block tensors whose names differ from the Llama ones above.
_ARCH_BLOCK_NAMES = {
    "qwen3": {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
    "qwen3moe": {
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "ffn_gate_inp": "mlp.gate",  # the router
    },
    # fused projections: [q; k; v] rows, and ffn_up holding [gate; up]
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    # Gemma's four norms a layer
    "gemma2": {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
_ARCH_BLOCK_NAMES["gemma3"] = {
    **_ARCH_BLOCK_NAMES["gemma2"],
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# A mixture of experts' stacked projections, (experts, rows, in) each: one Hugging Face tensor
# per expert (`_ExpertSlice`).
_EXPERTS_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")

# llama.cpp's `general.architecture` -> the `models.registry` name. llama.cpp converts Llama 1-3,
# Mistral and SmolLM to "llama".
GGUF_ARCHITECTURES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "smollm3": "smollm3",
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
    "qwen3moe": "qwen3_moe",
}
# Mixtures of experts: their MLP tensors are a router and the experts' stacked projections.
MOE_ARCHITECTURES = ("qwen3moe",)
# Gemma's layer shape (`_gemma_fields`), norm weights stored as w + 1 by its converter.
GEMMA_LAYER_ARCHITECTURES = ("gemma2", "gemma3")
# Architectures whose converter permutes q/k rows for GGML's RoPE pairs (`_unpermute`).
PERMUTED_ARCHITECTURES = ("llama", "smollm3")
# llama.cpp's SmolLM3: every fourth layer has no RoPE (a constant there, not a file key).
_SMOLLM3_NOPE_EVERY = 4


def _open(path: Path) -> GGUFReader:
    try:
        return GGUFHeaderReader(path, skip_tokenizer_arrays=True)
    except (ValueError, OSError, KeyError, IndexError, struct.error) as e:
        # past the magic, a parse runs out of bytes where a download or a copy was cut short
        hint = "" if "magic" in str(e) else " (it ends early or is damaged: copy it again?)"
        raise ModelLoadError(f"{path} is not a readable GGUF file{hint}: {e}") from e


class _Meta:
    """Typed access to GGUF metadata with errors that name the file and the key."""

    def __init__(self, reader: GGUFReader, path: Path) -> None:
        self.reader, self.path = reader, path

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelLoadError(f"{self.path.name}: GGUF metadata has no {key}")
        return value

    def array_len(self, key: str) -> int | None:
        n = getattr(self.reader, "array_lengths", {}).get(key)  # the tokenizer's, only counted
        if n is not None:
            return n
        field = self.reader.fields.get(key)
        return None if field is None else len(field.data)  # without decoding 49k strings


def _gemma_fields(
    meta: _Meta, arch: str, hidden: int, n_heads: int, head_dim: int, n_layers: int
) -> dict:
    """Gemma 2's and 3's extras, as llama.cpp reads them: sliding windows on all but every sixth
    layer (Gemma 3) or every other layer from the first (Gemma 2; its window 4,096 unless the file
    says), or per `attention.sliding_window_pattern`; Gemma 3's QK-norm and RoPE base 10,000 on
    windowed layers; Gemma 2's soft-capped attention scores; the scales."""
    a = arch + "."
    gemma2 = arch == "gemma2"
    window = int(meta.get(a + "attention.sliding_window", 4096 if gemma2 else 0) or 0)
    pattern = meta.get(a + "attention.sliding_window_pattern", 2 if gemma2 else 6)
    if isinstance(pattern, list):  # one flag per layer: windowed or not
        if len(pattern) != n_layers:
            raise ModelLoadError(
                f"{meta.path.name}: sliding_window_pattern has {len(pattern)} entries for "
                f"{n_layers} layers"
            )
        windowed = [bool(f) for f in pattern]
    else:
        n = int(pattern)
        windowed = [n == 0 or i % n < n - 1 for i in range(n_layers)]
    # query_pre_attn_scalar is not in the file: llama.cpp's rule (head_dim; hidden / heads for
    # the 27B models, 46 layers of Gemma 2, 62 of Gemma 3).
    scale = (hidden // n_heads if n_layers == (46 if gemma2 else 62) else head_dim) ** -0.5
    # (Gemma 2 rotates every layer with one base, unless the file gives its windowed ones another)
    local_theta = meta.get(a + "rope.freq_base_swa", None if gemma2 else 10000.0)
    return dict(
        layer_windows=tuple(window if w and window else 0 for w in windowed),
        rope_local_theta=None if local_theta is None else float(local_theta),
        qk_norm=not gemma2,
        hidden_act="gelu_tanh",
        attention_scale=float(scale),
        embedding_scale=float(hidden) ** 0.5,
        attn_logit_softcapping=meta.get(a + "attn_logit_softcapping") or None,
        final_logit_softcapping=meta.get(a + "final_logit_softcapping") or None,
    )


def _moe_fields(meta: _Meta) -> dict:
    """Qwen3-MoE's experts, as llama.cpp reads them: the router's top-k weights always
    renormalized (its qwen3moe graph fixes that), no expert weight scale."""
    a = "qwen3moe."
    scale = float(meta.get(a + "expert_weights_scale") or 0.0)
    if scale not in (0.0, 1.0):
        raise ModelLoadError(f"{meta.path.name}: expert weight scale {scale} is not supported")
    used = int(meta.require(a + "expert_used_count"))
    size = meta.get(a + "expert_feed_forward_length")
    if size is None:  # (llama.cpp's fallback for files without it)
        size = int(meta.require(a + "feed_forward_length")) // used
    return dict(
        qk_norm=True,
        num_experts=int(meta.require(a + "expert_count")),
        num_experts_per_tok=used,
        moe_intermediate_size=int(size),
        norm_topk_prob=True,
    )


def _config(meta: _Meta, tensors: dict[str, Any], name: str) -> ModelConfig:
    path = meta.path
    arch = meta.require("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{path.name}: GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(GGUF_ARCHITECTURES)} (the 'llama' one covers Llama 1/2/3, Mistral, "
            "SmolLM and other checkpoints llama.cpp converts to it)"
        )
    a = f"{arch}."
    moe = arch in MOE_ARCHITECTURES
    if not moe and (meta.get(a + "expert_count") or 0) > 0:
        raise ModelLoadError(
            f"{path.name}: mixture-of-experts {arch} models are not supported (qwen3moe is)"
        )
    hidden = int(meta.require(a + "embedding_length"))
    n_heads = int(meta.require(a + "attention.head_count"))
    n_kv = int(meta.get(a + "attention.head_count_kv", n_heads))
    n_layers = int(meta.require(a + "block_count"))
    head_dim = int(meta.get(a + "attention.key_length", hidden // n_heads))
    if int(meta.get(a + "attention.value_length", head_dim)) != head_dim:
        raise ModelLoadError(f"{path.name}: different key and value head sizes are not supported")
    rot = int(meta.get(a + "rope.dimension_count") or head_dim)
    if rot != head_dim and (arch in PERMUTED_ARCHITECTURES or rot > head_dim or rot % 2):
        # (llama's converter permutes whole heads for GGML's pairs, which a part of a head
        # does not rotate as Hugging Face's halves do: no such checkpoint is known)
        raise ModelLoadError(
            f"{path.name}: partial rotary embeddings ({rot} of {head_dim} dims) are not supported"
            + (f" for the {arch} architecture" if arch in PERMUTED_ARCHITECTURES else "")
        )
    scaling = meta.get(a + "rope.scaling.type")
    factor = float(meta.get(a + "rope.scaling.factor", 1.0))
    linear_factor = 1.0
    if scaling not in (None, "none") and factor != 1.0:
        if not (arch == "gemma3" and scaling == "linear"):
            raise ModelLoadError(f"{path.name}: RoPE scaling {scaling!r} is not supported")
        linear_factor = factor
    # Llama 3.x carries its rope scaling as per-frequency divisors (llama.cpp's freq_factors),
    # LongRoPE (Phi-3.5, Phi-4-mini) two sets of them, for short and long contexts.
    freq_factors = _factors(tensors, "rope_freqs.weight")
    long_factors = _factors(tensors, "rope_factors_long.weight")
    if long_factors is not None:
        freq_factors = _factors(tensors, "rope_factors_short.weight")
        if freq_factors is None:
            raise ModelLoadError(f"{path.name}: rope_factors_long without rope_factors_short")
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise ModelLoadError(f"{path.name}: no token_embd.weight tensor")
    vocab = int(embd.shape[1])  # GGUF shapes are innermost-first: (hidden, vocab)
    # The vocabulary is the tokenizer's token list; an embedding padded beyond it is fine (the
    # head scores ids the tokenizer never produces), one shorter than it is a broken file.
    n_tokens = meta.array_len("tokenizer.ggml.tokens")
    if n_tokens is not None and n_tokens > vocab:
        raise ModelLoadError(
            f"{path.name}: {n_tokens} tokenizer tokens but token_embd has only {vocab} rows"
        )
    # q/k/v biases (Qwen2-style); any other bias is refused later by check_weight_names
    qkv_bias = any(n.endswith((".attn_q.bias", ".attn_qkv.bias")) for n in tensors)
    if arch in GEMMA_LAYER_ARCHITECTURES:
        extra = _gemma_fields(meta, arch, hidden, n_heads, head_dim, n_layers)
    elif moe:
        extra = _moe_fields(meta)
    else:
        extra = {"qk_norm": arch == "qwen3"}
        window = int(meta.get(a + "attention.sliding_window", 0) or 0)
        if arch == "phi3" and window:
            extra["layer_windows"] = (window,) * n_layers  # as transformers' Phi-3
        if arch == "smollm3":
            extra["nope_layers"] = tuple(
                (i + 1) % _SMOLLM3_NOPE_EVERY == 0 for i in range(n_layers)
            )
    return ModelConfig(
        name=name,
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=n_layers,
        num_heads=n_heads,
        num_kv_heads=n_kv,
        head_dim=head_dim,
        intermediate_size=int(
            meta.get(a + "feed_forward_length", 0)
            if moe
            else meta.require(a + "feed_forward_length")
        ),
        max_position_embeddings=int(meta.require(a + "context_length")),
        rope_theta=float(meta.get(a + "rope.freq_base", 10000.0)),
        rope_freq_factors=freq_factors,
        rope_long_factors=long_factors,
        # (llama.cpp's default for a file without the key: the training context)
        rope_original_context=int(
            meta.get(a + "rope.scaling.original_context_length")
            or meta.require(a + "context_length")
        )
        if long_factors is not None
        else None,
        rope_attention_factor=float(meta.get(a + "rope.scaling.attn_factor") or 1.0),
        rotary_dim=rot if rot != head_dim else None,
        rope_linear_factor=linear_factor,
        rms_norm_eps=float(meta.get(a + "attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias=qkv_bias,
        dtype=torch.float32,
        **extra,
    )


_ROPE_FACTOR_TENSORS = (
    "rope_freqs.weight",
    "rope_factors_long.weight",
    "rope_factors_short.weight",
)


def _factors(tensors: dict[str, Any], name: str) -> tuple[float, ...] | None:
    """A RoPE frequency-factor tensor's values, None if the file has none."""
    t = tensors.get(name)
    if t is None:
        return None
    return tuple(float(x) for x in dequantize(t.data, t.tensor_type).reshape(-1))


def _hf_name(gguf_name: str, path: Path, arch: str = "llama") -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m:
        names = _ARCH_BLOCK_NAMES.get(arch, {})
        hf = names.get(m.group(2)) or _BLOCK_NAMES.get(m.group(2))
        if hf is not None:
            return f"model.layers.{m.group(1)}.{hf}.{m.group(3)}"
    raise ModelLoadError(f"{path.name}: tensor {gguf_name!r} has no place in a {arch} decoder")


_PROJECTION_RE = re.compile(
    r"model\.layers\.(\d+)\.(self_attn|mlp|mlp\.experts\.\d+)\.(\w+_proj)\.weight"
)
_FUSED = {
    "q_proj": ("q_proj", "k_proj", "v_proj"),
    "k_proj": ("q_proj", "k_proj", "v_proj"),
    "v_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_proj": ("gate_proj", "up_proj"),
    "up_proj": ("gate_proj", "up_proj"),
}


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (its RoPE rotates adjacent pairs; ours rotates halves).

    The converter reshaped each head's rows as (2, hd/2) and swapped to (hd/2, 2); swapping back
    restores the Hugging Face order. Works for weights (rows, in) and biases (rows,).
    """
    hd = w.shape[0] // n_heads
    return w.reshape(n_heads, hd // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _dequantize(t: Any, dtype: torch.dtype) -> torch.Tensor:
    arr = dequantize(t.data, t.tensor_type)  # float32, shape = reversed GGUF dims
    expected = tuple(int(d) for d in reversed(t.shape.tolist()))
    arr = arr.reshape(expected)
    if not arr.flags.writeable:  # F32 tensors come back as views of the read-only file map
        arr = arr.copy()
    return torch.from_numpy(arr).to(dtype)


class _ExpertSlice:
    """One expert's (rows, in) matrix of a stacked (experts, rows, in) GGUF tensor, with the
    reader tensor's attributes this module reads (`tensor_type`, `shape` innermost first, `data`
    a view of the file's bytes)."""

    def __init__(self, t: Any, expert: int) -> None:
        self.name = f"{t.name}[{expert}]"
        self.tensor_type = t.tensor_type
        self.shape = t.shape[:2]
        self.data = t.data[expert]


def _expert_slices(t: Any, path: Path, arch: str) -> dict[str, _ExpertSlice]:
    """A stacked expert tensor under its experts' Hugging Face names."""
    m = _EXPERTS_RE.fullmatch(t.name)
    if m is None or arch not in MOE_ARCHITECTURES:
        raise ModelLoadError(f"{path.name}: tensor {t.name!r} has no place in a {arch} decoder")
    layer, proj = m.groups()
    if len(t.shape) != 3 or t.data.shape[0] != int(t.shape[2]):
        raise ModelLoadError(f"{path.name}: {t.name} is not (experts, rows, in)")
    return {
        f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight": _ExpertSlice(t, e)
        for e in range(int(t.shape[2]))
    }


class GGUFWeights(Mapping[str, torch.Tensor]):
    """A GGUF file's decoder tensors under Hugging Face names, dequantized when looked up.

    Lazy on purpose: `load_hf_weights(adopt=True)` turns each tensor into its parameter right
    after taking it, so the dequantized weights exist once (peak memory ~ the model, not twice it;
    on a VM, first-touch page faults of a second 540 MB copy cost seconds).

    `in_place`: the kernels will take the projections' own blocks (`blocks`), so a projection
    whose every fused part has them is not dequantized at all: its float tensor is a stride-0
    stand-in (`models.decoder` keeps it as such, no memory) that must not be read.
    """

    def __init__(
        self,
        path: Path,
        reader: GGUFReader,
        config: ModelConfig,
        dtype: torch.dtype,
        arch: str = "llama",
        in_place: bool = False,
    ) -> None:
        self.dtype = dtype
        heads = (
            {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}
            if arch in PERMUTED_ARCHITECTURES
            else {}
        )
        # Gemma's converter stores norm weights as w + 1; Hugging Face's (and the model's
        # loader's) convention is w.
        self._norm_shift = -1.0 if arch in GEMMA_LAYER_ARCHITECTURES else 0.0
        self._tensors: dict[str, Any] = {}
        for t in reader.tensors:
            if t.name in _ROPE_FACTOR_TENSORS:
                continue  # already in the config (rope_freq_factors, rope_long_factors)
            if t.tensor_type not in SUPPORTED_TYPES:
                raise ModelLoadError(
                    f"{path.name}: tensor {t.name} has type {t.tensor_type.name}, which is not "
                    f"supported (supported: {', '.join(sorted(q.name for q in SUPPORTED_TYPES))})"
                )
            if "_exps." in t.name:
                self._tensors.update(_expert_slices(t, path, arch))
            else:
                self._tensors[_hf_name(t.name, path, arch)] = t
        self._unread = self._in_place_names() if in_place else frozenset()
        # When the kernels take every q/k projection's blocks, they take them in the file's
        # order, as views of its pages (reordered, they would be anonymous copies: about a tenth
        # of a Llama file's weights), and RoPE pairs their rows as GGML does
        # (`ModelConfig.rope_interleaved`).
        # (a q/k bias is never taken as blocks: a file with one keeps Hugging Face's order)
        qk = [n for n in self._tensors if n.split(".")[-2] in heads]
        self.rope_interleaved = bool(qk) and all(n in self._unread for n in qk)
        # the rows `self[name]` and `blocks` un-permute, by their projection's head count
        self._heads = {} if self.rope_interleaved else heads

    def _in_place_names(self) -> frozenset[str]:
        """Projection weights the kernels take as blocks: each fused group (q/k/v, gate/up) all
        in formats `gguf_rows` reads, or none of it (a group's float fallback reads them all)."""

        def has_blocks(name: str) -> bool:
            t = self._tensors.get(name)
            if t is None or int(t.tensor_type) not in GGML_BLOCKS:
                return False
            return int(t.shape[0]) % GGML_BLOCKS[int(t.tensor_type)][0] == 0

        out: set[str] = set()
        # the embedding: looked up from its rows (`models.quant.RowsEmbedding`), the tied head
        # multiplied by them
        groups: list[list[str]] = [["lm_head.weight"], ["model.embed_tokens.weight"]]
        for name in self._tensors:
            m = _PROJECTION_RE.fullmatch(name)
            if m is None:
                continue
            layer, block, proj = m.groups()
            members = _FUSED.get(proj, (proj,))
            if proj == members[0]:  # (a fused group's parts are in one block)
                groups.append([f"model.layers.{layer}.{block}.{p}.weight" for p in members])
        for group in groups:
            if all(has_blocks(n) for n in group):
                out.update(group)
        return frozenset(out)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._unread:
            n, k = (int(d) for d in reversed(self._tensors[name].shape.tolist()))
            return torch.zeros((), dtype=self.dtype).expand(n, k)
        value = _dequantize(self._tensors[name], self.dtype)
        if self._norm_shift and name.endswith("norm.weight"):
            value = value + self._norm_shift
        proj = name.split(".")[-2]
        if proj in self._heads:
            value = _unpermute(value, self._heads[proj])
        return value

    def blocks(self, name: str) -> GGMLTensor | None:
        """The tensor's own quantized blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K .. Q6_K,
        IQ4_NL, IQ4_XS), byte for byte, row-permuted like `self[name]` (q/k rows un-permuted
        unless `rope_interleaved`) but never dequantized; None for other formats or names."""
        t = self._tensors.get(name)
        if t is None:
            return None
        n, k = (int(d) for d in reversed(t.shape.tolist()))
        qt = gguf_rows(t.data, int(t.tensor_type), n, k)
        proj = name.split(".")[-2]
        if qt is not None and proj in self._heads:
            heads = self._heads[proj]
            order = torch.arange(n).view(heads, n // heads // 2, 2).transpose(1, 2).reshape(-1)
            qt = qt.rows(order)
        return qt

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __contains__(self, name: object) -> bool:
        # (Mapping's default looks the value up: a dequantization or a read per membership test)
        return name in self._tensors

    def __len__(self) -> int:
        return len(self._tensors)


def load_gguf(
    path: str | Path,
    name: str | None = None,
    dtype: torch.dtype = torch.float32,
    kernels: KernelOptions | None = None,
) -> LoadedModel:
    """Load a GGUF file of a supported architecture: weights, tokenizer, chat template, EOS ids.

    `kernels`: how `models.packing.pack_for_kernels` packs the model, which then takes the
    file's own quantized blocks as they are (None: the pure-torch float model)."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"no such GGUF file: {path}")
    t0 = time.perf_counter()
    reader = _open(path)
    meta = _Meta(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    config = replace(_config(meta, tensors, name or path.stem), dtype=dtype)
    gguf_arch = meta.require("general.architecture")
    cls = model_class(GGUF_ARCHITECTURES[gguf_arch], path.name)

    # Checked before the tokenizer is converted: an unusable file fails fast.
    in_place = kernels is not None and kernels.quantization == "auto"
    weights = GGUFWeights(path, reader, config, dtype, arch=gguf_arch, in_place=in_place)
    check_weight_names(weights, config, path.name, cls)
    config = replace(config, rope_interleaved=weights.rope_interleaved)

    tok = _tokenizer(path, meta)
    eos = tok.eos_token_ids
    bos = meta.get("tokenizer.ggml.bos_token_id", tok.bos_token_id)
    pad = meta.get("tokenizer.ggml.padding_token_id", tok.pad_token_id)
    config = replace(
        config,
        eos_token_ids=eos,
        bos_token_id=None if bos is None else int(bos),
        pad_token_id=None if pad is None else int(pad),
        extra={"source": str(path), "file_type": meta.get("general.file_type")},
    )
    model = cls.without_weights(config)
    try:
        model.load_hf_weights(weights, adopt=True)
    except ValueError as e:
        raise ModelLoadError(f"{path.name}: {e}") from e
    model.eval().requires_grad_(False)
    if kernels is not None:
        # (every stand-in for a weight left in the file must be replaced by its blocks)
        try:
            model = pack_for_kernels(model, kernels, weights.blocks)
        except ValueError as e:
            raise ModelLoadError(f"{path.name}: {e}") from e
    _release_pages(reader)
    config.extra["load_seconds"] = round(time.perf_counter() - t0, 3)
    return LoadedModel(config.name, model, tok, config)


def _release_pages(reader: GGUFReader) -> None:
    """Take the file pages loading read (tensors copied into panels, permuted q/k rows, a tied
    table packed into head panels) out of the process's resident set. The map is read-only and
    file-backed, so nothing is lost: the weights the kernels read in place fault back in from
    the page cache as they are used, and pages only a copy needed stop counting against the
    server's memory."""
    root = reader.data
    while not isinstance(root, np.memmap) and isinstance(getattr(root, "base", None), np.ndarray):
        root = root.base
    mm = getattr(root, "_mmap", None)
    if isinstance(mm, mmap.mmap) and hasattr(mmap, "MADV_DONTNEED"):
        mm.madvise(mmap.MADV_DONTNEED)


def load_gguf_file_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer `load_gguf` gives a GGUF file, without its weights (models.fetch: prepare
    it once after a download)."""
    path = Path(path)
    return _tokenizer(path, _Meta(_open(path), path))


def _tokenizer(path: Path, meta: _Meta) -> Tokenizer:
    """The file's tokenizer, its end-of-generation ids set from the file's declared ones."""
    declared = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    spm = {
        "general.architecture": meta.get("general.architecture"),
        "tokenizer.ggml.model": meta.get("tokenizer.ggml.model"),
    }
    if meta.array_len("tokenizer.ggml.merges") is not None:
        spm["tokenizer.ggml.merges"] = True
    if uses_spm_tokenizer(spm):
        try:
            tok = SPMTokenizer.from_gguf_metadata(read_gguf_tokenizer_metadata(path))
        except (ValueError, KeyError, OSError, struct.error) as e:
            raise ModelLoadError(f"cannot read the tokenizer stored in {path}: {e}") from e
        # Known end tokens only among its control tokens: Gemma's "</s>" is a user-defined HTML
        # tag (strikethrough), not an end of text.
        control = {t: i for t, i in tok.added_vocab.items() if i in tok.special_ids}
        tok.eos_token_ids = end_ids(declared, tok.eos_token_id, control)
        return tok
    return load_gguf_bpe_tokenizer(path, declared)
