"""The config readers every decoder family shares: the keys of a GGUF file and the fields of a
Hugging Face config.json that mean the same in all of them (shape, RoPE and its scalings,
norms, biases, the activation), read into `ModelConfig` fields. A family's spec
(`models.arch.<family>`) calls them and adds or refuses what is its own.

Also `GGUFMeta`, typed access to a GGUF file's metadata with errors that name the file and key.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gguf import GGUFReader
from gguf.quants import dequantize

from models.arch.spec import Fields
from models.base import ModelLoadError
from models.config import RopeScaling, YarnScaling


class GGUFMeta:
    """Typed access to GGUF metadata with errors that name the file and the key."""

    def __init__(self, reader: GGUFReader, path: Path) -> None:
        self.reader, self.path = reader, path

    @property
    def arch(self) -> str:
        """The file's `general.architecture`."""
        return self.require("general.architecture")

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


# RoPE frequency-factor tensors: read into the config, never loaded as weights.
ROPE_FACTOR_TENSORS = (
    "rope_freqs.weight",
    "rope_factors_long.weight",
    "rope_factors_short.weight",
)


def _factors(tensors: Mapping[str, Any], name: str) -> tuple[float, ...] | None:
    """A RoPE frequency-factor tensor's values, None if the file has none."""
    t = tensors.get(name)
    if t is None:
        return None
    return tuple(float(x) for x in dequantize(t.data, t.tensor_type).reshape(-1))


