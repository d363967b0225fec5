"""Granite 4.0-H (`models.granite_hybrid`): Mamba2 layers beside a few attention layers, dense
shared MLP, Granite's multipliers, no RoPE.

Hugging Face: `granitemoehybrid`; layers by `layer_types` ("mamba" / "attention" in the
published configs, "linear_attention" / "full_attention" as transformers 5 saves them). Only the
dense checkpoints (`num_local_experts` 0: h-micro, h-1b, h-350m) load; the mixture-of-experts
ones (h-tiny, h-small) are refused by name.

llama.cpp's converter (`granitehybrid`): Mamba2 layers marked by a per-layer
`attention.head_count_kv` of 0; the shared MLP's [gate | up] split into ffn_gate / ffn_up;
A_log stored as -exp(A_log) and, like D, as (heads, 1); the gated norm's weight as (groups,
inner / groups); the conv weight squeezed to (channels, 4), its bias beside it; q/k rows
permuted for GGML's RoPE pairs (which no layer rotates); the multipliers as `embedding_scale`,
`attention.scale`, `residual_scale`, `logit_scale`; `rope.scaling.finetuned` false: no RoPE.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from models.arch.llama import LLAMA_BLOCKS
from models.arch.readers import GGUFMeta, gguf_decoder_fields, hf_decoder_fields, hf_rope
from models.arch.spec import ArchSpec, Fields, GGUFTensorMap, SynthSpec, ValueTransform
from models.arch.synth import head_dim
from models.base import ModelLoadError
from models.config import RecurrentConfig
from models.granite_hybrid import GraniteHybridForCausalLM

GRANITE_HYBRID_BLOCKS = {
    **{k: v for k, v in LLAMA_BLOCKS.items() if not k.startswith("ffn_")},
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "shared_mlp.gate_proj",
    "ffn_up": "shared_mlp.up_proj",
    "ffn_down": "shared_mlp.output_linear",
    "ssm_in": "mamba.in_proj",
    "ssm_conv1d": "mamba.conv1d",
    "ssm_dt.bias": "mamba.dt_bias",
    "ssm_a": "mamba.A_log",
    "ssm_d": "mamba.D",
    "ssm_norm": "mamba.norm",
    "ssm_out": "mamba.out_proj",
}
GRANITE_HYBRID_PROJECTIONS = re.compile(
    r"model\.layers\.(\d+)\.(self_attn|shared_mlp|mamba)\."
    r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|output_linear|in_proj|out_proj)\.weight"
)
_QKV, _GATE_UP = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")
GRANITE_HYBRID_FUSED = {**dict.fromkeys(_QKV, _QKV), **dict.fromkeys(_GATE_UP, _GATE_UP)}

# A_log stored as A = -exp(A_log), (heads, 1); D as (heads, 1).
NEGATIVE_EXP_A = ValueTransform(
    applies=lambda n: n.endswith("mamba.A_log"),
    to_file=lambda x: -np.exp(x),
    from_file=lambda x: (-x).log(),
    file_shape=lambda shape: (shape[0], 1),
)
COLUMN_D = ValueTransform(
    applies=lambda n: n.endswith("mamba.D"),
    to_file=lambda x: x,
    from_file=lambda x: x,
    file_shape=lambda shape: (shape[0], 1),
)
SQUEEZED_CONV1D = ValueTransform(
    applies=lambda n: n.endswith("mamba.conv1d.weight"),
    to_file=lambda x: x,
    from_file=lambda x: x,
    file_shape=lambda shape: (shape[0], shape[-1]),
)

MAMBA = ("mamba", "linear_attention")
ATTENTION = ("attention", "full_attention")


def layer_types(cfg: Mapping[str, Any]) -> list[str]:
    """Each layer "mamba" or "attention" (`layer_types` / `layers_block_type`, either naming);
    a list longer than the layers (a preset cut to fewer) gives its first ones."""
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or cfg.get("layers_block_type") or ["mamba"] * n
    return ["mamba" if t in MAMBA else "attention" if t in ATTENTION else t for t in types][:n]


def _mamba2(
    types: list[str], heads: int, hd: int, state: int, groups: int, kernel: int, bias: bool
) -> RecurrentConfig | None:
    layers = tuple(i for i, t in enumerate(types) if t == "mamba")
    if not layers:
        return None
    if groups < 1 or heads % groups:
        raise ModelLoadError(f"{heads} Mamba2 heads are not a multiple of {groups} groups")
    return RecurrentConfig(
        kind="mamba2",
        layers=layers,
        conv_kernel=kernel,
        num_v_heads=heads,
        v_head_dim=hd,
        state_size=state,
        num_groups=groups,
        conv_bias=bias,
    )


def _nope(types: list[str]) -> tuple[bool, ...]:
    return (True,) * len(types)


def _number(v: Any) -> float:
    """A config number (transformers 5 saves infinity as {"__float__": "Infinity"})."""
    return float(v["__float__"]) if isinstance(v, dict) and "__float__" in v else float(v)


def hf_granite_hybrid_fields(cfg: dict, where: str) -> Fields:
    if int(cfg.get("num_local_experts") or 0) > 0:
        raise ModelLoadError(
            f"{where}: Granite 4.0-H with a mixture of experts (num_local_experts "
            f"{cfg['num_local_experts']}) is not supported; the dense ones (h-micro, h-1b) are"
        )
    if cfg.get("mamba_proj_bias"):
        raise ModelLoadError(f"{where}: Mamba2 projection biases are not supported")
    limit = tuple(_number(v) for v in cfg.get("time_step_limit") or (0.0, float("inf")))
    if limit != (0.0, float("inf")):
        raise ModelLoadError(f"{where}: a Mamba2 time_step_limit {limit} is not supported")
    types = layer_types(cfg)
    if len(types) != int(cfg["num_hidden_layers"]) or set(types) - {"mamba", "attention"}:
        raise ModelLoadError(f"{where}: layer_types {sorted(set(types))} are not supported")
    hidden = int(cfg["hidden_size"])
    inner = int(cfg.get("mamba_expand", 2)) * hidden
    heads = int(cfg.get("mamba_n_heads", 128))
    hd = cfg.get("mamba_d_head", "auto")
    hd = inner // heads if hd in (None, "auto") else int(hd)
    if heads * hd != inner:
        raise ModelLoadError(f"{where}: {heads} Mamba2 heads of {hd} for an inner size {inner}")
    renamed = {**cfg, "intermediate_size": cfg.get("shared_intermediate_size", 1024)}
    base = hf_decoder_fields(renamed, where)
    rope = cfg.get("position_embedding_type") == "rope"
    return dict(
        **base,
        **(hf_rope(cfg, where, base["head_dim"]) if rope else {}),
        nope_layers=None if rope else _nope(types),
        attention_scale=float(cfg.get("attention_multiplier", 1.0)),
        embedding_scale=float(cfg.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
        logits_scaling=float(cfg.get("logits_scaling", 1.0)),
        recurrent=_mamba2(
            types,
            heads,
            hd,
            int(cfg.get("mamba_d_state", 256)),
            int(cfg.get("mamba_n_groups", 1)),
            int(cfg.get("mamba_d_conv", 4)),
            bool(cfg.get("mamba_conv_bias", True)),
        ),
    )


def gguf_granite_hybrid_fields(meta: GGUFMeta, tensors: Mapping[str, Any]) -> Fields:
    """llama.cpp's granitehybrid keys: Mamba2 layers where `attention.head_count_kv` is 0, the
    Mamba2 shape from `ssm.*` (time-step rank = heads), the shared MLP's width from
    `expert_shared_feed_forward_length` where written, the multipliers."""
    a = meta.arch + "."
    base = gguf_decoder_fields(meta, tensors, permuted_qk=True)
    n = base["num_layers"]
    n_kv = meta.get(a + "attention.head_count_kv")
    per_layer = n_kv if isinstance(n_kv, list) else [n_kv] * n
    if len(per_layer) != n:
        raise ModelLoadError(f"{meta.path.name}: head_count_kv has {len(per_layer)} entries")
    types = ["mamba" if int(k) == 0 else "attention" for k in per_layer]
    heads = int(meta.require(a + "ssm.time_step_rank"))
    inner = int(meta.require(a + "ssm.inner_size"))
    ffn = meta.get(a + "expert_shared_feed_forward_length") or base["intermediate_size"]
    first = types.index("mamba") if "mamba" in types else 0
    rope = bool(meta.get(a + "rope.scaling.finetuned", False))
    return dict(
        base,
        intermediate_size=int(ffn),
        nope_layers=None if rope else _nope(types),
        attention_scale=float(meta.get(a + "attention.scale") or 1.0),
        embedding_scale=float(meta.get(a + "embedding_scale") or 1.0),
        residual_multiplier=float(meta.get(a + "residual_scale") or 1.0),
        logits_scaling=float(meta.get(a + "logit_scale") or 1.0),
        recurrent=_mamba2(
            types,
            heads,
            inner // heads,
            int(meta.require(a + "ssm.state_size")),
            int(meta.require(a + "ssm.group_count")),
            int(meta.require(a + "ssm.conv_kernel")),
            f"blk.{first}.ssm_conv1d.bias" in tensors,
        ),
    )


def _mamba_dims(config: Mapping[str, Any]) -> tuple[int, int, int, int, int]:
    """(inner, heads, state size, groups, conv channels) of a config."""
    inner = int(config.get("mamba_expand", 2)) * int(config["hidden_size"])
    heads, state = int(config["mamba_n_heads"]), int(config["mamba_d_state"])
    groups = int(config.get("mamba_n_groups", 1))
    return inner, heads, state, groups, inner + 2 * groups * state


def granite_hybrid_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    d, vocab = int(config["hidden_size"]), int(config["vocab_size"])
    hd = head_dim(config)
    nq, nkv = int(config["num_attention_heads"]) * hd, int(config["num_key_value_heads"]) * hd
    ffn = int(config["shared_intermediate_size"])
    inner, heads, _, _, conv = _mamba_dims(config)
    kernel = int(config.get("mamba_d_conv", 4))
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, d),
        "model.norm.weight": (d,),
    }
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (vocab, d)
    for i, kind in enumerate(layer_types(config)):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (d,)
        shapes[p + "post_attention_layernorm.weight"] = (d,)
        if kind == "mamba":
            m = p + "mamba."
            shapes[m + "in_proj.weight"] = (inner + conv + heads, d)
            shapes[m + "conv1d.weight"] = (conv, 1, kernel)
            if config.get("mamba_conv_bias", True):
                shapes[m + "conv1d.bias"] = (conv,)
            shapes[m + "dt_bias"] = (heads,)
            shapes[m + "A_log"] = (heads,)
            shapes[m + "D"] = (heads,)
            shapes[m + "norm.weight"] = (inner,)
            shapes[m + "out_proj.weight"] = (d, inner)
        else:
            a = p + "self_attn."
            shapes[a + "q_proj.weight"] = (nq, d)
            shapes[a + "k_proj.weight"] = (nkv, d)
            shapes[a + "v_proj.weight"] = (nkv, d)
            shapes[a + "o_proj.weight"] = (d, nq)
        shapes[p + "shared_mlp.input_linear.weight"] = (2 * ffn, d)
        shapes[p + "shared_mlp.output_linear.weight"] = (d, ffn)
    return shapes


def granite_hybrid_metadata(config: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The converter's granitehybrid keys (GraniteMoeModel's, then Mamba2's)."""
    inner, heads, state, groups, _ = _mamba_dims(config)
    n_kv = int(config["num_key_value_heads"])
    rope = config.get("position_embedding_type") == "rope"
    keys: list[tuple[str, Any]] = [
        ("attention.head_count_kv", [0 if t == "mamba" else n_kv for t in layer_types(config)]),
        ("attention.layer_norm_rms_epsilon", float(config.get("rms_norm_eps", 1e-6))),
        ("vocab_size", int(config["vocab_size"])),
        ("rope.dimension_count", head_dim(config)),
        ("attention.scale", float(config.get("attention_multiplier", 1.0))),
        ("embedding_scale", float(config.get("embedding_multiplier", 1.0))),
        ("residual_scale", float(config.get("residual_multiplier", 1.0))),
        ("logit_scale", float(config.get("logits_scaling", 1.0))),
        ("expert_shared_feed_forward_length", int(config["shared_intermediate_size"])),
        ("ssm.conv_kernel", int(config.get("mamba_d_conv", 4))),
        ("ssm.state_size", state),
        ("ssm.group_count", groups),
        ("ssm.inner_size", inner),
        ("ssm.time_step_rank", heads),
        ("rope.scaling.finetuned", rope),
    ]
    if not rope:
        keys.append(("context_length", 2**20))
    return keys


