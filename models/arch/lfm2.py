"""LFM2 (Liquid AI's LFM2-350M, -700M, -1.2B, -2.6B): attention layers among gated short
convolutions (`models.lfm2`). Hugging Face marks the layers by `layer_types` ("conv",
"full_attention") or `full_attn_idxs`; llama.cpp's converter by a per-layer
`attention.head_count_kv` that is 0 on conv layers, and writes the MLP size after LFM2's own
adjustment (2/3 of `block_ff_dim`, rounded up to a multiple of 256, where the config says so).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from models.arch.readers import GGUFMeta, gguf_decoder_fields, hf_decoder_fields, hf_rope
from models.arch.spec import (
    GLOBAL_NAMES,
    ArchSpec,
    Fields,
    GGUFTensorMap,
    SynthSpec,
    ValueTransform,
)
from models.arch.synth import head_dim
from models.base import ModelLoadError
from models.config import RecurrentConfig
from models.lfm2 import Lfm2ForCausalLM

LFM2_BLOCKS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.out_proj",
    "attn_q_norm": "self_attn.q_layernorm",
    "attn_k_norm": "self_attn.k_layernorm",
    "attn_norm": "operator_norm",
    "ffn_norm": "ffn_norm",
    "ffn_gate": "feed_forward.w1",
    "ffn_up": "feed_forward.w3",
    "ffn_down": "feed_forward.w2",
    "shortconv.in_proj": "conv.in_proj",
    "shortconv.conv": "conv.conv",
    "shortconv.out_proj": "conv.out_proj",
}
# the final norm: llama.cpp names it after the embedding (the checkpoint's embedding_norm)
LFM2_GLOBALS = {
    **{k: v for k, v in GLOBAL_NAMES.items() if k != "output_norm.weight"},
    "token_embd_norm.weight": "model.embedding_norm.weight",
}
QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("w1", "w3")
# The converter squeezes the depthwise conv's (C, 1, L) weight to (C, L).
SQUEEZED_CONV = ValueTransform(
    applies=lambda name: name.endswith("conv.conv.weight"),
    to_file=lambda x: x.reshape(x.shape[0], -1),
    from_file=lambda x: x,
    file_shape=lambda shape: (shape[0], shape[-1]),
)


def ffn_size(cfg: Mapping[str, Any]) -> int:
    """The MLP's width as LFM2 computes it (`block_auto_adjust_ff_dim`: 2/3 of the configured
    size, times `block_ffn_dim_multiplier`, rounded up to `block_multiple_of`)."""
    ff = int(cfg.get("block_ff_dim") or cfg["intermediate_size"])
    if cfg.get("block_auto_adjust_ff_dim", True):
        ff = int(2 * ff / 3)
        multiplier = cfg.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is not None:
            ff = int(multiplier * ff)
        multiple = int(cfg.get("block_multiple_of", 256))
        ff = multiple * ((ff + multiple - 1) // multiple)
    return ff


def layer_types(cfg: Mapping[str, Any]) -> list[str]:
    """The kind per layer, "conv" or "full_attention" (`layer_types`, else `full_attn_idxs`);
    a list longer than the layers (a preset cut to fewer layers) gives its first ones."""
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        idxs = cfg.get("full_attn_idxs")
        attn = set(range(n)) if idxs is None else set(idxs)
        types = ["full_attention" if i in attn else "conv" for i in range(n)]
    return list(types)[:n]


def hf_lfm2_fields(cfg: dict, where: str) -> Fields:
    if cfg.get("conv_bias"):
        raise ModelLoadError(f"{where}: LFM2 convolutions with a bias are not supported")
    types = layer_types(cfg)
    if len(types) != int(cfg["num_hidden_layers"]):
        raise ModelLoadError(f"{where}: {len(types)} layer_types for more layers")
    unknown = set(types) - {"conv", "full_attention"}
    if unknown:
        raise ModelLoadError(f"{where}: LFM2 layer types {sorted(unknown)} are not supported")
    tied = cfg.get("tie_word_embeddings", cfg.get("tie_embedding", True))
    renamed = {
        **cfg,
        "intermediate_size": ffn_size(cfg),
        "rms_norm_eps": cfg.get("norm_eps", 1e-5),
        "tie_word_embeddings": tied,
        "max_position_embeddings": cfg.get("max_position_embeddings", 128_000),
    }
    base = hf_decoder_fields(renamed, where)
    return dict(
        **base,
        **hf_rope(cfg, where, base["head_dim"], default_theta=1_000_000.0),
        qk_norm=True,
        recurrent=_recurrent(types, int(cfg.get("conv_L_cache", 3))),
    )


def _recurrent(types: list[str], l_cache: int) -> RecurrentConfig | None:
    conv = tuple(i for i, t in enumerate(types) if t == "conv")
    if not conv:
        return None
    return RecurrentConfig(kind="short_conv", layers=conv, conv_kernel=l_cache)


def gguf_lfm2_fields(meta: GGUFMeta, tensors: Mapping[str, Any]) -> Fields:
    base = gguf_decoder_fields(meta, tensors)
    a = meta.arch + "."
    n_kv = meta.get(a + "attention.head_count_kv")
    n = base["num_layers"]
    per_layer = n_kv if isinstance(n_kv, list) else [n_kv] * n
    if len(per_layer) != n:
        raise ModelLoadError(f"{meta.path.name}: head_count_kv has {len(per_layer)} entries")
    types = ["conv" if int(k) == 0 else "full_attention" for k in per_layer]
    l_cache = int(meta.require(a + "shortconv.l_cache"))
    return dict(base, qk_norm=True, recurrent=_recurrent(types, l_cache))


def lfm2_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    d, vocab = int(config["hidden_size"]), int(config["vocab_size"])
    hd = head_dim(config)
    nq, nkv = int(config["num_attention_heads"]) * hd, int(config["num_key_value_heads"]) * hd
    ffn = ffn_size(config)
    l_cache = int(config.get("conv_L_cache", 3))
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, d),
        "model.embedding_norm.weight": (d,),
    }
    if not config.get("tie_word_embeddings", True):
        shapes["lm_head.weight"] = (vocab, d)
    for i, kind in enumerate(layer_types(config)):
        p = f"model.layers.{i}."
        shapes[p + "operator_norm.weight"] = (d,)
        shapes[p + "ffn_norm.weight"] = (d,)
        if kind == "conv":
            shapes[p + "conv.in_proj.weight"] = (3 * d, d)
            shapes[p + "conv.conv.weight"] = (d, 1, l_cache)
            shapes[p + "conv.out_proj.weight"] = (d, d)
        else:
            shapes[p + "self_attn.q_proj.weight"] = (nq, d)
            shapes[p + "self_attn.k_proj.weight"] = (nkv, d)
            shapes[p + "self_attn.v_proj.weight"] = (nkv, d)
            shapes[p + "self_attn.out_proj.weight"] = (d, nq)
            shapes[p + "self_attn.q_layernorm.weight"] = (hd,)
            shapes[p + "self_attn.k_layernorm.weight"] = (hd,)
        shapes[p + "feed_forward.w1.weight"] = (ffn, d)
        shapes[p + "feed_forward.w3.weight"] = (ffn, d)
        shapes[p + "feed_forward.w2.weight"] = (d, ffn)
    return shapes


def lfm2_metadata(config: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The converter's LFM2 keys: per-layer KV heads (0: a conv layer), the adjusted MLP size,
    the conv width, its norm epsilon."""
    n_kv = int(config["num_key_value_heads"])
    return [
        ("attention.head_count_kv", [0 if t == "conv" else n_kv for t in layer_types(config)]),
        ("feed_forward_length", ffn_size(config)),
        ("vocab_size", int(config["vocab_size"])),
        ("shortconv.l_cache", int(config.get("conv_L_cache", 3))),
        ("attention.layer_norm_rms_epsilon", float(config.get("norm_eps", 1e-5))),
    ]


