"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B, Qwen3-235B-A22B): Qwen3's attention with a
sparse MLP in every layer (`models.moe`); in GGUF its experts' projections stacked, one tensor
(experts, rows, in) per projection and layer."""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

from models.arch.llama import LLAMA_BLOCKS, QK_NORM_BLOCKS
from models.arch.readers import (
    GGUFMeta,
    gguf_decoder_fields,
    hf_decoder_fields,
    hf_layer_type_windows,
    hf_rope,
)
from models.arch.spec import ArchSpec, Fields, GGUFTensorMap, SynthSpec
from models.arch.synth import decoder_shapes, n_experts_of
from models.base import ModelLoadError
from models.moe import MoeForCausalLM


def hf_qwen3_moe_fields(cfg: dict, where: str) -> Fields:
    """Qwen3's fields and the experts; refused unless every layer's MLP is sparse (as in every
    published Qwen3-MoE: decoder_sparse_step 1, no mlp_only_layers)."""
    base = hf_decoder_fields(cfg, where)
    n_layers = base["num_layers"]
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    if step != 1 or dense & set(range(n_layers)):
        raise ModelLoadError(f"{where}: dense MLP layers among the sparse ones are not supported")
    return dict(
        **base,
        **hf_rope(cfg, where, base["head_dim"]),
        qk_norm=True,
        layer_windows=hf_layer_type_windows(cfg, n_layers),
        # (transformers 5 writes num_local_experts; the published configs num_experts)
        num_experts=int(cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"]),
        num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
    )


def gguf_qwen3_moe_fields(meta: GGUFMeta, tensors: Mapping[str, Any]) -> Fields:
    """The experts as llama.cpp reads them: the router's top-k weights always renormalized (its
    qwen3moe graph fixes that), no expert weight scale."""
    a = meta.arch + "."
    base = gguf_decoder_fields(meta, tensors, experts=True)
    scale = float(meta.get(a + "expert_weights_scale") or 0.0)
    if scale not in (0.0, 1.0):
        raise ModelLoadError(f"{meta.path.name}: expert weight scale {scale} is not supported")
    used = int(meta.require(a + "expert_used_count"))
    size = meta.get(a + "expert_feed_forward_length")
    if size is None:  # (llama.cpp's fallback for files without it)
        size = int(meta.require(a + "feed_forward_length")) // used
    return dict(
        base,
        qk_norm=True,
        num_experts=int(meta.require(a + "expert_count")),
        num_experts_per_tok=used,
        moe_intermediate_size=int(size),
        norm_topk_prob=True,
    )


def moe_metadata(config: Mapping[str, Any]) -> list[tuple[str, Any]]:
    return [
        ("expert_count", n_experts_of(config)),
        ("expert_used_count", int(config["num_experts_per_tok"])),
        ("expert_feed_forward_length", int(config["moe_intermediate_size"])),
    ]


SPECS = (
    ArchSpec(
        name="qwen3_moe",
        model_class=MoeForCausalLM,
        describes="Qwen3-MoE",
        hf_model_types=("qwen3_moe",),
        hf_config=hf_qwen3_moe_fields,
        gguf_architecture="qwen3moe",
        gguf_config=gguf_qwen3_moe_fields,
        gguf_tensors=GGUFTensorMap(
            blocks={**LLAMA_BLOCKS, **QK_NORM_BLOCKS, "ffn_gate_inp": "mlp.gate"},  # the router
            stacked_experts=True,
        ),
        synth=SynthSpec(
            presets={
                "qwen3-30b-a3b": dict(
                    hidden_size=2048,
                    num_hidden_layers=48,
                    num_attention_heads=32,
                    num_key_value_heads=4,
                    head_dim=128,
                    intermediate_size=6144,
                    moe_intermediate_size=768,
                    num_experts=128,
                    num_experts_per_tok=8,
                    norm_topk_prob=True,
                    vocab_size=151936,
                    rope_theta=1000000.0,
                    rms_norm_eps=1e-6,
                    tie_word_embeddings=False,
                    max_position_embeddings=40960,
                ),
            },  # fmt: skip
            hf_shapes=partial(decoder_shapes, qk_norm=True, experts=True),
            metadata=moe_metadata,
        ),
    ),
)
