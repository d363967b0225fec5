"""SmolLM3: the Llama decoder without RoPE on every fourth layer (NoPE), q/k rows permuted in
GGUF as for "llama"."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from models.arch.llama import LLAMA_BLOCKS, permuted_metadata
from models.arch.readers import (
    GGUFMeta,
    gguf_decoder_fields,
    hf_decoder_fields,
    hf_layer_type_windows,
    hf_rope,
)
from models.arch.spec import ArchSpec, Fields, GGUFTensorMap, SynthSpec
from models.arch.synth import decoder_shapes, llama3_rope_freqs
from models.llama import LlamaForCausalLM

# llama.cpp's SmolLM3: every fourth layer has no RoPE (a constant there, not a file key).
NOPE_EVERY = 4


def _nope_layers(cfg: dict, n_layers: int) -> tuple[bool, ...]:
    """SmolLM3's layers without RoPE: its `no_rope_layers` flags (1: the layer rotates), else
    one every `no_rope_layer_interval` layers (4), as transformers fills them in."""
    flags = cfg.get("no_rope_layers")
    if flags is None:
        every = int(cfg.get("no_rope_layer_interval") or NOPE_EVERY)
        flags = [int((i + 1) % every != 0) for i in range(n_layers)]
    return tuple(not f for f in flags)


def hf_smollm3_fields(cfg: dict, where: str) -> Fields:
    base = hf_decoder_fields(cfg, where)
    n = base["num_layers"]
    return dict(
        **base,
        **hf_rope(cfg, where, base["head_dim"]),
        layer_windows=hf_layer_type_windows(cfg, n),
        nope_layers=_nope_layers(cfg, n),
    )


def gguf_smollm3_fields(meta: GGUFMeta, tensors: Mapping[str, Any]) -> Fields:
    fields = gguf_decoder_fields(meta, tensors, permuted_qk=True)
    n = fields["num_layers"]
    return {**fields, "nope_layers": tuple((i + 1) % NOPE_EVERY == 0 for i in range(n))}


SPECS = (
    ArchSpec(
        name="smollm3",
        model_class=LlamaForCausalLM,
        describes="SmolLM3",
        hf_model_types=("smollm3",),
        hf_config=hf_smollm3_fields,
        gguf_architecture="smollm3",
        gguf_config=gguf_smollm3_fields,
        gguf_tensors=GGUFTensorMap(blocks=LLAMA_BLOCKS, permuted_qk=True),
        synth=SynthSpec(
            presets={
                # its NoPE layers (every fourth) are the architecture's, as llama.cpp fixes them
                "smollm3-3b": dict(
                    hidden_size=2048,
                    num_hidden_layers=36,
                    num_attention_heads=16,
                    num_key_value_heads=4,
                    intermediate_size=11008,
                    vocab_size=128256,
                    rope_theta=5000000.0,
                    rms_norm_eps=1e-6,
                    tie_word_embeddings=True,
                    max_position_embeddings=65536,
                ),
            },  # fmt: skip
            hf_shapes=decoder_shapes,
            metadata=permuted_metadata,
            tensors=llama3_rope_freqs,
        ),
    ),
)