_LFM2 = dict(
    num_hidden_layers=16, num_key_value_heads=8, vocab_size=65536, norm_eps=1e-5,
    rope_theta=1000000.0, max_position_embeddings=128000, tie_word_embeddings=True,
    conv_L_cache=3, conv_bias=False, block_multiple_of=256, block_ffn_dim_multiplier=1.0,
    block_auto_adjust_ff_dim=True,
    layer_types=["conv", "conv", "full_attention", "conv", "conv", "full_attention", "conv",
                 "conv", "full_attention", "conv", "full_attention", "conv", "full_attention",
                 "conv", "full_attention", "conv"],
)  # fmt: skip

SPECS = (
    ArchSpec(
        name="lfm2",
        model_class=Lfm2ForCausalLM,
        describes="LFM2",
        hf_model_types=("lfm2",),
        hf_config=hf_lfm2_fields,
        gguf_architecture="lfm2",
        gguf_config=gguf_lfm2_fields,
        gguf_tensors=GGUFTensorMap(
            blocks=LFM2_BLOCKS,
            globals=LFM2_GLOBALS,
            transforms=(SQUEEZED_CONV,),
            projections=re.compile(
                r"model\.layers\.(\d+)\.(self_attn|conv|feed_forward)\."
                r"(q_proj|k_proj|v_proj|out_proj|in_proj|w1|w2|w3)\.weight"
            ),
            fused={**dict.fromkeys(QKV, QKV), **dict.fromkeys(GATE_UP, GATE_UP)},
        ),
        synth=SynthSpec(
            presets={
                # (published configs: the MLP size before LFM2's adjustment, 6656 -> 4608 and
                # 12288 -> 8192)
                "lfm2-350m": dict(
                    _LFM2, hidden_size=1024, num_attention_heads=16, intermediate_size=6656
                ),
                "lfm2-1.2b": dict(
                    _LFM2, hidden_size=2048, num_attention_heads=32, intermediate_size=12288
                ),
            },
            hf_shapes=lfm2_shapes,
            metadata=lfm2_metadata,
        ),
    ),
)
