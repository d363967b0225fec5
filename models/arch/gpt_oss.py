"""gpt-oss (gpt-oss-20b, gpt-oss-120b; Hugging Face `gpt_oss`, GGUF `gpt-oss`): `models.gpt_oss`'s
layer. Its config readers (attention biases on q/k/v and o, sinks, windows of 128 on even layers,
YaRN, a mixture of experts with a biased router, top-k-then-softmax gating, biased experts and
the clamped SwiGLU), its GGUF tensor map (llama.cpp's converter splits the experts' interleaved
gate/up into ffn_gate_exps / ffn_up_exps, and names the sinks attn_sinks.weight), and
tools.synth_model's preset and conversion (the experts written as the converter writes them; in
MXFP4 with `--format MXFP4_MOE`, as the published GGUFs hold them). Hugging Face checkpoints with
MXFP4 experts (as published) load through `models.gpt_oss.Mxfp4Checkpoint`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from models.arch.readers import GGUFMeta, gguf_decoder_fields, hf_decoder_fields, hf_rope
from models.arch.spec import ArchSpec, Fields, GGUFTensorMap, SynthSpec
from models.arch.synth import head_dim, n_experts_of
from models.base import ModelLoadError
from models.decoder import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT
from models.gpt_oss import GptOssForCausalLM, hf_checkpoint

GPT_OSS_BLOCKS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_sinks": "self_attn.sinks",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_gate_inp": "mlp.router",
}


def _layer_windows(window: int, sliding: list[bool]) -> tuple[int, ...]:
    return tuple(window if s and window else 0 for s in sliding)


def _moe_fields(n_experts: int, used: int, size: int) -> Fields:
    return dict(
        num_experts=n_experts,
        num_experts_per_tok=used,
        moe_intermediate_size=size,
        moe_gating="topk_softmax",
        moe_router_bias=True,
        mlp_bias=True,
        hidden_act="swiglu_oai",
        attention_sinks=True,
    )


def hf_gpt_oss_fields(cfg: dict, where: str) -> Fields:
    """transformers' GptOssConfig: biases on q/k/v and o (`attention_bias`, true in every
    published config), `layer_types` (even layers sliding by default), YaRN from the RoPE
    parameters; the clamped SwiGLU's constants must be gpt-oss's (the kernels hold them)."""
    alpha, limit = float(cfg.get("swiglu_alpha", 1.702)), float(cfg.get("swiglu_limit", 7.0))
    if not (math.isclose(alpha, SWIGLU_OAI_ALPHA) and math.isclose(limit, SWIGLU_OAI_LIMIT)):
        raise ModelLoadError(f"{where}: swiglu alpha {alpha} / limit {limit} are not supported")
    biased = bool(cfg.get("attention_bias", True))
    base = hf_decoder_fields({**cfg, "attention_bias": False}, where, eps_default=1e-5)
    n_layers = base["num_layers"]
    types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)
    ]
    window = int(cfg.get("sliding_window") or 0)
    size = int(cfg["intermediate_size"])
    return dict(
        base,
        **hf_rope(cfg, where, base["head_dim"], default_theta=150000.0),
        attention_bias=biased,
        attention_out_bias=biased,
        layer_windows=_layer_windows(window, [t == "sliding_attention" for t in types]),
        **_moe_fields(n_experts_of(cfg), int(cfg["num_experts_per_tok"]), size),
    )


def gguf_gpt_oss_fields(meta: GGUFMeta, tensors: Mapping[str, Any]) -> Fields:
    """llama.cpp's openai-moe reading: windows (`attention.sliding_window`) on even layers (or
    per `attention.sliding_window_pattern`), YaRN as ggml runs it (the readers'), experts' sizes
    from the expert keys; gating, act and biases fixed by its graph."""
    a = meta.arch + "."
    base = gguf_decoder_fields(meta, tensors, experts=True)
    n_layers = base["num_layers"]
    window = int(meta.get(a + "attention.sliding_window") or 0)
    pattern = meta.get(a + "attention.sliding_window_pattern", 2)
    if isinstance(pattern, list):
        if len(pattern) != n_layers:
            raise ModelLoadError(
                f"{meta.path.name}: sliding_window_pattern has {len(pattern)} entries for "
                f"{n_layers} layers"
            )
        sliding = [bool(f) for f in pattern]
    else:
        n = int(pattern)
        sliding = [n == 0 or i % n < n - 1 for i in range(n_layers)]
    swa_base = meta.get(a + "rope.freq_base_swa")
    if swa_base is not None and float(swa_base) != base["rope_theta"]:
        raise ModelLoadError(f"{meta.path.name}: a RoPE base of its own on windowed layers")
    if "blk.0.attn_sinks.weight" not in tensors:
        raise ModelLoadError(f"{meta.path.name}: no attention sinks (blk.0.attn_sinks.weight)")
    return dict(
        base,
        attention_out_bias="blk.0.attn_output.bias" in tensors,
        layer_windows=_layer_windows(window, sliding),
        **_moe_fields(
            int(meta.require(a + "expert_count")),
            int(meta.require(a + "expert_used_count")),
            int(meta.require(a + "expert_feed_forward_length")),
        ),
    )


# -- tools.synth_model ----------------------------------------------------------------------------


def gpt_oss_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """The Hugging Face checkpoint's tensors (float; the experts stacked as transformers holds
    them: gate_up_proj (experts, d, 2 f) with gate and up interleaved by column)."""
    d, hd = int(config["hidden_size"]), head_dim(config)
    nq, nkv = int(config["num_attention_heads"]) * hd, int(config["num_key_value_heads"]) * hd
    n_experts, f = n_experts_of(config), int(config["intermediate_size"])
    vocab = int(config["vocab_size"])
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, d),
        "model.norm.weight": (d,),
        "lm_head.weight": (vocab, d),
    }
    for i in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (nq, d),
            p + "self_attn.q_proj.bias": (nq,),
            p + "self_attn.k_proj.weight": (nkv, d),
            p + "self_attn.k_proj.bias": (nkv,),
            p + "self_attn.v_proj.weight": (nkv, d),
            p + "self_attn.v_proj.bias": (nkv,),
            p + "self_attn.o_proj.weight": (d, nq),
            p + "self_attn.o_proj.bias": (d,),
            p + "self_attn.sinks": (int(config["num_attention_heads"]),),
            p + "mlp.router.weight": (n_experts, d),
            p + "mlp.router.bias": (n_experts,),
            p + "mlp.experts.gate_up_proj": (n_experts, d, 2 * f),
            p + "mlp.experts.gate_up_proj_bias": (n_experts, 2 * f),
            p + "mlp.experts.down_proj": (n_experts, f, d),
            p + "mlp.experts.down_proj_bias": (n_experts, d),
        })  # fmt: skip
    return shapes


def gpt_oss_metadata(config: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The converter's keys beyond every decoder's: experts, the window, YaRN."""
    rope = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    keys: list[tuple[str, Any]] = [
        ("expert_count", n_experts_of(config)),
        ("expert_used_count", int(config["num_experts_per_tok"])),
        ("expert_feed_forward_length", int(config["intermediate_size"])),
        ("attention.sliding_window", int(config["sliding_window"])),
    ]
    if rope.get("rope_type") == "yarn":
        keys += [
            ("rope.scaling.type", "yarn"),
            ("rope.scaling.factor", float(rope["factor"])),
            ("rope.scaling.original_context_length", int(rope["original_max_position_embeddings"])),
        ]
        keys += [
            (f"rope.scaling.yarn_{k}", float(rope[k]))
            for k in ("beta_fast", "beta_slow")
            if k in rope
        ]
    return keys


