"""Loading Hugging Face model directories into their `models.registry` class.

Owns: turning a `config.json` into a `ModelConfig` through its architecture's spec
(`models.arch`; a multimodal checkpoint's language model from its `text_config`), reading
`*.safetensors` weights (sharded or not), the EOS ids from config.json, generation_config.json
and the tokenizer, and checking tensor names against what the model class takes
(`check_weight_names`), which both loaders use to refuse tensors the decoder would silently drop.

Refused by name: model types no spec reads, quantized checkpoints (but the quantizations a spec
reads, as gpt-oss's MXFP4: its `hf_checkpoint` maps the blocks, which the kernels then take as
they are), directories without safetensors, and what each spec's config reader refuses.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from models.arch import specs
from models.base import CausalLM, LoadedModel, ModelLoadError
from models.config import ModelConfig
from models.hf_tokenizer import HFTokenizer, end_token_ids, load_hf_tokenizer
from models.packing import pack_for_kernels
from models.quant import KernelOptions
from models.registry import hf_spec
from models.row_table import RowTables

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


def text_config(cfg: dict) -> dict:
    """The decoder's config: a multimodal checkpoint's `text_config` under the model type of
    the spec that wraps it (Gemma 3 image-text: gemma3_text), else the config itself."""
    for spec in specs():
        if cfg.get("model_type") in spec.hf_wrapper_types:
            # (the outer config's tie_word_embeddings holds where the text config has none)
            outer = {k: cfg[k] for k in ("tie_word_embeddings",) if k in cfg}
            text = cfg.get("text_config") or {}
            return {**outer, "model_type": spec.hf_model_types[0], **text}
    return cfg


def config_from_hf(cfg: dict, name: str, where: str) -> ModelConfig:
    """A `ModelConfig` from a parsed config.json, or `ModelLoadError` naming what is unsupported."""
    outer = cfg
    cfg = text_config(cfg)
    spec = hf_spec(cfg.get("model_type"), where)  # refused before its fields are read
    if outer.get("quantization_config"):
        method = outer["quantization_config"].get("quant_method", "?")
        if method not in spec.hf_quantizations:
            raise ModelLoadError(f"{where}: quantized checkpoints ({method}) are not supported")
    assert spec.hf_config is not None
    try:
        return ModelConfig(name=name, dtype=torch.float32, **spec.hf_config(cfg, where))
    except KeyError as e:
        raise ModelLoadError(f"{where}: config.json lacks {e}") from e
    except (TypeError, ValueError) as e:
        if isinstance(e, ModelLoadError):
            raise
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

    def table(self, name: str) -> torch.Tensor:
        """Tensor `name` in its file's dtype, over the file's map (`models.row_table`)."""
        return self[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._handles)

    def __contains__(self, name: object) -> bool:
        # (Mapping's default looks the value up: a dequantization or a read per membership test)
        return name in self._handles

    def __len__(self) -> int:
        return len(self._handles)


class LanguageModelWeights(Mapping[str, torch.Tensor]):
    """The language model's tensors of a multimodal checkpoint (Gemma 3 image-text, Gemma 4)
    under the text model's names; the vision and audio towers and projectors are left out."""

    # transformers 5 names first, then 4.x's
    _PREFIXES = (
        ("model.language_model.", "model."),
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
    )
    # the vision tower and projector; Qwen3.5's multi-token-prediction head (not run)
    _SKIPPED = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.",
                "multi_modal_projector.", "model.audio_tower.", "model.embed_vision.",
                "model.embed_audio.", "model.visual.", "visual.", "mtp.")  # fmt: skip

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

    def table(self, name: str) -> torch.Tensor:
        """The inner mapping's `table` (`models.row_table`)."""
        inner = self._inner
        return inner.table(self._names[name]) if isinstance(inner, RowTables) else self[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def load_hf_directory(
    path: str | Path, dtype: torch.dtype = torch.float32, kernels: KernelOptions | None = None
) -> LoadedModel:
    """Load a Hugging Face Llama-family directory: config, safetensors, tokenizer, EOS ids.

    `kernels`: for a checkpoint its spec maps (`ArchSpec.hf_checkpoint`: quantized blocks), the
    model is packed here, taking those blocks as they are; other checkpoints are packed by the
    caller."""
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
    spec = hf_spec(arch, str(directory))
    cls = spec.model_class
    blocks = None
    if spec.hf_checkpoint is not None:
        in_place = kernels is not None and kernels.quantization == "auto"
        weights = spec.hf_checkpoint(weights, in_place)
        blocks = getattr(weights, "blocks", None)
    check_weight_names(weights, config, str(directory), cls)
    model = cls.without_weights(config)
    try:
        model.load_hf_weights(weights, adopt=True)
    except ValueError as e:
        raise ModelLoadError(f"{directory}: {e}") from e
    model.eval().requires_grad_(False)
    if kernels is not None and blocks is not None:
        try:
            model = pack_for_kernels(model, kernels, blocks)
        except ValueError as e:
            raise ModelLoadError(f"{directory}: {e}") from e
    config.extra["load_seconds"] = round(time.perf_counter() - t0, 3)
    return LoadedModel(config.name, model, HFTokenizer(tok, eos), config)
