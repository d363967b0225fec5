"""Qwen3: the Llama decoder with QK-norm (an RMSNorm over each q and k head before RoPE),
unpermuted q/k rows in GGUF."""

from __future__ import annotations

from functools import partial

from models.arch.llama import LLAMA_BLOCKS, QK_NORM_BLOCKS
from models.arch.readers import (
    gguf_decoder_fields,
    hf_decoder_fields,
    hf_layer_type_windows,
    hf_rope,
)
from models.arch.spec import ArchSpec, Fields, GGUFTensorMap, SynthSpec
from models.arch.synth import decoder_shapes
from models.llama import LlamaForCausalLM


def hf_qwen3_fields(cfg: dict, where: str) -> Fields:
    base = hf_decoder_fields(cfg, where)
    return dict(
        **base,
        **hf_rope(cfg, where, base["head_dim"]),
        qk_norm=True,
        layer_windows=hf_layer_type_windows(cfg, base["num_layers"]),
    )


SPECS = (
    ArchSpec(
        name="qwen3",
        model_class=LlamaForCausalLM,
        describes="Qwen3",
        hf_model_types=("qwen3",),
        hf_config=hf_qwen3_fields,
        gguf_architecture="qwen3",
        gguf_config=lambda meta, tensors: {**gguf_decoder_fields(meta, tensors), "qk_norm": True},
        gguf_tensors=GGUFTensorMap(blocks={**LLAMA_BLOCKS, **QK_NORM_BLOCKS}),
        synth=SynthSpec(
            presets={
                "qwen3-0.6b": dict(
                    hidden_size=1024,
                    num_hidden_layers=28,
                    num_attention_heads=16,
                    num_key_value_heads=8,
                    head_dim=128,
                    intermediate_size=3072,
                    vocab_size=151936,
                    rope_theta=1000000.0,
                    rms_norm_eps=1e-6,
                    tie_word_embeddings=True,
                    max_position_embeddings=40960,
                ),
            },  # fmt: skip
            hf_shapes=partial(decoder_shapes, qk_norm=True),
        ),
    ),
)
