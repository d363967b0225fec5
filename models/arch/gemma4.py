"""Gemma 4 (text; and the language model of a multimodal Gemma 4 checkpoint, in `text_config`):
`models.gemma4` on the E2B / E4B shapes. Sliding-window layers (256-dim heads, RoPE base 10,000
over the whole head) and global ones (512-dim heads, "proportional" RoPE: base 1,000,000 over the
first quarter of the frequencies), the last layers sharing the K/V of the last earlier layer of
their kind, per-layer input embeddings, plain RMSNorm weights (llama.cpp's converter stores them
as they are), attention scale 1.0, logits soft-capped.

Not read: the mixture-of-experts block (26B-A4B) and V = K global layers (31B), refused by name.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from models.arch.gemma import GEMMA2_BLOCKS
from models.arch.llama import QK_NORM_BLOCKS
from models.arch.readers import GGUFMeta, gguf_decoder_fields, hf_decoder_fields
from models.arch.spec import GLOBAL_NAMES, ArchSpec, Fields, GGUFTensorMap, SynthSpec
from models.base import ModelLoadError
from models.gemma4 import PLE_NORM, PLE_PROJECTION, PLE_TABLE, Gemma4ForCausalLM

SLIDING, FULL = "sliding_attention", "full_attention"
# transformers' defaults (Gemma4TextConfig) for what a config.json may leave out
_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}

GEMMA4_BLOCKS = {
    **GEMMA2_BLOCKS,
    **QK_NORM_BLOCKS,
    "inp_gate": "per_layer_input_gate",
    "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
    "layer_output_scale.weight": "layer_scalar",  # (the converter names it with .weight)
}
# The decoder's projections and each layer's per-layer-input gate and projection: all multiplied
# in the file's blocks.
GEMMA4_PROJECTIONS = re.compile(
    r"model\.layers\.(\d+)\.(self_attn\.|mlp\.)?"
    r"(\w+_proj|per_layer_input_gate|per_layer_projection)\.weight"
)
GEMMA4_GLOBALS = {
    **GLOBAL_NAMES,
    "per_layer_token_embd.weight": PLE_TABLE,
    "per_layer_model_proj.weight": PLE_PROJECTION,
    "per_layer_proj_norm.weight": PLE_NORM,
}


def default_layer_types(n_layers: int) -> list[str]:
    """transformers' pattern: five sliding layers, then a global one; the last always global."""
    types = [SLIDING if (i + 1) % 6 else FULL for i in range(n_layers)]
    types[-1] = FULL
    return types


def kv_sources(types: list[str], n_shared: int, where: str) -> tuple[int, ...] | None:
    """Each layer's K/V source: the last `n_shared` layers read the last earlier layer of their
    own kind (transformers' `kv_sharing_modes`), the others their own. None when none share."""
    n = len(types)
    if not n_shared:
        return None
    first = n - n_shared
    if first <= 0:
        raise ModelLoadError(f"{where}: {n_shared} KV-shared layers of {n} leave none to share")
    sources = list(range(n))
    for i in range(first, n):
        owners = [j for j in range(first) if types[j] == types[i]]
        if not owners:
            raise ModelLoadError(
                f"{where}: layer {i} ({types[i]}) shares K/V, but no earlier layer of its kind "
                "has its own"
            )
        sources[i] = owners[-1]
    return tuple(sources)


def layer_shapes(
    cfg: Mapping[str, Any], types: list[str], head_dim: int, kv_heads: int
) -> tuple[list[int], list[int]]:
    """Each layer's head size and kv heads: `per_layer_config` (as transformers 5 saves a
    config), else the global layers' `global_head_dim` (512 by default)."""
    overrides = cfg.get("per_layer_config")
    if overrides is None:
        glob = {"head_dim": int(cfg.get("global_head_dim") or 512)}
        overrides = {i: glob for i, t in enumerate(types) if t == FULL}
    per = [dict(overrides.get(str(i)) or overrides.get(i) or {}) for i in range(len(types))]
    return (
        [int(p.get("head_dim", head_dim)) for p in per],
        [int(p.get("num_key_value_heads", kv_heads)) for p in per],
    )


