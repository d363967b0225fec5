"""Phi-3, Phi-3.5 and Phi-4-mini: the Llama decoder with q/k/v and gate/up stored fused (the
decoder's own layout), a sliding window on every layer where the config has one, LongRoPE
(short and long factors, an attention factor) and partial rotary dimensions (Phi-4-mini's 96 of
128)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import partial
from typing import Any

from models.arch.llama import LLAMA_BLOCKS
from models.arch.readers import GGUFMeta, gguf_decoder_fields, hf_decoder_fields, hf_rope
from models.arch.spec import ArchSpec, Fields, GGUFTensorMap, SynthSpec
from models.arch.synth import decoder_shapes, longrope_tensors, rope_params, rotary_dims
from models.llama import LlamaForCausalLM


def hf_phi3_fields(cfg: dict, where: str) -> Fields:
    base = hf_decoder_fields(cfg, where)
    window = int(cfg.get("sliding_window") or 0)
    return dict(
        **base,
        **hf_rope(cfg, where, base["head_dim"]),
        # transformers' Phi-3 windows every layer
        layer_windows=(window,) * base["num_layers"] if window else None,
    )


def gguf_phi3_fields(meta: GGUFMeta, tensors: Mapping[str, Any]) -> Fields:
    fields = gguf_decoder_fields(meta, tensors)
    window = int(meta.get(f"{meta.arch}.attention.sliding_window", 0) or 0)
    if window:
        fields["layer_windows"] = (window,) * fields["num_layers"]  # as transformers' Phi-3
    return fields


def phi3_metadata(config: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The converter's Phi-3 keys: original context, rotated dims, window, LongRoPE's factor."""
    orig = int(config.get("original_max_position_embeddings", config["max_position_embeddings"]))
    keys: list[tuple[str, Any]] = [
        ("rope.scaling.original_context_length", orig),
        ("rope.dimension_count", rotary_dims(config)),
        ("attention.sliding_window", int(config.get("sliding_window") or 0)),
    ]
    scale = int(config["max_position_embeddings"]) / orig
    if rope_params(config).get("rope_type") == "longrope":
        factor = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0
        keys.append(("rope.scaling.attn_factor", factor))
    return keys


_PHI3_MINI = dict(
    hidden_size=3072, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
    intermediate_size=8192, vocab_size=32064, rope_theta=10000.0, rms_norm_eps=1e-5,
    tie_word_embeddings=False, max_position_embeddings=4096,
    original_max_position_embeddings=4096, sliding_window=2047,
)  # fmt: skip

SPECS = (
    ArchSpec(
        name="phi3",
        model_class=LlamaForCausalLM,
        describes="Phi-3, Phi-3.5, Phi-4-mini",
        hf_model_types=("phi3",),
        hf_config=hf_phi3_fields,
        gguf_architecture="phi3",
        gguf_config=gguf_phi3_fields,
        # fused projections: [q; k; v] rows, and ffn_up holding [gate; up]
        gguf_tensors=GGUFTensorMap(
            blocks={**LLAMA_BLOCKS, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
        ),
        synth=SynthSpec(
            presets={
                "phi-3-mini": _PHI3_MINI,
                # LongRoPE (128k context): tools.synth_model makes factors fit the rotated dims
                "phi-3.5-mini": dict(
                    _PHI3_MINI,
                    max_position_embeddings=131072,
                    sliding_window=262144,
                    rope_scaling=dict(rope_type="longrope"),
                ),
                "phi-4-mini": dict(
                    hidden_size=3072,
                    num_hidden_layers=32,
                    num_attention_heads=24,
                    num_key_value_heads=8,
                    intermediate_size=8192,
                    vocab_size=200064,
                    rope_theta=10000.0,
                    rms_norm_eps=1e-5,
                    tie_word_embeddings=True,
                    max_position_embeddings=131072,
                    original_max_position_embeddings=4096,
                    sliding_window=262144,
                    rope_scaling=dict(rope_type="longrope", partial_rotary_factor=0.75),
                ),
            },  # fmt: skip
            hf_shapes=partial(decoder_shapes, fused=True),
            metadata=phi3_metadata,
            tensors=longrope_tensors,
        ),
    ),
)