Values = tuple[tuple[int, ...], Callable[[], np.ndarray]]


def gpt_oss_tensor(
    config: Mapping[str, Any], shape_of: Callable[[str], tuple[int, ...]],
    read: Callable[[str], np.ndarray], hf_name: str,
) -> dict[str, Values] | None:  # fmt: skip
    """The converter's own conversions (`conversion/gpt_oss.py`): the stacked experts transposed
    to (experts, rows, in) and gate/up de-interleaved into ffn_gate_exps / ffn_up_exps (their
    biases likewise), the sinks as attn_sinks.weight. None for the tensors the generic name map
    converts."""
    parts = hf_name.split(".")
    if len(parts) < 4 or parts[0] != "model" or parts[1] != "layers":
        return None
    blk, rest = f"blk.{parts[2]}.", ".".join(parts[3:])
    shape = shape_of(hf_name)
    if rest == "self_attn.sinks":
        return {f"{blk}attn_sinks.weight": (shape, lambda: read(hf_name))}
    if rest == "mlp.experts.down_proj":  # (E, f, d) -> (E, d, f)
        e, f, d = shape
        return {f"{blk}ffn_down_exps.weight": ((e, d, f), lambda: read(hf_name).transpose(0, 2, 1))}
    if rest == "mlp.experts.down_proj_bias":
        return {f"{blk}ffn_down_exps.bias": (shape, lambda: read(hf_name))}
    if rest == "mlp.experts.gate_up_proj":  # (E, d, 2f) -> gate, up (E, f, d)
        e, d, f2 = shape
        return {
            f"{blk}ffn_gate_exps.weight": (
                (e, f2 // 2, d),
                lambda: read(hf_name)[..., 0::2].transpose(0, 2, 1),
            ),
            f"{blk}ffn_up_exps.weight": (
                (e, f2 // 2, d),
                lambda: read(hf_name)[..., 1::2].transpose(0, 2, 1),
            ),
        }
    if rest == "mlp.experts.gate_up_proj_bias":
        e, f2 = shape
        return {
            f"{blk}ffn_gate_exps.bias": ((e, f2 // 2), lambda: read(hf_name)[..., 0::2]),
            f"{blk}ffn_up_exps.bias": ((e, f2 // 2), lambda: read(hf_name)[..., 1::2]),
        }
    return None


SPECS = (
    ArchSpec(
        name="gpt_oss",
        model_class=GptOssForCausalLM,
        describes="gpt-oss",
        hf_model_types=("gpt_oss",),
        hf_config=hf_gpt_oss_fields,
        hf_quantizations=("mxfp4",),  # the published checkpoints' experts
        hf_checkpoint=hf_checkpoint,
        gguf_architecture="gpt-oss",
        gguf_config=gguf_gpt_oss_fields,
        gguf_tensors=GGUFTensorMap(blocks=GPT_OSS_BLOCKS, stacked_experts=True),
        synth=SynthSpec(
            presets={
                # 24 layers of 32 experts: ~12 GB in MXFP4_MOE, 21B parameters
                "gpt-oss-20b": dict(
                    hidden_size=2880,
                    num_hidden_layers=24,
                    num_attention_heads=64,
                    num_key_value_heads=8,
                    head_dim=64,
                    intermediate_size=2880,
                    num_local_experts=32,
                    num_experts_per_tok=4,
                    vocab_size=201088,
                    rms_norm_eps=1e-5,
                    sliding_window=128,
                    tie_word_embeddings=False,
                    max_position_embeddings=131072,
                    rope_theta=150000.0,
                    rope_scaling={
                        "rope_type": "yarn",
                        "factor": 32.0,
                        "beta_fast": 32.0,
                        "beta_slow": 1.0,
                        "truncate": False,
                        "original_max_position_embeddings": 4096,
                    },
                    attention_bias=True,
                    swiglu_limit=7.0,
                ),
            },  # fmt: skip
            hf_shapes=gpt_oss_shapes,
            metadata=gpt_oss_metadata,
            tensor=gpt_oss_tensor,
        ),
    ),
)