def proportional_factors(head_dim: int, partial: float) -> tuple[float, ...]:
    """ "proportional" RoPE as llama.cpp's frequency factors: the first int(partial * head_dim / 2)
    frequencies (exponents over the whole head) as they are, the rest divided by infinity (0:
    those values pass unrotated; llama.cpp's converter writes 1e30)."""
    rotated = int(partial * head_dim // 2)
    return (1.0,) * rotated + (float("inf"),) * (head_dim // 2 - rotated)


def _per_layer(values: list[int]) -> tuple[int, ...] | None:
    return None if len(set(values)) <= 1 else tuple(values)


def hf_gemma4_fields(cfg: dict, where: str) -> Fields:
    """Gemma 4's config.json (transformers' `Gemma4TextConfig` and its defaults): layer types,
    the global layers' head size (`global_head_dim`, or `per_layer_config` as transformers 5
    saves it), RoPE per layer type, KV sharing, the double-wide MLP, per-layer inputs."""
    if cfg.get("use_bidirectional_attention") == "all":
        raise ModelLoadError(
            f"{where}: bidirectional attention (embedding models) is not supported"
        )
    if cfg.get("enable_moe_block"):
        raise ModelLoadError(f"{where}: Gemma 4's mixture-of-experts block is not supported")
    if cfg.get("attention_k_eq_v"):
        raise ModelLoadError(
            f"{where}: global layers with V = K (attention_k_eq_v) are not supported"
        )
    base = hf_decoder_fields(
        cfg, where, activation_key="hidden_activation", activation="gelu_pytorch_tanh",
        tied_by_default=True,
    )  # fmt: skip
    n, hd, kv = base["num_layers"], base["head_dim"], base["num_kv_heads"]
    types = list(cfg.get("layer_types") or default_layer_types(n))
    if len(types) != n or set(types) - {SLIDING, FULL}:
        raise ModelLoadError(f"{where}: layer_types must be {n} of {SLIDING!r} / {FULL!r}")
    types[-1] = FULL  # (as transformers forces it)
    head_dims, kv_heads = layer_shapes(cfg, types, hd, kv)
    full_dims = {d for d, t in zip(head_dims, types, strict=True) if t == FULL}
    if len(full_dims) != 1 or {d for d, t in zip(head_dims, types, strict=True) if t == SLIDING} - {
        hd
    }:
        raise ModelLoadError(f"{where}: the layers of each kind must share one head size")
    (full_dim,) = full_dims
    rope = {**_ROPE, **(cfg.get("rope_parameters") or {})}
    local, glob = rope[SLIDING], rope[FULL]
    if (
        local.get("rope_type", "default") != "default"
        or local.get("partial_rotary_factor", 1.0) != 1
    ):
        raise ModelLoadError(f"{where}: RoPE {local} on sliding layers is not supported")
    kind = glob.get("rope_type", "default")
    if kind not in ("default", "proportional") or float(glob.get("factor", 1.0)) != 1.0:
        raise ModelLoadError(f"{where}: RoPE {glob} on global layers is not supported")
    factors = None
    if kind == "proportional":
        factors = proportional_factors(full_dim, float(glob.get("partial_rotary_factor", 1.0)))
    sources = kv_sources(types, int(cfg.get("num_kv_shared_layers") or 0), where)
    ffn = base["intermediate_size"]
    widths = [ffn] * n
    if cfg.get("use_double_wide_mlp") and sources is not None:
        widths = [ffn if sources[i] == i else 2 * ffn for i in range(n)]
    window = int(cfg.get("sliding_window") or 512)
    per_layer = int(cfg.get("hidden_size_per_layer_input", 256) or 0)
    return dict(
        base,
        layer_head_dims=_per_layer(head_dims),
        layer_kv_heads=_per_layer(kv_heads),
        kv_sources=sources,
        layer_intermediate_sizes=_per_layer(widths),
        layer_windows=tuple(window if t == SLIDING else 0 for t in types),
        rope_theta=float(glob.get("rope_theta", 1_000_000.0)),
        rope_local_theta=float(local.get("rope_theta", 10_000.0)),
        rope_freq_factors=factors,
        qk_norm=True,
        v_norm=True,
        attention_scale=1.0,
        embedding_scale=float(cfg["hidden_size"]) ** 0.5,
        final_logit_softcapping=cfg.get("final_logit_softcapping") or None,
        per_layer_input_size=per_layer,
        per_layer_vocab_size=int(cfg.get("vocab_size_per_layer_input") or base["vocab_size"])
        if per_layer
        else 0,
    )


class _MetaWith(GGUFMeta):
    """A file's metadata with some keys read otherwise (per-layer arrays as their first value,
    for the readers every decoder shares)."""

    def __init__(self, meta: GGUFMeta, values: Mapping[str, Any]) -> None:
        super().__init__(meta.reader, meta.path)
        self.values = dict(values)

    def get(self, key: str, default: Any = None) -> Any:
        return self.values[key] if key in self.values else super().get(key, default)


def gguf_gemma4_fields(meta: GGUFMeta, tensors: Mapping[str, Any]) -> Fields:
    """Gemma 4's GGUF keys as llama.cpp reads them: head sizes (`key_length` the global layers',
    `key_length_swa` the sliding ones'), per-layer FFN widths and kv heads (arrays), the
    sliding-window pattern (one flag a layer), the shared-KV layer count, the global layers'
    RoPE factors (`rope_freqs`), the per-layer input width."""
    a, where = meta.arch + ".", meta.path.name
    n = int(meta.require(a + "block_count"))
    n_heads = int(meta.require(a + "attention.head_count"))

    def per_layer(key: str, default: Any) -> list[int]:
        value = meta.get(a + key, default)
        if value is None:
            raise ModelLoadError(f"{where}: GGUF metadata has no {a + key}")
        values = [int(v) for v in value] if isinstance(value, list) else [int(value)] * n
        if len(values) != n:
            raise ModelLoadError(f"{where}: {a + key} has {len(values)} entries for {n} layers")
        return values

    widths = per_layer("feed_forward_length", None)
    kv_heads = per_layer("attention.head_count_kv", n_heads)
    scalars = {a + "feed_forward_length": widths[0], a + "attention.head_count_kv": kv_heads[0]}
    base = gguf_decoder_fields(_MetaWith(meta, scalars), tensors)
    full_dim = base["head_dim"]
    swa_dim = int(meta.get(a + "attention.key_length_swa", full_dim))
    if int(meta.get(a + "attention.value_length_swa", swa_dim)) != swa_dim:
        raise ModelLoadError(f"{where}: different key and value head sizes are not supported")
    if int(meta.get(a + "rope.dimension_count_swa", swa_dim)) != swa_dim:
        raise ModelLoadError(
            f"{where}: partial rotary embeddings on sliding layers are not supported"
        )
    pattern = meta.require(a + "attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) != n:
        raise ModelLoadError(f"{where}: attention.sliding_window_pattern must be a flag per layer")
    types = [SLIDING if flag else FULL for flag in pattern]
    window = int(meta.require(a + "attention.sliding_window"))
    sources = kv_sources(types, int(meta.get(a + "attention.shared_kv_layers", 0) or 0), where)
    factors = base["rope_freq_factors"]
    if factors is not None and len(factors) != full_dim // 2:
        raise ModelLoadError(
            f"{where}: rope_freqs has {len(factors)} factors for {full_dim}-dim heads"
        )
    per_layer_input = int(meta.get(a + "embedding_length_per_layer_input", 0) or 0)
    table = tensors.get("per_layer_token_embd.weight")
    if per_layer_input and table is None:
        raise ModelLoadError(f"{where}: per-layer inputs without a per_layer_token_embd table")
    hidden = base["hidden_size"]
    return dict(
        base,
        head_dim=swa_dim,
        num_kv_heads=kv_heads[0],
        intermediate_size=widths[0],
        layer_head_dims=_per_layer([swa_dim if t == SLIDING else full_dim for t in types]),
        layer_kv_heads=_per_layer(kv_heads),
        kv_sources=sources,
        layer_intermediate_sizes=_per_layer(widths),
        layer_windows=tuple(window if t == SLIDING else 0 for t in types),
        rope_local_theta=float(meta.get(a + "rope.freq_base_swa", 10_000.0)),
        qk_norm=True,
        v_norm=True,
        hidden_act="gelu_tanh",
        attention_scale=1.0,
        embedding_scale=float(hidden) ** 0.5,
        final_logit_softcapping=meta.get(a + "final_logit_softcapping") or None,
        per_layer_input_size=per_layer_input,
        per_layer_vocab_size=int(table.shape[1]) if per_layer_input else 0,
    )


# -- tools.synth_model ---------------------------------------------------------------------------


def _types(config: Mapping[str, Any]) -> list[str]:
    types = list(config.get("layer_types") or default_layer_types(int(config["num_hidden_layers"])))
    types[-1] = FULL
    return types


def _shapes(config: Mapping[str, Any]) -> tuple[list[int], list[int]]:
    """Each layer's (head sizes, kv heads)."""
    kv = int(config["num_key_value_heads"])
    return layer_shapes(config, _types(config), int(config["head_dim"]), kv)


def _global_dim(config: Mapping[str, Any]) -> int:
    dims, _ = _shapes(config)
    return next(d for d, t in zip(dims, _types(config), strict=True) if t == FULL)


def _sources(config: Mapping[str, Any]) -> list[int]:
    types = _types(config)
    shared = kv_sources(types, int(config.get("num_kv_shared_layers") or 0), "config")
    return list(range(len(types))) if shared is None else list(shared)


def _widths(config: Mapping[str, Any]) -> list[int]:
    ffn = int(config["intermediate_size"])
    double = bool(config.get("use_double_wide_mlp"))
    return [ffn if s == i or not double else 2 * ffn for i, s in enumerate(_sources(config))]


def gemma4_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """A Gemma 4 text checkpoint's tensors as transformers' class holds them (shared layers
    without k/v projections or k norms)."""
    d, vocab = int(config["hidden_size"]), int(config["vocab_size"])
    n, heads = int(config["num_hidden_layers"]), int(config["num_attention_heads"])
    p = int(config.get("hidden_size_per_layer_input") or 0)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, d)}
    if p:
        shapes[PLE_TABLE] = (int(config.get("vocab_size_per_layer_input") or vocab), n * p)
        shapes[PLE_PROJECTION] = (n * p, d)
        shapes[PLE_NORM] = (p,)
    shapes["model.norm.weight"] = (d,)
    sources, widths = _sources(config), _widths(config)
    head_dims, kv_heads = _shapes(config)
    for i in range(n):
        pre = f"model.layers.{i}."
        hd, kv = head_dims[i], kv_heads[i]
        shapes[pre + "input_layernorm.weight"] = (d,)
        shapes[pre + "self_attn.q_proj.weight"] = (heads * hd, d)
        if sources[i] == i:
            shapes[pre + "self_attn.k_proj.weight"] = (kv * hd, d)
            shapes[pre + "self_attn.v_proj.weight"] = (kv * hd, d)
            shapes[pre + "self_attn.k_norm.weight"] = (hd,)
        shapes[pre + "self_attn.q_norm.weight"] = (hd,)
        shapes[pre + "self_attn.o_proj.weight"] = (d, heads * hd)
        shapes[pre + "post_attention_layernorm.weight"] = (d,)
        shapes[pre + "pre_feedforward_layernorm.weight"] = (d,)
        shapes[pre + "mlp.gate_proj.weight"] = (widths[i], d)
        shapes[pre + "mlp.up_proj.weight"] = (widths[i], d)
        shapes[pre + "mlp.down_proj.weight"] = (d, widths[i])
        shapes[pre + "post_feedforward_layernorm.weight"] = (d,)
        if p:
            shapes[pre + "per_layer_input_gate.weight"] = (p, d)
            shapes[pre + "per_layer_projection.weight"] = (d, p)
            shapes[pre + "post_per_layer_input_norm.weight"] = (d,)
        shapes[pre + "layer_scalar"] = (1,)
    return shapes


def gemma4_metadata(config: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The keys llama.cpp's Gemma 4 converter writes beyond every decoder's (these replace the
    common ones of the same name: the global head size, per-layer FFN widths)."""
    types, widths = _types(config), _widths(config)
    rope = {**_ROPE, **(config.get("rope_parameters") or {})}
    swa_dim, full_dim = int(config["head_dim"]), _global_dim(config)
    keys: list[tuple[str, Any]] = [
        ("rope.freq_base", float(rope[FULL]["rope_theta"])),
        ("rope.freq_base_swa", float(rope[SLIDING]["rope_theta"])),
        ("attention.key_length", full_dim),
        ("attention.value_length", full_dim),
        ("attention.key_length_swa", swa_dim),
        ("attention.value_length_swa", swa_dim),
        ("rope.dimension_count", full_dim),
        ("rope.dimension_count_swa", swa_dim),
        ("attention.sliding_window", int(config.get("sliding_window") or 512)),
        ("attention.sliding_window_pattern", [t == SLIDING for t in types]),
        ("attention.shared_kv_layers", int(config.get("num_kv_shared_layers") or 0)),
        ("embedding_length_per_layer_input", int(config.get("hidden_size_per_layer_input") or 0)),
    ]
    if len(set(widths)) > 1:
        keys.append(("feed_forward_length", widths))
    _, kv_heads = _shapes(config)
    if len(set(kv_heads)) > 1:
        keys.append(("attention.head_count_kv", kv_heads))
    if config.get("final_logit_softcapping"):
        keys.append(("final_logit_softcapping", float(config["final_logit_softcapping"])))
    return keys


def gemma4_rope_freqs(config: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The global layers' "proportional" RoPE as the converter writes it: factors 1 for the
    rotated frequencies, 1e30 for the rest."""
    rope = {**_ROPE, **(config.get("rope_parameters") or {})}[FULL]
    full_dim = _global_dim(config)
    rotated = int(float(rope.get("partial_rotary_factor", 1.0)) * full_dim // 2)
    values = [1.0] * rotated + [1e30] * (full_dim // 2 - rotated)
    return {"rope_freqs.weight": np.asarray(values, dtype=np.float32)}


def gemma4_fit(config: dict[str, Any]) -> dict[str, Any]:
    """A preset with another layer count: its pattern (a global layer every `period`, the last
    global) over the new count, about the same share of KV-shared layers (fewer if the layers
    before them would lack a layer of either kind to own the K/V), and a per-layer table of the
    vocabulary's rows."""
    n, types = int(config["num_hidden_layers"]), config.get("layer_types")
    out = dict(config)
    if config.get("hidden_size_per_layer_input"):
        out["vocab_size_per_layer_input"] = int(config["vocab_size"])
    if types is None or len(types) == n:
        return out
    period = types.index(FULL) + 1 if FULL in types else 6
    fitted = [FULL if (i + 1) % period == 0 else SLIDING for i in range(n)]
    fitted[-1] = FULL
    shared = round(int(config.get("num_kv_shared_layers") or 0) * n / len(types))
    while shared and not {SLIDING, FULL} <= set(fitted[: n - shared]):
        shared -= 1
    return {**out, "layer_types": fitted, "num_kv_shared_layers": shared}


_E2B = dict(
    hidden_size=1536, num_hidden_layers=35, num_attention_heads=8, num_key_value_heads=1,
    head_dim=256, global_head_dim=512, intermediate_size=6144, vocab_size=262144,
    layer_types=[FULL if i % 5 == 4 else SLIDING for i in range(35)],
    num_kv_shared_layers=20, use_double_wide_mlp=True, hidden_size_per_layer_input=256,
    vocab_size_per_layer_input=262144, sliding_window=512, final_logit_softcapping=30.0,
    rope_parameters=_ROPE, max_position_embeddings=131072, rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)  # fmt: skip
_E4B = dict(
    _E2B, hidden_size=2560, num_hidden_layers=42, num_key_value_heads=2,
    intermediate_size=10240, layer_types=default_layer_types(42), num_kv_shared_layers=18,
    use_double_wide_mlp=False,
)  # fmt: skip

GEMMA4 = ArchSpec(
    name="gemma4",
    model_class=Gemma4ForCausalLM,
    describes="Gemma 4 (E2B, E4B)",
    hf_model_types=("gemma4_text",),
    hf_wrapper_types=("gemma4",),  # multimodal: the language model's config is text_config
    hf_config=hf_gemma4_fields,
    gguf_architecture="gemma4",
    gguf_config=gguf_gemma4_fields,
    gguf_tensors=GGUFTensorMap(
        blocks=GEMMA4_BLOCKS, globals=GEMMA4_GLOBALS, projections=GEMMA4_PROJECTIONS
    ),
    synth=SynthSpec(
        presets={"gemma-4-e2b": _E2B, "gemma-4-e4b": _E4B},
        tokenizer_from="gemma-3-270m",  # (Gemma 4's own is not fetchable; the same 262,144 rows)
        hf_shapes=gemma4_shapes,
        metadata=gemma4_metadata,
        tensors=gemma4_rope_freqs,
        scales=("layer_scalar",),
        fit=gemma4_fit,
    ),
)

SPECS = (GEMMA4,)
