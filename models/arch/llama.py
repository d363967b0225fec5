"""The Llama architecture (Llama 1/2/3, SmolLM2, and what llama.cpp converts to "llama": Mistral
too) and Mistral's Hugging Face checkpoints: the Llama decoder (`models.llama`) as it is.

Also the GGUF tensor names every Llama-shaped family starts from (`LLAMA_BLOCKS`).
"""

from __future__ import annotations

from models.arch.readers import gguf_decoder_fields, hf_decoder_fields, hf_rope
from models.arch.spec import ArchSpec, Fields, GGUFTensorMap, SynthSpec
from models.arch.synth import decoder_shapes, head_dim, llama3_rope_freqs
from models.llama import LlamaForCausalLM

# llama.cpp's per-layer tensor names -> Hugging Face's (below "blk.N." / "model.layers.N.").
LLAMA_BLOCKS = {
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
QK_NORM_BLOCKS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


def permuted_metadata(config) -> list[tuple[str, int]]:
    """Keys llama.cpp's converter writes for the architectures whose q/k rows it permutes."""
    return [("vocab_size", int(config["vocab_size"])), ("rope.dimension_count", head_dim(config))]


def hf_llama_fields(cfg: dict, where: str) -> Fields:
    base = hf_decoder_fields(cfg, where)
    return {**base, **hf_rope(cfg, where, base["head_dim"])}


def hf_mistral_fields(cfg: dict, where: str) -> Fields:
    fields = hf_llama_fields(cfg, where)
    # Mistral's sliding window equals full attention for contexts no longer than the window, so
    # cap the context there instead of computing something else beyond it.
    window = cfg.get("sliding_window")
    if window:
        fields["max_position_embeddings"] = min(fields["max_position_embeddings"], int(window))
    return fields


LLAMA = ArchSpec(
    name="llama",
    model_class=LlamaForCausalLM,
    describes="Llama 1/2/3, SmolLM2 and other checkpoints llama.cpp converts to llama",
    hf_model_types=("llama",),
    hf_config=hf_llama_fields,
    gguf_architecture="llama",
    gguf_config=lambda meta, tensors: gguf_decoder_fields(meta, tensors, permuted_qk=True),
    gguf_tensors=GGUFTensorMap(blocks=LLAMA_BLOCKS, permuted_qk=True),
    synth=SynthSpec(
        presets={
            "smollm2-360m": dict(
                hidden_size=960,
                num_hidden_layers=32,
                num_attention_heads=15,
                num_key_value_heads=5,
                intermediate_size=2560,
                vocab_size=49152,
                rope_theta=100000.0,
                rms_norm_eps=1e-5,
                tie_word_embeddings=True,
                max_position_embeddings=8192,
            ),
            "llama-3.2-1b": dict(
                hidden_size=2048,
                num_hidden_layers=16,
                num_attention_heads=32,
                num_key_value_heads=8,
                head_dim=64,
                intermediate_size=8192,
                vocab_size=128256,
                rope_theta=500000.0,
                rms_norm_eps=1e-5,
                tie_word_embeddings=True,
                max_position_embeddings=131072,
                rope_scaling=dict(
                    rope_type="llama3",
                    factor=32.0,
                    low_freq_factor=1.0,
                    high_freq_factor=4.0,
                    original_max_position_embeddings=8192,
                ),
            ),
        },  # fmt: skip
        hf_shapes=decoder_shapes,
        metadata=permuted_metadata,
        tensors=llama3_rope_freqs,
    ),
)

MISTRAL = ArchSpec(
    name="mistral",
    model_class=LlamaForCausalLM,
    describes="Mistral",
    hf_model_types=("mistral",),
    hf_config=hf_mistral_fields,
)

SPECS = (LLAMA, MISTRAL)
