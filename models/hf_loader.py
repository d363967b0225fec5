"""Loading Hugging Face model directories into their `models.registry` class.

Owns: turning a `config.json` (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, Qwen3-MoE, Phi-3, SmolLM, Gemma 3 text
and the text half of a multimodal Gemma 3; both the transformers 4 `rope_theta`/`rope_scaling`
and the transformers 5 `rope_parameters` spellings) into a `ModelConfig`, reading
`*.safetensors` weights (sharded or not), the EOS ids from config.json, generation_config.json and
the tokenizer, and checking tensor names against what the model class takes
(`check_weight_names`), which both loaders use to refuse tensors the decoder would silently drop.

Refused by name: other model types, biases other than Qwen2's q/k/v, activations other than SiLU
(tanh GELU for Gemma), RoPE scaling other than "llama3" (and "linear" for Gemma 3), partial
rotary dimensions, attention logit soft-capping, quantized checkpoints, and directories without
safetensors.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from models.base import CausalLM, LoadedModel, ModelLoadError
from models.config import ModelConfig, RopeScaling
from models.hf_tokenizer import HFTokenizer, end_token_ids, load_hf_tokenizer
from models.registry import model_class

# Tensors some checkpoints carry that hold nothing the decoder needs (recomputed RoPE tables).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def check_weight_names(
    weights: Mapping[str, Any], config: ModelConfig, source: str, cls: type[CausalLM]
) -> None:
    """Refuse checkpoints with tensors the decoder has no place for (they would be dropped)."""
    expected = cls.hf_weight_names(config)
    unexpected = sorted(
        n for n in weights if n not in expected and not n.endswith(_IGNORED_SUFFIXES)
    )
    if config.tie_word_embeddings and "lm_head.weight" in unexpected:
        unexpected.remove("lm_head.weight")  # a saved copy of the tied embedding
    if unexpected:
        raise ModelLoadError(
            f"{source}: tensors this {cls.__name__} cannot use: {', '.join(unexpected[:5])}"
            + (f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else "")
        )


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e


def _rope(
    cfg: dict,
    where: str,
    head_dim: int,
    params: dict | None = None,
    default_theta: float = 10000.0,
) -> dict[str, Any]:
    """The `ModelConfig` RoPE fields of the config, or of `params` (one layer type's entry of a
    per-layer-type `rope_parameters`): base, Llama 3 / linear / LongRoPE scaling, rotated dims."""
    # transformers 5 writes rope_parameters {rope_theta, rope_type, ...}; 4.x rope_theta + rope_scaling.
    if params is None:
        params = cfg.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", default_theta)))
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    rot = int(head_dim * partial)  # as transformers rounds it
    fields: dict[str, Any] = dict(rope_theta=theta, rotary_dim=rot if rot != head_dim else None)
    scaling = cfg.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return fields
    if kind == "linear" and cfg.get("model_type") == "gemma3_text":
        return {**fields, "rope_linear_factor": float(scaling["factor"])}
    try:
        if kind == "llama3":
            scaling = RopeScaling(
                factor=float(scaling["factor"]),
                low_freq_factor=float(scaling["low_freq_factor"]),
                high_freq_factor=float(scaling["high_freq_factor"]),
                original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
            )
            return {**fields, "rope_scaling": scaling}
        if kind in ("longrope", "su"):  # ("su": its name in Phi-3's first configs)
            return {**fields, **_longrope(cfg, scaling)}
    except KeyError as e:
        raise ModelLoadError(f"{where}: {kind} rope scaling lacks {e}") from e
    raise ModelLoadError(
        f"{where}: RoPE scaling {kind!r} is not supported (only 'llama3', 'longrope', and "
        "'linear' for Gemma 3)"
    )


def _longrope(cfg: dict, scaling: dict) -> dict[str, Any]:
    """LongRoPE's fields (Phi-3.5, Phi-3 128k, Phi-4-mini), as transformers computes them: the
    attention factor from max / original context unless the config gives it."""
    original = int(
        scaling.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"]
    )
    factor = float(scaling.get("factor") or int(cfg["max_position_embeddings"]) / original)
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    return dict(
        rope_freq_factors=tuple(float(x) for x in scaling["short_factor"]),
        rope_long_factors=tuple(float(x) for x in scaling["long_factor"]),
        rope_original_context=original,
        rope_attention_factor=float(attention),
    )


# The activation each family's config names for its gated MLP, as `ModelConfig.hidden_act`.
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def _gemma_fields(cfg: dict, where: str, n_layers: int, head_dim: int, gemma2: bool) -> dict:
    """Gemma 2's and 3's extras: windows per layer type (without `layer_types`, on all but every
    sixth layer for Gemma 3, every other layer from the first for Gemma 2), Gemma 3's QK-norm and
    local RoPE base (Gemma 2: one base), soft caps, attention and embedding scales."""
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError(
            f"{where}: bidirectional attention (embedding models) is not supported"
        )
    window = int(cfg.get("sliding_window") or 0)
    types = cfg.get("layer_types")
    if types is None:
        pattern = 2 if gemma2 else 6
        pattern = int(
            cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", pattern))
        )
        types = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(n_layers)
        ]
    params = cfg.get("rope_parameters") or {}
    if gemma2:
        rope, local_theta = _rope(cfg, where, head_dim), None
    elif "full_attention" in params:  # transformers 5: RoPE per layer type
        rope = _rope(cfg, where, head_dim, params["full_attention"], 1_000_000.0)
        local = _rope(cfg, where, head_dim, params["sliding_attention"])
        if set(local) != {"rope_theta", "rotary_dim"}:
            raise ModelLoadError(f"{where}: RoPE scaling of sliding layers is not supported")
        local_theta = local["rope_theta"]
    else:
        rope = _rope(cfg, where, head_dim, None, 1_000_000.0)
        local_theta = float(cfg.get("rope_local_base_freq", 10000.0))
    return dict(
        layer_windows=tuple(window if t == "sliding_attention" else 0 for t in types),
        **rope,
        rope_local_theta=local_theta,
        qk_norm=not gemma2,
        attention_scale=float(cfg.get("query_pre_attn_scalar", head_dim)) ** -0.5,
        embedding_scale=float(cfg["hidden_size"]) ** 0.5,
        attn_logit_softcapping=cfg.get("attn_logit_softcapping") or None,
        final_logit_softcapping=cfg.get("final_logit_softcapping") or None,
    )


def _windows(cfg: dict, model_type: str, n_layers: int) -> tuple[int, ...] | None:
    """Per-layer sliding windows of the Llama-decoder families (None: none anywhere)."""
    window = int(cfg.get("sliding_window") or 0)
    if not window:
        return None
    if model_type == "phi3":  # transformers' Phi-3 windows every layer
        return (window,) * n_layers
    types = cfg.get("layer_types")
    if (
        model_type in ("qwen2", "qwen3", "qwen3_moe", "smollm3")
        and cfg.get("use_sliding_window")
        and types
    ):
        return tuple(window if t == "sliding_attention" else 0 for t in types)
    return None


def _nope_layers(cfg: dict, n_layers: int) -> tuple[bool, ...]:
    """SmolLM3's layers without RoPE: its `no_rope_layers` flags (1: the layer rotates), else
    one every `no_rope_layer_interval` layers (4), as transformers fills them in."""
    flags = cfg.get("no_rope_layers")
    if flags is None:
        every = int(cfg.get("no_rope_layer_interval") or 4)
        flags = [int((i + 1) % every != 0) for i in range(n_layers)]
    return tuple(not f for f in flags)


def _moe_fields(cfg: dict, where: str, n_layers: int) -> dict:
    """Qwen3-MoE's experts; refused unless every layer's MLP is sparse (as in every published
    Qwen3-MoE: decoder_sparse_step 1, no mlp_only_layers)."""
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    if step != 1 or dense & set(range(n_layers)):
        raise ModelLoadError(f"{where}: dense MLP layers among the sparse ones are not supported")
    return dict(
        # (transformers 5 writes num_local_experts; the published configs num_experts)
        num_experts=int(cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"]),
        num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
    )


def text_config(cfg: dict) -> dict:
    """The decoder's config: a multimodal Gemma 3's `text_config` (model_type gemma3_text)."""
    if cfg.get("model_type") == "gemma3":
        return {"model_type": "gemma3_text", **(cfg.get("text_config") or {})}
    return cfg


def config_from_hf(cfg: dict, name: str, where: str) -> ModelConfig:
    """A `ModelConfig` from a parsed config.json, or `ModelLoadError` naming what is unsupported."""
    outer = cfg
    cfg = text_config(cfg)
    model_type = cfg.get("model_type")
    model_class(model_type, where)  # refuse an unknown architecture before reading its fields
    if outer.get("quantization_config"):
        method = outer["quantization_config"].get("quant_method", "?")
        raise ModelLoadError(f"{where}: quantized checkpoints ({method}) are not supported")
    gemma = model_type in ("gemma2", "gemma3_text")
    act = cfg.get(
        "hidden_activation" if gemma else "hidden_act", "gelu_pytorch_tanh" if gemma else "silu"
    )
    if act not in _ACTIVATIONS or (act == "silu") == gemma:
        raise ModelLoadError(f"{where}: hidden_act {act!r} is not supported for {model_type}")
    if cfg.get("mlp_bias"):
        raise ModelLoadError(f"{where}: MLP biases are not supported")
    # Llama's attention_bias puts a bias on o_proj too, which this decoder lacks; Qwen2 always
    # has q/k/v biases and never an o_proj one.
    if model_type != "qwen2" and cfg.get("attention_bias"):
        raise ModelLoadError(f"{where}: attention biases (on q/k/v/o) are not supported")
    try:
        hidden = int(cfg["hidden_size"])
        n_heads = int(cfg["num_attention_heads"])
        n_kv = int(cfg.get("num_key_value_heads") or n_heads)
        n_layers = int(cfg["num_hidden_layers"])
        head_dim = int(cfg.get("head_dim") or hidden // n_heads)
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        if gemma:
            extra = _gemma_fields(cfg, where, n_layers, head_dim, model_type == "gemma2")
        else:
            extra = dict(
                **_rope(cfg, where, head_dim),
                qk_norm=model_type in ("qwen3", "qwen3_moe"),
                layer_windows=_windows(cfg, model_type, n_layers),
            )
            if model_type == "smollm3":
                extra["nope_layers"] = _nope_layers(cfg, n_layers)
            if model_type == "qwen3_moe":
                extra.update(_moe_fields(cfg, where, n_layers))
            # Mistral's sliding window equals full attention for contexts no longer than the
            # window, so cap the context there instead of computing something else beyond it.
            window = cfg.get("sliding_window")
            if window and model_type == "mistral":
                max_pos = min(max_pos, int(window))
        return ModelConfig(
            name=name,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            num_layers=n_layers,
            num_heads=n_heads,
            num_kv_heads=n_kv,
            head_dim=head_dim,
            intermediate_size=int(cfg["intermediate_size"]),
            max_position_embeddings=max_pos,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(
                cfg.get("tie_word_embeddings", outer.get("tie_word_embeddings", gemma))
            ),
            attention_bias=model_type == "qwen2",
            hidden_act=_ACTIVATIONS[act],
            dtype=torch.float32,
            **extra,
        )
    except KeyError as e:
        raise ModelLoadError(f"{where}: config.json lacks {e}") from e
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{where}: bad value in config.json: {e}") from e


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


class SafetensorsWeights(Mapping[str, torch.Tensor]):
    """The tensors of a directory's safetensors files (the index's shards, or all *.safetensors),
    read from the memory-mapped file when looked up, so the checkpoint is never held twice."""

    def __init__(self, directory: Path) -> None:
        from safetensors import safe_open

        index = directory / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(
                {directory / f for f in _read_json(index).get("weight_map", {}).values()}
            )
        else:
            files = sorted(directory.glob("*.safetensors"))
        if not files:
            others = [p.name for p in (*directory.glob("*.bin"), *directory.glob("*.pt*"))]
            hint = f" (found {', '.join(others[:3])}: only safetensors are read)" if others else ""
            raise ModelLoadError(f"{directory}: no *.safetensors weights{hint}")
        self._handles: dict[str, Any] = {}
        for f in files:
            try:
                handle = safe_open(str(f), framework="pt")
            except Exception as e:  # safetensors raises its own error types
                raise ModelLoadError(f"cannot read {f}: {e}") from e
            self._handles.update(dict.fromkeys(handle.keys(), handle))

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._handles[name].get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._handles)

    def __contains__(self, name: object) -> bool:
        # (Mapping's default looks the value up: a dequantization or a read per membership test)
        return name in self._handles

    def __len__(self) -> int:
        return len(self._handles)


class LanguageModelWeights(Mapping[str, torch.Tensor]):
    """The language model's tensors of a multimodal checkpoint (Gemma 3 image-text) under the
    text model's names; the vision tower and projector are left out."""

    # transformers 5 names first, then 4.x's
    _PREFIXES = (
        ("model.language_model.", "model."),
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
    )
    _SKIPPED = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.",
                "multi_modal_projector.")  # fmt: skip

    def __init__(self, inner: Mapping[str, torch.Tensor]) -> None:
        self._inner = inner
        self._names: dict[str, str] = {}
        for name in inner:
            if name.startswith(self._SKIPPED):
                continue
            for old, new in self._PREFIXES:
                if name.startswith(old):
                    self._names[new + name[len(old) :]] = name
                    break
            else:
                self._names[name] = name  # (an unexpected name: check_weight_names refuses it)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._inner[self._names[name]]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def load_hf_directory(path: str | Path, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load a Hugging Face Llama-family directory: config, safetensors, tokenizer, EOS ids."""
    directory = Path(path)
    t0 = time.perf_counter()
    cfg = _read_json(directory / "config.json")
    config = config_from_hf(cfg, directory.name, str(directory))
    gen_path = directory / "generation_config.json"
    gen = _read_json(gen_path) if gen_path.is_file() else {}

    tok = load_hf_tokenizer(directory)
    eos = end_token_ids(tok, [*_ids(cfg.get("eos_token_id")), *_ids(gen.get("eos_token_id"))])
    bos = cfg.get("bos_token_id") if cfg.get("bos_token_id") is not None else tok.bos_token_id
    pad = cfg.get("pad_token_id") if cfg.get("pad_token_id") is not None else tok.pad_token_id
    config = replace(
        config,
        dtype=dtype,
        eos_token_ids=eos,
        bos_token_id=None if bos is None else int(bos),
        pad_token_id=None if pad is None else int(pad),
        extra={"source": str(directory)},
    )

    weights: Mapping[str, torch.Tensor] = SafetensorsWeights(directory)
    arch = text_config(cfg)["model_type"]
    if cfg.get("model_type") != arch:  # a multimodal checkpoint: its language model's tensors
        weights = LanguageModelWeights(weights)
    cls = model_class(arch, str(directory))
    check_weight_names(weights, config, str(directory), cls)
    model = cls.without_weights(config)
    try:
        model.load_hf_weights(weights, adopt=True)
    except ValueError as e:
        raise ModelLoadError(f"{directory}: {e}") from e
    model.eval().requires_grad_(False)
    config.extra["load_seconds"] = round(time.perf_counter() - t0, 3)
    return LoadedModel(config.name, model, HFTokenizer(tok, eos), config)
