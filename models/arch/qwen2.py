"""Qwen2 / Qwen2.5: the Llama decoder with biases on the q/k/v projections (always there, never
on o_proj), unpermuted q/k rows in GGUF (NEOX RoPE: halves of each head)."""

from __future__ import annotations

from functools import partial

from models.arch.llama import LLAMA_BLOCKS
from models.arch.readers import (
    gguf_decoder_fields,
    hf_decoder_fields,
    hf_layer_type_windows,
    hf_rope,
)
from models.arch.spec import ArchSpec, Fields, GGUFTensorMap, SynthSpec
from models.arch.synth import decoder_shapes
from models.llama import LlamaForCausalLM


def hf_qwen2_fields(cfg: dict, where: str) -> Fields:
    base = hf_decoder_fields(cfg, where, qkv_bias=True)
    return dict(
        **base,
        **hf_rope(cfg, where, base["head_dim"]),
        layer_windows=hf_layer_type_windows(cfg, base["num_layers"]),
    )


SPECS = (
    ArchSpec(
        name="qwen2",
        model_class=LlamaForCausalLM,
        describes="Qwen2/2.5",
        hf_model_types=("qwen2",),
        hf_config=hf_qwen2_fields,
        gguf_architecture="qwen2",
        gguf_config=gguf_decoder_fields,
        gguf_tensors=GGUFTensorMap(blocks=LLAMA_BLOCKS),
        synth=SynthSpec(
            presets={
                "qwen2.5-0.5b": dict(
                    hidden_size=896,
                    num_hidden_layers=24,
                    num_attention_heads=14,
                    num_key_value_heads=2,
                    intermediate_size=4864,
                    vocab_size=151936,
                    rope_theta=1000000.0,
                    rms_norm_eps=1e-6,
                    tie_word_embeddings=True,
                    max_position_embeddings=32768,
                ),
            },  # fmt: skip
            hf_shapes=partial(decoder_shapes, qkv_bias=True),
        ),
    ),
)
