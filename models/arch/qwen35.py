"""Qwen3.5 (dense; `models.qwen35`): Gated DeltaNet layers and gated attention layers, 3 to 1.

Hugging Face: `qwen3_5_text` (Qwen3_5ForCausalLM), or the text model of a multimodal
`qwen3_5` checkpoint (its `text_config`; the vision tower and the multi-token-prediction head
are left out). Layers by `layer_types` ("linear_attention", "full_attention") or every
`full_attention_interval`-th (4) attending.

llama.cpp's converter (`qwen35`): every norm but the GDN output norm stored as 1 + w; A_log as
-exp(A_log); dt_bias as `ssm_dt.bias`; the conv weight squeezed to (channels, 4); and where
value heads outnumber q/k heads, the value heads of every GDN tensor reordered from grouped
(value head h reads q/k head h // (Hv / Hk)) to tiled (h % Hk): the loader keeps the file's
order and the kernels read it so (`RecurrentConfig.v_heads_tiled`). Its layers past
`block_count - nextn_predict_layers` (the multi-token-prediction head) are not run.

Qwen3.5-MoE (HF `qwen3_5_moe_text`, or the text model of a `qwen3_5_moe` checkpoint; GGUF
`qwen35moe`): the same, with a sparse MLP in every layer (softmax over the experts, the top k
renormalized; a shared expert times sigmoid of `shared_expert_gate`). The converter stacks the
experts as blk.N.ffn_{gate,up,down}_exps, keeps the router (ffn_gate_inp) and the shared
expert's gate (ffn_gate_inp_shexp) in float32, and names the shared expert ffn_*_shexp.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from models.arch.llama import LLAMA_BLOCKS, QK_NORM_BLOCKS
from models.arch.readers import GGUFMeta, gguf_decoder_fields, hf_decoder_fields, hf_rope
from models.arch.spec import ArchSpec, Fields, GGUFTensorMap, SynthSpec, ValueTransform
from models.arch.synth import head_dim, n_experts_of
from models.base import ModelLoadError
from models.config import RecurrentConfig
from models.qwen35 import Qwen35ForCausalLM, Qwen35MoeForCausalLM

QWEN35_BLOCKS = {
    **{k: v for k, v in LLAMA_BLOCKS.items() if k != "ffn_norm"},
    **QK_NORM_BLOCKS,
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.A_log",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
}

_PROJ = (
    "q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|"
    "in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|out_proj"
)
QWEN35_PROJECTIONS = re.compile(
    rf"model\.layers\.(\d+)\.(self_attn|mlp|linear_attn)\.({_PROJ})\.weight"
)
_GROUPS = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
    ("in_proj_qkv", "in_proj_z"),
    ("in_proj_b", "in_proj_a"),
)
QWEN35_FUSED = {p: g for g in _GROUPS for p in g}

QWEN35_MOE_BLOCKS = {
    **{k: v for k, v in QWEN35_BLOCKS.items() if k not in ("ffn_gate", "ffn_up", "ffn_down")},
    "ffn_gate_inp": "mlp.gate",  # the router
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
QWEN35_MOE_PROJECTIONS = re.compile(
    rf"model\.layers\.(\d+)\.(self_attn|mlp|linear_attn|mlp\.experts\.\d+|mlp\.shared_expert)\."
    rf"({_PROJ})\.weight"
)

# Zero-centred norms (x * (1 + w)) stored as 1 + w, but for the GDN output norm (a plain w).
ZERO_CENTRED_NORMS = ValueTransform(
    applies=lambda n: n.endswith("norm.weight") and not n.endswith("linear_attn.norm.weight"),
    to_file=lambda x: x + np.float32(1),
    from_file=lambda x: x - 1.0,
)
# A_log stored as A = -exp(A_log).
NEGATIVE_EXP_A = ValueTransform(
    applies=lambda n: n.endswith(".A_log"),
    to_file=lambda x: -np.exp(x),
    from_file=lambda x: (-x).log(),
)
SQUEEZED_CONV1D = ValueTransform(
    applies=lambda n: n.endswith("linear_attn.conv1d.weight"),
    to_file=lambda x: x.reshape(x.shape[0], -1),
    from_file=lambda x: x,
    file_shape=lambda shape: (shape[0], shape[-1]),
)


def _layer_types(cfg: Mapping[str, Any], n_layers: int) -> list[str]:
    types = cfg.get("layer_types")
    if types is None:
        interval = int(cfg.get("full_attention_interval") or 4)
        types = [
            "linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layers)
        ]
    return list(types)


def _gated_delta(
    layers: tuple[int, ...], k_heads: int, v_heads: int, dk: int, dv: int, kernel: int, tiled: bool
) -> RecurrentConfig:
    if v_heads % k_heads:
        raise ModelLoadError(f"{v_heads} value heads are not a multiple of {k_heads} key heads")
    return RecurrentConfig(
        kind="gated_delta",
        layers=layers,
        conv_kernel=kernel,
        num_k_heads=k_heads,
        num_v_heads=v_heads,
        k_head_dim=dk,
        v_head_dim=dv,
        v_heads_tiled=tiled and k_heads != v_heads,
    )


def hf_qwen35_fields(cfg: dict, where: str) -> Fields:
    base = hf_decoder_fields(cfg, where, eps_default=1e-6)
    n = base["num_layers"]
    types = _layer_types(cfg, n)
    unknown = set(types) - {"linear_attention", "full_attention"}
    if unknown or len(types) != n:
        raise ModelLoadError(f"{where}: layer_types {sorted(set(types))} are not supported")
    params = dict(cfg.get("rope_parameters") or {})
    params.setdefault("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    layers = tuple(i for i, t in enumerate(types) if t == "linear_attention")
    rec = _gated_delta(
        layers,
        int(cfg.get("linear_num_key_heads", 16)),
        int(cfg.get("linear_num_value_heads", 32)),
        int(cfg.get("linear_key_head_dim", 128)),
        int(cfg.get("linear_value_head_dim", 128)),
        int(cfg.get("linear_conv_kernel_dim", 4)),
        tiled=False,
    )
    return dict(
        **base,
        **hf_rope(cfg, where, base["head_dim"], params),
        qk_norm=True,
        recurrent=rec if layers else None,
    )


def gguf_qwen35_fields(meta: GGUFMeta, tensors: Mapping[str, Any], experts: bool = False) -> Fields:
    """llama.cpp's qwen35 keys: the GDN shape from `ssm.*` (state size = key head size, group
    count = key heads, time-step rank = value heads, inner size = value heads x value head
    size), recurrent layers by `attention.recurrent_layers` or `full_attention_interval`."""
    a = meta.arch + "."
    base = gguf_decoder_fields(meta, tensors, experts=experts)
    nextn = int(meta.get(a + "nextn_predict_layers") or 0)
    n = base["num_layers"] - nextn
    flags = meta.get(a + "attention.recurrent_layers")
    if flags is None:
        interval = int(meta.get(a + "full_attention_interval") or 4)
        flags = [bool((i + 1) % interval) for i in range(n)]
    layers = tuple(i for i in range(n) if flags[i])
    dk = int(meta.require(a + "ssm.state_size"))
    v_heads = int(meta.require(a + "ssm.time_step_rank"))
    rec = _gated_delta(
        layers,
        int(meta.require(a + "ssm.group_count")),
        v_heads,
        dk,
        int(meta.require(a + "ssm.inner_size")) // v_heads,
        int(meta.require(a + "ssm.conv_kernel")),
        tiled=True,
    )
    return dict(base, num_layers=n, qk_norm=True, recurrent=rec if layers else None)


def hf_qwen35_moe_fields(cfg: dict, where: str) -> Fields:
    """Qwen3.5's fields and the experts (every layer sparse, with a shared expert)."""
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    size = int(cfg["moe_intermediate_size"])
    dense = {**cfg, "intermediate_size": cfg.get("intermediate_size") or shared or size}
    return dict(
        hf_qwen35_fields(dense, where),
        num_experts=n_experts_of(cfg),
        num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        moe_intermediate_size=size,
        norm_topk_prob=True,  # (transformers' router always renormalizes)
        moe_shared_expert_size=shared,
    )