Values = tuple[tuple[int, ...], Callable[[], np.ndarray]]


def granite_hybrid_tensor(
    config: Mapping[str, Any], shape_of: Callable[[str], tuple[int, ...]],
    read: Callable[[str], np.ndarray], hf_name: str,
) -> dict[str, Values] | None:  # fmt: skip
    """The converter's own conversions: the shared MLP's [gate | up] split in two, the gated
    norm's weight as (groups, inner / groups). None for the tensors the name map converts."""
    parts = hf_name.split(".")
    if len(parts) < 4 or parts[0] != "model" or parts[1] != "layers":
        return None
    blk, rest = f"blk.{parts[2]}.", ".".join(parts[3:])
    if rest == "shared_mlp.input_linear.weight":
        f2, d = shape_of(hf_name)
        f = f2 // 2
        return {
            f"{blk}ffn_gate.weight": ((f, d), lambda: read(hf_name)[:f]),
            f"{blk}ffn_up.weight": ((f, d), lambda: read(hf_name)[f:]),
        }
    if rest == "mamba.norm.weight":
        groups = int(config.get("mamba_n_groups", 1))
        (inner,) = shape_of(hf_name)
        shape = (groups, inner // groups)
        return {f"{blk}ssm_norm.weight": (shape, lambda: read(hf_name).reshape(shape))}
    return None


def fit_random(name: str, x: np.ndarray) -> np.ndarray:
    """Random Mamba2 parameters in their trained range: A_log of A in (1, 16), dt_bias near 1
    (softplus about 1.3), D near 1."""
    if name.endswith("A_log"):
        return np.log(1.0 + 15.0 * np.abs(x) / (np.abs(x).max() + 1e-9)).astype(np.float32)
    if name.endswith(("dt_bias", ".D")):
        return (1.0 + x).astype(np.float32)
    return x


# granite-4.0-h-micro (ibm-granite/granite-4.0-h-micro): 40 layers, the attention ones at 5, 15,
# 25 and 35, the shapes and multipliers of ../shared/families-2026.md; residual_multiplier,
# rms_norm_eps, vocab_size and the context are the published config's as recalled (no hub here)
_H_MICRO = dict(
    hidden_size=2048, num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8,
    intermediate_size=8192, shared_intermediate_size=8192, num_local_experts=0,
    vocab_size=100352, rms_norm_eps=1e-5, max_position_embeddings=131072,
    tie_word_embeddings=True, position_embedding_type="nope", rope_theta=10000.0,
    embedding_multiplier=12.0, attention_multiplier=0.015625, residual_multiplier=0.22,
    logits_scaling=8.0, mamba_n_heads=64, mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1,
    mamba_d_conv=4, mamba_expand=2, mamba_conv_bias=True, mamba_proj_bias=False,
    layer_types=["attention" if i % 10 == 5 else "mamba" for i in range(40)],
)  # fmt: skip

SPECS = (
    ArchSpec(
        name="granitehybrid",
        model_class=GraniteHybridForCausalLM,
        describes="Granite 4.0-H",
        hf_model_types=("granitemoehybrid",),
        hf_config=hf_granite_hybrid_fields,
        gguf_architecture="granitehybrid",
        gguf_config=gguf_granite_hybrid_fields,
        gguf_tensors=GGUFTensorMap(
            blocks=GRANITE_HYBRID_BLOCKS,
            permuted_qk=True,
            transforms=(NEGATIVE_EXP_A, COLUMN_D, SQUEEZED_CONV1D),
            projections=GRANITE_HYBRID_PROJECTIONS,
            fused=GRANITE_HYBRID_FUSED,
        ),
        synth=SynthSpec(
            presets={"granite-4.0-h-micro": _H_MICRO},
            hf_shapes=granite_hybrid_shapes,
            metadata=granite_hybrid_metadata,
            tensor=granite_hybrid_tensor,
            random=fit_random,
        ),
    ),
)
