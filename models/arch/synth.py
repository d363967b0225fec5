"""What the families' `SynthSpec`s share: Hugging Face config.json fields read as
tools.synth_model and llama.cpp's converter read them (head size, RoPE parameters in either
spelling, rotated dims, expert count), the tensor shapes of a Llama-shaped checkpoint, and the
tensors and keys the converter derives from RoPE scaling (Llama 3's frequency factors, LongRoPE's
two sets). Configs here are plain dicts of config.json fields.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np


def head_dim(config: Mapping[str, Any]) -> int:
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def rope_params(config: Mapping[str, Any], layer_kind: str = "full_attention") -> dict[str, Any]:
    """RoPE parameters from either config spelling: transformers 5's `rope_parameters` (per layer
    kind for Gemma 3) or the older `rope_theta` / `rope_scaling` / `rope_local_base_freq`."""
    params = dict(config.get("rope_parameters") or {})
    params = dict(params.get(layer_kind, params))
    if config.get("rope_scaling"):
        params.update(config["rope_scaling"])
    if config.get("rope_theta") is not None:
        params["rope_theta"] = config["rope_theta"]
    if layer_kind == "sliding_attention" and config.get("rope_local_base_freq") is not None:
        params["rope_theta"] = config["rope_local_base_freq"]
    params.setdefault("rope_theta", 10000.0)
    return params


def rotary_dims(config: Mapping[str, Any]) -> int:
    """Rotated dims of a head, as llama.cpp's Phi-3 converter computes them."""
    partial = float(rope_params(config).get("partial_rotary_factor", 1.0))
    return int(partial * int(config["hidden_size"])) // int(config["num_attention_heads"])


def n_experts_of(config: Mapping[str, Any]) -> int:
    """A mixture of experts' expert count (transformers 5 names it num_local_experts)."""
    return int(config.get("num_experts") or config["num_local_experts"])


def decoder_shapes(
    config: Mapping[str, Any],
    *,
    norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm"),
    fused: bool = False,
    qkv_bias: bool = False,
    qk_norm: bool = False,
    experts: bool = False,
) -> dict[str, tuple[int, ...]]:
    """A Llama-shaped Hugging Face checkpoint's tensor names and shapes: the layer's `norms`,
    q/k/v and gate/up apart or `fused` (Phi-3's qkv_proj and gate_up_proj), Qwen2's q/k/v biases,
    QK-norm weights, or a router and the experts stacked as transformers holds them."""
    d = int(config["hidden_size"])
    hd = head_dim(config)
    nq = int(config["num_attention_heads"]) * hd
    nkv = int(config["num_key_value_heads"]) * hd
    ffn = int(config["intermediate_size"])
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (int(config["vocab_size"]), d),
        "model.norm.weight": (d,),
    }
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (int(config["vocab_size"]), d)
    for i in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{i}."
        for norm in norms[:2]:
            shapes[p + f"{norm}.weight"] = (d,)
        if fused:
            shapes[p + "self_attn.qkv_proj.weight"] = (nq + 2 * nkv, d)
        else:
            shapes[p + "self_attn.q_proj.weight"] = (nq, d)
            shapes[p + "self_attn.k_proj.weight"] = (nkv, d)
            shapes[p + "self_attn.v_proj.weight"] = (nkv, d)
        shapes[p + "self_attn.o_proj.weight"] = (d, nq)
        if experts:  # a router; the experts stacked as transformers holds them
            n_experts, eff = n_experts_of(config), int(config["moe_intermediate_size"])
            shapes[p + "mlp.gate.weight"] = (n_experts, d)
            shapes[p + "mlp.experts.gate_up_proj"] = (n_experts, 2 * eff, d)
            shapes[p + "mlp.experts.down_proj"] = (n_experts, d, eff)
        elif fused:
            shapes[p + "mlp.gate_up_proj.weight"] = (2 * ffn, d)
            shapes[p + "mlp.down_proj.weight"] = (d, ffn)
        else:
            shapes[p + "mlp.gate_proj.weight"] = (ffn, d)
            shapes[p + "mlp.up_proj.weight"] = (ffn, d)
            shapes[p + "mlp.down_proj.weight"] = (d, ffn)
        if qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (nq,)
            shapes[p + "self_attn.k_proj.bias"] = (nkv,)
            shapes[p + "self_attn.v_proj.bias"] = (nkv,)
        if qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        for norm in norms[2:]:
            shapes[p + f"{norm}.weight"] = (d,)
    return shapes


def llama3_rope_freqs(config: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Llama 3's RoPE scaling as the per-frequency factors llama.cpp's converter writes
    (`rope_freqs.weight`); none for other scalings."""
    rs = rope_params(config)
    if str(rs.get("rope_type", rs.get("type", ""))).lower() != "llama3":
        return {}
    dim = head_dim(config)
    base = float(rs["rope_theta"])
    factor = float(rs.get("factor", 8.0))
    low, high = float(rs.get("low_freq_factor", 1.0)), float(rs.get("high_freq_factor", 4.0))
    old = float(rs.get("original_max_position_embeddings", 8192))
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / float(f)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return {"rope_freqs.weight": np.asarray(out, dtype=np.float32)}


def longrope_tensors(config: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """LongRoPE's long and short factors as the converter writes them (none without it)."""
    rope = rope_params(config)
    if rope.get("rope_type") != "longrope":
        return {}
    return {
        f"rope_factors_{kind}.weight": np.asarray(rope[f"{kind}_factor"], dtype=np.float32)
        for kind in ("long", "short")
    }
