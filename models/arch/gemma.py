"""Gemma 2 and Gemma 3 (text; and the language model of a multimodal Gemma 3 checkpoint):
Gemma's four-norm layer (`models.gemma3`) with GeGLU, embeddings times sqrt(hidden), the
attention scale 1/sqrt(query_pre_attn_scalar), sliding windows on most layers; Gemma 3 adds
QK-norm and a RoPE base of its own on windowed layers, Gemma 2 soft-caps attention scores and
logits. Norm weights: Hugging Face stores w for a (1 + w) multiplier, llama.cpp's converter
w + 1.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import numpy as np

from models.arch.llama import LLAMA_BLOCKS, QK_NORM_BLOCKS
from models.arch.readers import GGUFMeta, gguf_decoder_fields, hf_decoder_fields, hf_rope
from models.arch.spec import ArchSpec, Fields, GGUFTensorMap, SynthSpec, ValueTransform
from models.arch.synth import decoder_shapes, rope_params
from models.base import ModelLoadError
from models.gemma3 import Gemma3DecoderLayer, Gemma3ForCausalLM

GEMMA2_BLOCKS = {
    **LLAMA_BLOCKS,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Gemma's RMSNorm multiplies by (1 + weight): the converter stores weight + 1.
NORM_PLUS_ONE = ValueTransform(
    applies=lambda name: name.endswith("norm.weight"),
    to_file=lambda x: x + np.float32(1),
    from_file=lambda x: x - 1.0,
)


def hf_gemma_fields(cfg: dict, where: str, gemma2: bool) -> Fields:
    """Gemma 2's and 3's config.json: windows per layer type (without `layer_types`, on all but
    every sixth layer for Gemma 3, every other layer from the first for Gemma 2), Gemma 3's
    QK-norm and local RoPE base (Gemma 2: one base), soft caps, attention and embedding scales."""
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError(
            f"{where}: bidirectional attention (embedding models) is not supported"
        )
    base = hf_decoder_fields(
        cfg, where, activation_key="hidden_activation", activation="gelu_pytorch_tanh",
        tied_by_default=True,
    )  # fmt: skip
    n_layers, head_dim = base["num_layers"], base["head_dim"]
    window = int(cfg.get("sliding_window") or 0)
    types = cfg.get("layer_types")
    if types is None:
        pattern = 2 if gemma2 else 6
        pattern = int(
            cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", pattern))
        )
        types = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(n_layers)
        ]
    params = cfg.get("rope_parameters") or {}
    rope_of = partial(hf_rope, cfg, where, head_dim, linear_scaling=not gemma2)
    if gemma2:
        rope, local_theta = rope_of(), None
    elif "full_attention" in params:  # transformers 5: RoPE per layer type
        rope = rope_of(params["full_attention"], 1_000_000.0)
        local = rope_of(params["sliding_attention"])
        if set(local) != {"rope_theta", "rotary_dim"}:
            raise ModelLoadError(f"{where}: RoPE scaling of sliding layers is not supported")
        local_theta = local["rope_theta"]
    else:
        rope = rope_of(None, 1_000_000.0)
        local_theta = float(cfg.get("rope_local_base_freq", 10000.0))
    return dict(
        **base,
        layer_windows=tuple(window if t == "sliding_attention" else 0 for t in types),
        **rope,
        rope_local_theta=local_theta,
        qk_norm=not gemma2,
        attention_scale=float(cfg.get("query_pre_attn_scalar", head_dim)) ** -0.5,
        embedding_scale=float(cfg["hidden_size"]) ** 0.5,
        attn_logit_softcapping=cfg.get("attn_logit_softcapping") or None,
        final_logit_softcapping=cfg.get("final_logit_softcapping") or None,
    )


def gguf_gemma_fields(meta: GGUFMeta, tensors: Mapping[str, Any], gemma2: bool) -> Fields:
    """Gemma 2's and 3's GGUF keys, as llama.cpp reads them: sliding windows on all but every
    sixth layer (Gemma 3) or every other layer from the first (Gemma 2; its window 4,096 unless
    the file says), or per `attention.sliding_window_pattern`; Gemma 3's QK-norm, RoPE base
    10,000 on windowed layers and linear RoPE scaling of its global ones; Gemma 2's soft-capped
    attention scores; the scales."""
    base = gguf_decoder_fields(meta, tensors, linear_rope_scaling=not gemma2)
    hidden, n_heads = base["hidden_size"], base["num_heads"]
    head_dim, n_layers = base["head_dim"], base["num_layers"]
    a = meta.arch + "."
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
        base,
        layer_windows=tuple(window if w and window else 0 for w in windowed),
        rope_local_theta=None if local_theta is None else float(local_theta),
        qk_norm=not gemma2,
        hidden_act="gelu_tanh",
        attention_scale=float(scale),
        embedding_scale=float(hidden) ** 0.5,
        attn_logit_softcapping=meta.get(a + "attn_logit_softcapping") or None,
        final_logit_softcapping=meta.get(a + "final_logit_softcapping") or None,
    )


def _final_cap(config: Mapping[str, Any]) -> list[tuple[str, Any]]:
    cap = config.get("final_logit_softcapping")
    return [("final_logit_softcapping", float(cap))] if cap else []


def gemma2_metadata(config: Mapping[str, Any]) -> list[tuple[str, Any]]:
    return [
        ("attention.sliding_window", int(config["sliding_window"])),
        ("attn_logit_softcapping", float(config["attn_logit_softcapping"])),
        *_final_cap(config),
    ]


def gemma3_metadata(config: Mapping[str, Any]) -> list[tuple[str, Any]]:
    return [
        ("attention.sliding_window", int(config["sliding_window"])),
        ("rope.freq_base_swa", float(rope_params(config, "sliding_attention")["rope_theta"])),
        *_final_cap(config),
    ]


_GEMMA3_TEXT = dict(
    rope_theta=1000000.0, rope_local_base_freq=10000.0, rms_norm_eps=1e-6, sliding_window=512,
    max_position_embeddings=32768, query_pre_attn_scalar=256, tie_word_embeddings=True,
    num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
)  # fmt: skip

GEMMA2 = ArchSpec(
    name="gemma2",
    model_class=Gemma3ForCausalLM,  # Gemma 3's layer without QK-norm, scores soft-capped
    describes="Gemma 2",
    hf_model_types=("gemma2",),
    hf_config=partial(hf_gemma_fields, gemma2=True),
    gguf_architecture="gemma2",
    gguf_config=partial(gguf_gemma_fields, gemma2=True),
    gguf_tensors=GGUFTensorMap(blocks=GEMMA2_BLOCKS, transforms=(NORM_PLUS_ONE,)),
    synth=SynthSpec(
        presets={
            "gemma-2-2b": dict(
                hidden_size=2304,
                num_hidden_layers=26,
                num_attention_heads=8,
                num_key_value_heads=4,
                head_dim=256,
                intermediate_size=9216,
                vocab_size=256000,
                rope_theta=10000.0,
                rms_norm_eps=1e-6,
                sliding_window=4096,
                max_position_embeddings=8192,
                query_pre_attn_scalar=256,
                attn_logit_softcapping=50.0,
                final_logit_softcapping=30.0,
                tie_word_embeddings=True,
            ),
        },  # fmt: skip
        # Gemma 3's 262,144-token vocabulary: Gemma 2's 256,000 are its first tokens
        tokenizer_from="gemma-3-270m",
        hf_shapes=partial(decoder_shapes, norms=Gemma3DecoderLayer.NORMS),
        metadata=gemma2_metadata,
        norm_mean=0.0,
    ),
)

GEMMA3 = ArchSpec(
    name="gemma3",
    model_class=Gemma3ForCausalLM,
    describes="Gemma 3",
    hf_model_types=("gemma3_text",),
    hf_wrapper_types=("gemma3",),  # image-text: the language model's config is text_config
    hf_config=partial(hf_gemma_fields, gemma2=False),
    gguf_architecture="gemma3",
    gguf_config=partial(gguf_gemma_fields, gemma2=False),
    gguf_tensors=GGUFTensorMap(
        blocks={**GEMMA2_BLOCKS, **QK_NORM_BLOCKS}, transforms=(NORM_PLUS_ONE,)
    ),
    synth=SynthSpec(
        presets={
            "gemma-3-1b": dict(
                _GEMMA3_TEXT, hidden_size=1152, num_hidden_layers=26, intermediate_size=6912
            ),
            "gemma-3-270m": dict(
                _GEMMA3_TEXT, hidden_size=640, num_hidden_layers=18, intermediate_size=2048
            ),
        },
        tokenizer_from="gemma-3-270m",
        hf_shapes=partial(decoder_shapes, norms=Gemma3DecoderLayer.NORMS, qk_norm=True),
        metadata=gemma3_metadata,
        norm_mean=0.0,
    ),
)

SPECS = (GEMMA2, GEMMA3)
