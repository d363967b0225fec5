"""LFM2 (Liquid AI's LFM2-350M, -700M, -1.2B, -2.6B): attention layers among gated short
convolutions (`models.lfm2`). Hugging Face marks the layers by `layer_types` ("conv",
"full_attention") or `full_attn_idxs`; llama.cpp's converter by a per-layer
`attention.head_count_kv` that is 0 on conv layers, and writes the MLP size after LFM2's own
adjustment (2/3 of `block_ff_dim`, rounded up to a multiple of 256, where the config says so).

LFM2-MoE (HF `lfm2_moe`, GGUF `lfm2moe`; LFM2-8B-A1B, LFM2-24B-A2B): the same layers, the MLP
of every layer after the first `num_dense_layers` sparse (sigmoid gating steered by an expert
bias). Its MLP size is `intermediate_size` as it stands (no adjustment). The converter stacks the
experts as blk.N.ffn_{gate,up,down}_exps, writes the router as ffn_gate_inp (float32) and the
expert bias as exp_probs_b.bias, and the keys `leading_dense_block_count` and
`expert_gating_func` (2: sigmoid).
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
from models.arch.synth import head_dim, n_experts_of
from models.base import ModelLoadError
from models.config import RecurrentConfig
from models.lfm2 import Lfm2ForCausalLM, Lfm2MoeForCausalLM

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


def gguf_lfm2_fields(meta: GGUFMeta, tensors: Mapping[str, Any], experts: bool = False) -> Fields:
    base = gguf_decoder_fields(meta, tensors, experts=experts)
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
    dense = int(config.get("num_dense_layers", 1 << 30)) if "num_experts" in config else 1 << 30
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
        if (
            i >= dense
        ):  # the router, the expert bias, the experts stacked as transformers holds them
            n_experts, eff = n_experts_of(config), int(config["moe_intermediate_size"])
            f = p + "feed_forward."
            shapes[f + "gate.weight"] = (n_experts, d)
            shapes[f + "expert_bias"] = (n_experts,)
            shapes[f + "experts.gate_up_proj"] = (n_experts, 2 * eff, d)
            shapes[f + "experts.down_proj"] = (n_experts, d, eff)
            continue
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


# -- LFM2-MoE ----------------------------------------------------------------------------------------

LFM2_MOE_BLOCKS = {
    **{k: v for k, v in LFM2_BLOCKS.items() if k not in ("ffn_gate", "ffn_up", "ffn_down")},
    "ffn_gate": "feed_forward.w1",  # (the dense leading layers)
    "ffn_up": "feed_forward.w3",
    "ffn_down": "feed_forward.w2",
    "ffn_gate_inp": "feed_forward.gate",  # the router
    "exp_probs_b.bias": "feed_forward.expert_bias",
}
LFM2_MOE_EXPERTS = {
    p: f"feed_forward.experts.{{e}}.{w}" for p, w in (("gate", "w1"), ("up", "w3"), ("down", "w2"))
}
SIGMOID_GATING = 2  # (llama.cpp's expert_gating_func: 1 softmax, 2 sigmoid)


def _moe_dense(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """LFM2-MoE's config with its MLP size taken as it stands (no LFM2 adjustment)."""
    return {**cfg, "block_ff_dim": None, "block_auto_adjust_ff_dim": False}


def hf_lfm2_moe_fields(cfg: dict, where: str) -> Fields:
    return dict(
        hf_lfm2_fields(_moe_dense(cfg), where),
        num_experts=n_experts_of(cfg),
        num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        moe_gating="sigmoid",
        moe_expert_bias=bool(cfg.get("use_expert_bias", True)),
        moe_routed_scale=float(cfg.get("routed_scaling_factor") or 1.0),
        moe_dense_layers=int(cfg.get("num_dense_layers", 2)),
    )