def gguf_decoder_fields(
    meta: GGUFMeta,
    tensors: Mapping[str, Any],
    *,
    permuted_qk: bool = False,
    experts: bool = False,
    linear_rope_scaling: bool = False,
) -> Fields:
    """The fields every decoder's GGUF file gives by the same `{arch}.*` keys, as llama.cpp reads
    them: shape, context, RoPE (base, partial rotary dimensions, llama.cpp's frequency factors,
    LongRoPE's two sets, YaRN), norm epsilon, a tied head, q/k/v biases.

    `permuted_qk`: the converter permuted q/k rows for GGML's RoPE pairs (then a partial rotary
    embedding cannot be undone, and is refused); `experts`: the architecture is a mixture of
    experts (else a file with experts is refused, and `feed_forward_length` is required);
    `linear_rope_scaling`: linear RoPE scaling is read (Gemma 3's global layers), not refused.
    """
    path, arch = meta.path, meta.arch
    a = f"{arch}."
    if not experts and (meta.get(a + "expert_count") or 0) > 0:
        from models.registry import gguf_architectures  # (the registry imports the specs)

        moe = [s.gguf_architecture for s in gguf_architectures() if s.gguf_tensors.stacked_experts]
        raise ModelLoadError(
            f"{path.name}: mixture-of-experts {arch} models are not supported "
            f"({', '.join(moe)} {'is' if len(moe) == 1 else 'are'})"
        )
    hidden = int(meta.require(a + "embedding_length"))
    n_heads = int(meta.require(a + "attention.head_count"))
    n_kv = meta.get(a + "attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):  # per layer, a hybrid's recurrent layers 0: its attention layers'
        n_kv = max(n_kv)
    n_kv = int(n_kv)
    n_layers = int(meta.require(a + "block_count"))
    head_dim = int(meta.get(a + "attention.key_length", hidden // n_heads))
    if int(meta.get(a + "attention.value_length", head_dim)) != head_dim:
        raise ModelLoadError(f"{path.name}: different key and value head sizes are not supported")
    rot = int(meta.get(a + "rope.dimension_count") or head_dim)
    if rot != head_dim and (permuted_qk or rot > head_dim or rot % 2):
        # (llama's converter permutes whole heads for GGML's pairs, which a part of a head
        # does not rotate as Hugging Face's halves do: no such checkpoint is known)
        raise ModelLoadError(
            f"{path.name}: partial rotary embeddings ({rot} of {head_dim} dims) are not supported"
            + (f" for the {arch} architecture" if permuted_qk else "")
        )
    scaling = meta.get(a + "rope.scaling.type")
    factor = float(meta.get(a + "rope.scaling.factor", 1.0))
    linear_factor, yarn, yarn_mscale = 1.0, None, 1.0
    if scaling not in (None, "none") and factor != 1.0:
        if scaling == "yarn":
            yarn, yarn_mscale = _gguf_yarn(meta, factor)
        elif linear_rope_scaling and scaling == "linear":
            linear_factor = factor
        else:
            raise ModelLoadError(f"{path.name}: RoPE scaling {scaling!r} is not supported")
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
    ffn = a + "feed_forward_length"
    return dict(
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=n_layers,
        num_heads=n_heads,
        num_kv_heads=n_kv,
        head_dim=head_dim,
        intermediate_size=int(meta.get(ffn, 0) if experts else meta.require(ffn)),
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
        rope_attention_factor=float(meta.get(a + "rope.scaling.attn_factor") or 1.0) * yarn_mscale,
        rope_yarn=yarn,
        rotary_dim=rot if rot != head_dim else None,
        rope_linear_factor=linear_factor,
        rms_norm_eps=float(meta.get(a + "attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias=qkv_bias,
    )


def _gguf_yarn(meta: GGUFMeta, factor: float) -> tuple[YarnScaling, float]:
    """A file's YaRN as llama.cpp runs it: its correction range always rounded out to whole
    dims (ggml_rope_yarn_corr_dims: transformers' truncate=True, whatever the checkpoint's config
    said), betas 32 and 1 unless the file gives them, and cos and sin times 0.1 ln(factor) + 1
    (llama_context recomputes that factor: a yarn_attn_factor key is not read). Returns the
    scaling and that attention factor."""
    a = meta.arch + "."
    ext = meta.get(a + "rope.scaling.yarn_ext_factor")
    if ext is not None and float(ext) >= 0 and float(ext) != 1.0:
        raise ModelLoadError(f"{meta.path.name}: YaRN extrapolation factor {ext} is not supported")
    if float(meta.get(a + "rope.scaling.yarn_log_multiplier") or 0.0):
        raise ModelLoadError(f"{meta.path.name}: YaRN's log multiplier is not supported")
    yarn = YarnScaling(
        factor=factor,
        original_max_position_embeddings=int(
            meta.require(a + "rope.scaling.original_context_length")
        ),
        beta_fast=float(meta.get(a + "rope.scaling.yarn_beta_fast", 32.0)),
        beta_slow=float(meta.get(a + "rope.scaling.yarn_beta_slow", 1.0)),
        truncate=True,
    )
    return yarn, _yarn_mscale(factor)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention factor for a context scale `factor` (transformers' yarn_get_mscale)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


# -- Hugging Face config.json ----------------------------------------------------------------------

# The activation each family's config names for its gated MLP, as `ModelConfig.hidden_act`.
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def hf_decoder_fields(
    cfg: dict,
    where: str,
    *,
    activation_key: str = "hidden_act",
    activation: str = "silu",
    qkv_bias: bool = False,
    tied_by_default: bool = False,
    eps_default: float = 1e-6,
) -> Fields:
    """The fields every decoder's config.json gives by the same names: shape, context, norm
    epsilon, a tied head, the gated MLP's activation (`activation_key`, the only one accepted
    `activation`, its default too), q/k/v biases (`qkv_bias`: always there, as Qwen2's; else
    `attention_bias` is refused, which Llama's config puts on o_proj too); MLP biases refused.
    RoPE is each family's (`hf_rope`)."""
    act = cfg.get(activation_key, activation)
    if act != activation or act not in ACTIVATIONS:
        raise ModelLoadError(
            f"{where}: hidden_act {act!r} is not supported for {cfg.get('model_type')}"
        )
    if cfg.get("mlp_bias"):
        raise ModelLoadError(f"{where}: MLP biases are not supported")
    if not qkv_bias and cfg.get("attention_bias"):
        raise ModelLoadError(f"{where}: attention biases (on q/k/v/o) are not supported")
    hidden = int(cfg["hidden_size"])
    n_heads = int(cfg["num_attention_heads"])
    return dict(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=n_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=int(cfg.get("head_dim") or hidden // n_heads),
        intermediate_size=int(cfg["intermediate_size"]),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", eps_default)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", tied_by_default)),
        attention_bias=qkv_bias,
        hidden_act=ACTIVATIONS[act],
    )


def hf_rope(
    cfg: dict,
    where: str,
    head_dim: int,
    params: dict | None = None,
    default_theta: float = 10000.0,
    linear_scaling: bool = False,
) -> Fields:
    """The `ModelConfig` RoPE fields of the config, or of `params` (one layer type's entry of a
    per-layer-type `rope_parameters`): base, Llama 3 / LongRoPE / YaRN scaling (and linear where
    `linear_scaling`, as Gemma 3's), rotated dims."""
    # transformers 5 writes rope_parameters {rope_theta, rope_type, ...}; 4.x rope_theta + rope_scaling.
    if params is None:
        params = cfg.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", default_theta)))
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    rot = int(head_dim * partial)  # as transformers rounds it
    fields: dict[str, Any] = dict(rope_theta=theta, rotary_dim=rot if rot != head_dim else None)
    scaling = cfg.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return fields
    if kind == "linear" and linear_scaling:
        return {**fields, "rope_linear_factor": float(scaling["factor"])}
    try:
        if kind == "llama3":
            scaling = RopeScaling(
                factor=float(scaling["factor"]),
                low_freq_factor=float(scaling["low_freq_factor"]),
                high_freq_factor=float(scaling["high_freq_factor"]),
                original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
            )
            return {**fields, "rope_scaling": scaling}
        if kind in ("longrope", "su"):  # ("su": its name in Phi-3's first configs)
            return {**fields, **_longrope(cfg, scaling)}
        if kind == "yarn":
            return {**fields, **_hf_yarn(cfg, scaling)}
    except KeyError as e:
        raise ModelLoadError(f"{where}: {kind} rope scaling lacks {e}") from e
    raise ModelLoadError(
        f"{where}: RoPE scaling {kind!r} is not supported (only 'llama3', 'longrope', 'yarn', "
        "and 'linear' for Gemma 3)"
    )


def _hf_yarn(cfg: dict, scaling: dict) -> Fields:
    """YaRN's fields as transformers' _compute_yarn_parameters reads them: the factor (or max /
    original context), betas 32 and 1 by default, the correction range truncated unless
    `truncate` is False (gpt-oss), and the attention factor given or from the factor (and
    mscale / mscale_all_dim where both are given)."""
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor")
    factor = float(factor if factor is not None else cfg["max_position_embeddings"] / original)
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attention = _yarn_mscale(factor)
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    yarn = YarnScaling(
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=float(scaling.get("beta_fast") or 32.0),
        beta_slow=float(scaling.get("beta_slow") or 1.0),
        truncate=bool(rope.get("truncate", True)),
    )
    return dict(rope_yarn=yarn, rope_attention_factor=float(attention))


def _longrope(cfg: dict, scaling: dict) -> Fields:
    """LongRoPE's fields (Phi-3.5, Phi-3 128k, Phi-4-mini), as transformers computes them: the
    attention factor from max / original context unless the config gives it."""
    original = int(
        scaling.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"]
    )
    factor = float(scaling.get("factor") or int(cfg["max_position_embeddings"]) / original)
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    return dict(
        rope_freq_factors=tuple(float(x) for x in scaling["short_factor"]),
        rope_long_factors=tuple(float(x) for x in scaling["long_factor"]),
        rope_original_context=original,
        rope_attention_factor=float(attention),
    )


def hf_layer_type_windows(cfg: dict, n_layers: int) -> tuple[int, ...] | None:
    """Windows per `layer_types` where the config turns sliding windows on (`use_sliding_window`,
    as Qwen2/3 and SmolLM3 configs do); None: no layer has one."""
    window = int(cfg.get("sliding_window") or 0)
    types = cfg.get("layer_types")
    if not (window and cfg.get("use_sliding_window") and types):
        return None
    return tuple(window if t == "sliding_attention" else 0 for t in types)
