"""Loading Hugging Face model directories of the Llama family into their `models.registry` class.

Owns: turning a `config.json` (Llama 2/3, Mistral, Qwen2, SmolLM; both the transformers 4
`rope_theta`/`rope_scaling` and the transformers 5 `rope_parameters` spellings) into a
`ModelConfig`, reading `*.safetensors` weights (sharded or not), the EOS ids from config.json,
generation_config.json and the tokenizer, and the list of tensor names a config expects
(`hf_weight_names`), which both loaders use to refuse tensors the decoder would silently drop.

Refused by name: other model types, biases other than Qwen2's q/k/v, non-SiLU activations, RoPE
scaling other than "llama3", quantized checkpoints, and directories without safetensors.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from models.base import LoadedModel, ModelLoadError
from models.config import ModelConfig, RopeScaling
from models.hf_tokenizer import HFTokenizer, end_token_ids, load_hf_tokenizer
from models.registry import model_class

# Tensors some checkpoints carry that hold nothing the decoder needs (recomputed RoPE tables).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def hf_weight_names(config: ModelConfig) -> set[str]:
    """The Hugging Face tensor names `load_hf_weights` takes for this config."""
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        for proj in ("q", "k", "v", "o"):
            names.add(f"{p}self_attn.{proj}_proj.weight")
        if config.attention_bias:
            names.update(f"{p}self_attn.{proj}_proj.bias" for proj in ("q", "k", "v"))
        names.update(f"{p}mlp.{proj}_proj.weight" for proj in ("gate", "up", "down"))
        names.update(
            f"{p}{norm}.weight" for norm in ("input_layernorm", "post_attention_layernorm")
        )
    return names


def check_weight_names(weights: dict[str, Any], config: ModelConfig, source: str) -> None:
    """Refuse checkpoints with tensors the decoder has no place for (they would be dropped)."""
    expected = hf_weight_names(config)
    unexpected = sorted(
        n for n in weights if n not in expected and not n.endswith(_IGNORED_SUFFIXES)
    )
    if config.tie_word_embeddings and "lm_head.weight" in unexpected:
        unexpected.remove("lm_head.weight")  # a saved copy of the tied embedding
    if unexpected:
        raise ModelLoadError(
            f"{source}: tensors this Llama decoder cannot use: {', '.join(unexpected[:5])}"
            + (f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else "")
        )


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e


def _rope(cfg: dict, where: str) -> tuple[float, RopeScaling | None]:
    # transformers 5 writes rope_parameters {rope_theta, rope_type, ...}; 4.x rope_theta + rope_scaling.
    params = cfg.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return theta, None
    if kind == "llama3":
        try:
            return theta, RopeScaling(
                factor=float(scaling["factor"]),
                low_freq_factor=float(scaling["low_freq_factor"]),
                high_freq_factor=float(scaling["high_freq_factor"]),
                original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
            )
        except KeyError as e:
            raise ModelLoadError(f"{where}: llama3 rope scaling lacks {e}") from e
    raise ModelLoadError(f"{where}: RoPE scaling {kind!r} is not supported (only 'llama3')")


def config_from_hf(cfg: dict, name: str, where: str) -> ModelConfig:
    """A `ModelConfig` from a parsed config.json, or `ModelLoadError` naming what is unsupported."""
    model_type = cfg.get("model_type")
    model_class(model_type, where)  # refuse an unknown architecture before reading its fields
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method", "?")
        raise ModelLoadError(f"{where}: quantized checkpoints ({method}) are not supported")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"{where}: hidden_act {act!r} is not supported (only silu)")
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
        theta, scaling = _rope(cfg, where)
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        # Sliding-window attention equals full attention for contexts no longer than the window,
        # so cap the context there instead of computing something else beyond it.
        window = cfg.get("sliding_window")
        if window and (model_type == "mistral" or cfg.get("use_sliding_window")):
            max_pos = min(max_pos, int(window))
        return ModelConfig(
            name=name,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=n_heads,
            num_kv_heads=n_kv,
            head_dim=int(cfg.get("head_dim") or hidden // n_heads),
            intermediate_size=int(cfg["intermediate_size"]),
            max_position_embeddings=max_pos,
            rope_theta=theta,
            rope_scaling=scaling,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2",
            dtype=torch.float32,
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

    def __len__(self) -> int:
        return len(self._handles)


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

    weights = SafetensorsWeights(directory)
    check_weight_names(weights, config, str(directory))
    model = model_class(cfg["model_type"], str(directory)).without_weights(config)
    try:
        model.load_hf_weights(weights, adopt=True)
    except ValueError as e:
        raise ModelLoadError(f"{directory}: {e}") from e
    model.eval().requires_grad_(False)
    config.extra["load_seconds"] = round(time.perf_counter() - t0, 3)
    return LoadedModel(config.name, model, HFTokenizer(tok, eos), config)