def gguf_qwen35_moe_fields(meta: GGUFMeta, tensors: Mapping[str, Any]) -> Fields:
    """The qwen35 keys and llama.cpp's expert keys (softmax gating, the top k renormalized,
    no expert weight scale); a shared expert where the file holds its tensors."""
    a = meta.arch + "."
    scale = float(meta.get(a + "expert_weights_scale") or 0.0)
    if scale not in (0.0, 1.0):
        raise ModelLoadError(f"{meta.path.name}: expert weight scale {scale} is not supported")
    shared = int(meta.get(a + "expert_shared_feed_forward_length") or 0)
    if "blk.0.ffn_up_shexp.weight" not in tensors:
        shared = 0
    elif not shared:
        shared = int(tensors["blk.0.ffn_up_shexp.weight"].shape[-1])
    size = int(meta.require(a + "expert_feed_forward_length"))
    base = gguf_qwen35_fields(meta, tensors, experts=True)
    return dict(
        base,
        intermediate_size=base["intermediate_size"] or shared or size,
        num_experts=int(meta.require(a + "expert_count")),
        num_experts_per_tok=int(meta.require(a + "expert_used_count")),
        moe_intermediate_size=size,
        norm_topk_prob=True,
        moe_shared_expert_size=shared,
    )


def qwen35_moe_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Qwen3.5's tensors with each MLP a router, the experts stacked as transformers holds them,
    and the shared expert with its gate."""
    shapes = {
        n: s
        for n, s in qwen35_shapes({**config, "intermediate_size": 1}).items()
        if ".mlp." not in n
    }
    d, n_experts = int(config["hidden_size"]), n_experts_of(config)
    eff, shared = (
        int(config["moe_intermediate_size"]),
        int(config["shared_expert_intermediate_size"]),
    )
    for i in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{i}.mlp."
        shapes[p + "gate.weight"] = (n_experts, d)
        shapes[p + "experts.gate_up_proj"] = (n_experts, 2 * eff, d)
        shapes[p + "experts.down_proj"] = (n_experts, d, eff)
        shapes[p + "shared_expert.gate_proj.weight"] = (shared, d)
        shapes[p + "shared_expert.up_proj.weight"] = (shared, d)
        shapes[p + "shared_expert.down_proj.weight"] = (d, shared)
        shapes[p + "shared_expert_gate.weight"] = (1, d)
    return shapes


def qwen35_moe_metadata(config: Mapping[str, Any]) -> list[tuple[str, Any]]:
    return qwen35_metadata(config) + [
        ("expert_count", n_experts_of(config)),
        ("expert_used_count", int(config["num_experts_per_tok"])),
        ("expert_feed_forward_length", int(config["moe_intermediate_size"])),
        ("expert_shared_feed_forward_length", int(config["shared_expert_intermediate_size"])),
    ]


def qwen35_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    d, vocab = int(config["hidden_size"]), int(config["vocab_size"])
    hd = head_dim(config)
    nq, nkv = int(config["num_attention_heads"]) * hd, int(config["num_key_value_heads"]) * hd
    ffn = int(config["intermediate_size"])
    hk, hv = int(config["linear_num_key_heads"]), int(config["linear_num_value_heads"])
    kd, vd = hk * int(config["linear_key_head_dim"]), hv * int(config["linear_value_head_dim"])
    dv = int(config["linear_value_head_dim"])
    kernel = int(config.get("linear_conv_kernel_dim", 4))
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, d),
        "model.norm.weight": (d,),
    }
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (vocab, d)
    n = int(config["num_hidden_layers"])
    for i, kind in enumerate(_layer_types(config, n)):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (d,)
        shapes[p + "post_attention_layernorm.weight"] = (d,)
        if kind == "linear_attention":
            a = p + "linear_attn."
            shapes[a + "in_proj_qkv.weight"] = (2 * kd + vd, d)
            shapes[a + "in_proj_z.weight"] = (vd, d)
            shapes[a + "in_proj_b.weight"] = (hv, d)
            shapes[a + "in_proj_a.weight"] = (hv, d)
            shapes[a + "conv1d.weight"] = (2 * kd + vd, 1, kernel)
            shapes[a + "dt_bias"] = (hv,)
            shapes[a + "A_log"] = (hv,)
            shapes[a + "norm.weight"] = (dv,)
            shapes[a + "out_proj.weight"] = (d, vd)
        else:
            a = p + "self_attn."
            shapes[a + "q_proj.weight"] = (2 * nq, d)
            shapes[a + "k_proj.weight"] = (nkv, d)
            shapes[a + "v_proj.weight"] = (nkv, d)
            shapes[a + "o_proj.weight"] = (d, nq)
            shapes[a + "q_norm.weight"] = (hd,)
            shapes[a + "k_norm.weight"] = (hd,)
        shapes[p + "mlp.gate_proj.weight"] = (ffn, d)
        shapes[p + "mlp.up_proj.weight"] = (ffn, d)
        shapes[p + "mlp.down_proj.weight"] = (d, ffn)
    return shapes


def qwen35_metadata(config: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The converter's qwen35 keys (GDN shape, layer pattern, rotated dims, RoPE sections)."""
    hv, dv = int(config["linear_num_value_heads"]), int(config["linear_value_head_dim"])
    params = dict(config.get("rope_parameters") or {})
    partial = float(params.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25)))
    sections = list(params.get("mrope_section") or [11, 11, 10]) + [0]
    return [
        ("ssm.conv_kernel", int(config.get("linear_conv_kernel_dim", 4))),
        ("ssm.state_size", int(config["linear_key_head_dim"])),
        ("ssm.group_count", int(config["linear_num_key_heads"])),
        ("ssm.time_step_rank", hv),
        ("ssm.inner_size", hv * dv),
        ("full_attention_interval", int(config.get("full_attention_interval") or 4)),
        ("rope.dimension_count", int(head_dim(config) * partial)),
        ("rope.dimension_sections", sections[:4]),
    ]