def gguf_lfm2_moe_fields(meta: GGUFMeta, tensors: Mapping[str, Any]) -> Fields:
    """llama.cpp's lfm2moe reading: sigmoid gating (the only one it runs), the expert bias,
    the top k renormalized, `expert_weights_scale` where set."""
    a = meta.arch + "."
    gating = int(meta.get(a + "expert_gating_func") or SIGMOID_GATING)
    if gating != SIGMOID_GATING:
        raise ModelLoadError(f"{meta.path.name}: expert gating function {gating} is not sigmoid")
    dense = int(meta.get(a + "leading_dense_block_count") or 0)
    scale = float(meta.get(a + "expert_weights_scale") or 0.0)
    return dict(
        gguf_lfm2_fields(meta, tensors, experts=True),
        num_experts=int(meta.require(a + "expert_count")),
        num_experts_per_tok=int(meta.require(a + "expert_used_count")),
        moe_intermediate_size=int(meta.require(a + "expert_feed_forward_length")),
        norm_topk_prob=True,
        moe_gating="sigmoid",
        moe_expert_bias=f"blk.{dense}.exp_probs_b.bias" in tensors,
        moe_routed_scale=scale or 1.0,
        moe_dense_layers=dense,
    )


def lfm2_moe_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    return lfm2_shapes(_moe_dense(config))


def lfm2_moe_metadata(config: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """LFM2's keys (the MLP size as it stands) and the converter's expert keys."""
    return lfm2_metadata(_moe_dense(config)) + [
        ("expert_count", n_experts_of(config)),
        ("expert_used_count", int(config["num_experts_per_tok"])),
        ("expert_feed_forward_length", int(config["moe_intermediate_size"])),
        ("leading_dense_block_count", int(config.get("num_dense_layers", 2))),
        ("expert_gating_func", SIGMOID_GATING),
    ]


def lfm2_moe_tensor(config, shape_of, read, hf_name: str):  # noqa: ANN001, ANN201
    """The stacked experts as the converter writes them: gate_up_proj (experts, 2 f, d) split
    into ffn_gate_exps and ffn_up_exps, down_proj as ffn_down_exps; None for other tensors."""
    parts = hf_name.split(".")
    if len(parts) != 6 or parts[3:5] != ["feed_forward", "experts"]:
        return None
    blk = f"blk.{parts[2]}."
    shape = shape_of(hf_name)
    if parts[5] == "down_proj":
        return {f"{blk}ffn_down_exps.weight": (shape, lambda: read(hf_name))}
    e, f2, d = shape
    return {
        f"{blk}ffn_gate_exps.weight": ((e, f2 // 2, d), lambda: read(hf_name)[:, : f2 // 2]),
        f"{blk}ffn_up_exps.weight": ((e, f2 // 2, d), lambda: read(hf_name)[:, f2 // 2 :]),
    }


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
    ArchSpec(
        name="lfm2_moe",
        model_class=Lfm2MoeForCausalLM,
        describes="LFM2-MoE",
        hf_model_types=("lfm2_moe",),
        hf_config=hf_lfm2_moe_fields,
        gguf_architecture="lfm2moe",
        gguf_config=gguf_lfm2_moe_fields,
        gguf_tensors=GGUFTensorMap(
            blocks=LFM2_MOE_BLOCKS,
            globals=LFM2_GLOBALS,
            stacked_experts=True,
            expert_names=LFM2_MOE_EXPERTS,
            transforms=(SQUEEZED_CONV,),
            projections=re.compile(
                r"model\.layers\.(\d+)\.(self_attn|conv|feed_forward|feed_forward\.experts\.\d+)\."
                r"(q_proj|k_proj|v_proj|out_proj|in_proj|w1|w2|w3)\.weight"
            ),
            fused={**dict.fromkeys(QKV, QKV), **dict.fromkeys(GATE_UP, GATE_UP)},
        ),
        synth=SynthSpec(
            presets={
                # LFM2-8B-A1B: 24 layers (6 attention), the first two dense, 32 experts of 1792
                "lfm2-8b-a1b": dict(
                    _LFM2,
                    hidden_size=2048,
                    num_hidden_layers=24,
                    num_attention_heads=32,
                    intermediate_size=7168,
                    moe_intermediate_size=1792,
                    num_experts=32,
                    num_experts_per_tok=4,
                    num_dense_layers=2,
                    use_expert_bias=True,
                    norm_topk_prob=True,
                    routed_scaling_factor=1.0,
                    block_auto_adjust_ff_dim=False,
                    layer_types=[
                        "full_attention" if i in (2, 6, 10, 14, 18, 21) else "conv"
                        for i in range(24)
                    ],
                ),
            },  # fmt: skip
            hf_shapes=lfm2_moe_shapes,
            metadata=lfm2_moe_metadata,
            tensor=lfm2_moe_tensor,
        ),
    ),
)