def tiled_value_heads(config: Mapping[str, Any], name: str, x: np.ndarray) -> np.ndarray:
    """The converter's reorder of a GDN tensor's value heads from grouped to tiled order (only
    where value heads outnumber key heads)."""
    hk, hv = int(config["linear_num_key_heads"]), int(config["linear_num_value_heads"])
    if hk == hv or ".linear_attn." not in name:
        return x
    dv, kd = int(config["linear_value_head_dim"]), hk * int(config["linear_key_head_dim"])
    r = hv // hk

    def reorder(t: np.ndarray, axis: int, size: int) -> np.ndarray:
        t = np.moveaxis(t, axis, 0)
        rest = t.shape[1:]
        t = t.reshape(hk, r, size, *rest).swapaxes(0, 1).reshape(hk * r * size, *rest)
        return np.moveaxis(t, 0, axis)

    if name.endswith("in_proj_qkv.weight") or name.endswith("conv1d.weight"):
        return np.concatenate([x[: 2 * kd], reorder(x[2 * kd :], 0, dv)])
    if name.endswith("in_proj_z.weight"):
        return reorder(x, 0, dv)
    if name.endswith(("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias")):
        return reorder(x, 0, 1)
    if name.endswith("out_proj.weight"):
        return reorder(x, 1, dv)
    return x


def fit_random(name: str, x: np.ndarray) -> np.ndarray:
    """Random GDN parameters in their trained range: A_log of A in (1, 16) (decays per token
    between e^-16 and e^-1 at softplus 1), dt_bias near 1."""
    if name.endswith("A_log"):
        return np.log(1.0 + 15.0 * np.abs(x) / (np.abs(x).max() + 1e-9)).astype(np.float32)
    if name.endswith("dt_bias"):
        return (1.0 + x).astype(np.float32)
    return x


_QWEN35 = dict(
    head_dim=256, num_key_value_heads=2, linear_conv_kernel_dim=4, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_num_key_heads=16, vocab_size=248320, rms_norm_eps=1e-6,
    max_position_embeddings=262144, full_attention_interval=4, tie_word_embeddings=True,
    rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25,
                         mrope_section=[11, 11, 10], mrope_interleaved=True),
)  # fmt: skip

SPECS = (
    ArchSpec(
        name="qwen3_5",
        model_class=Qwen35ForCausalLM,
        describes="Qwen3.5",
        hf_model_types=("qwen3_5_text",),
        hf_wrapper_types=("qwen3_5",),
        hf_config=hf_qwen35_fields,
        gguf_architecture="qwen35",
        gguf_config=gguf_qwen35_fields,
        gguf_tensors=GGUFTensorMap(
            blocks=QWEN35_BLOCKS,
            transforms=(ZERO_CENTRED_NORMS, NEGATIVE_EXP_A, SQUEEZED_CONV1D),
            projections=QWEN35_PROJECTIONS,
            fused=QWEN35_FUSED,
        ),
        synth=SynthSpec(
            presets={
                "qwen3.5-0.8b": dict(
                    _QWEN35,
                    hidden_size=1024,
                    num_hidden_layers=24,
                    num_attention_heads=8,
                    intermediate_size=3584,
                    linear_num_value_heads=16,
                ),
                "qwen3.5-4b": dict(
                    _QWEN35,
                    hidden_size=2560,
                    num_hidden_layers=32,
                    num_attention_heads=16,
                    num_key_value_heads=4,
                    intermediate_size=9216,
                    linear_num_value_heads=32,
                ),
            },  # fmt: skip
            hf_shapes=qwen35_shapes,
            metadata=qwen35_metadata,
            norm_mean=0.0,
            reorder=tiled_value_heads,
            random=fit_random,
        ),
    ),
    ArchSpec(
        name="qwen3_5_moe",
        model_class=Qwen35MoeForCausalLM,
        describes="Qwen3.5-MoE",
        hf_model_types=("qwen3_5_moe_text",),
        hf_wrapper_types=("qwen3_5_moe",),
        hf_config=hf_qwen35_moe_fields,
        gguf_architecture="qwen35moe",
        gguf_config=gguf_qwen35_moe_fields,
        gguf_tensors=GGUFTensorMap(
            blocks=QWEN35_MOE_BLOCKS,
            stacked_experts=True,
            transforms=(ZERO_CENTRED_NORMS, NEGATIVE_EXP_A, SQUEEZED_CONV1D),
            projections=QWEN35_MOE_PROJECTIONS,
            fused=QWEN35_FUSED,
        ),
        synth=SynthSpec(
            presets={
                # Qwen3.5-35B-A3B's layers (40 of them: ~35B parameters; --layers for fewer)
                "qwen3.5-35b-a3b": dict(
                    {k: v for k, v in _QWEN35.items() if k != "tie_word_embeddings"},
                    hidden_size=2048,
                    num_hidden_layers=40,
                    num_attention_heads=16,
                    linear_num_value_heads=32,
                    moe_intermediate_size=512,
                    shared_expert_intermediate_size=512,
                    num_experts=256,
                    num_experts_per_tok=8,
                    tie_word_embeddings=False,
                ),
            },  # fmt: skip
            hf_shapes=qwen35_moe_shapes,
            metadata=qwen35_moe_metadata,
            norm_mean=0.0,
            reorder=tiled_value_heads,
            random=fit_random,
        ),
    ),
)
