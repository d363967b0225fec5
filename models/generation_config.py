"""Default sampling parameters per model: what a request that does not choose gets.

Owns where a model's recommended sampling settings come from, as vLLM reads them:

- a Hugging Face directory's `generation_config.json` (`temperature`, `top_p`, `top_k`, `min_p`,
  `repetition_penalty`, and `max_new_tokens` as `max_tokens`);
- a built-in preset for a model whose file carries none (the bundled SmolLM2-135M-Instruct GGUF:
  its model card recommends temperature 0.2, top-p 0.9; at OpenAI's default temperature 1.0 its
  flat distribution wanders off into other languages within a few tokens; Gemma 3 270M, a base
  model: its generation_config.json's top-k 64, top-p 0.95);
- nothing for TinyGPT and other GGUF files: OpenAI's defaults (temperature 1, top-p 1) apply.

`python -m server --generation-config auto|none|DIR` and `--override-generation-config JSON`
choose and amend them (`resolve_generation_defaults`). The server applies them only to the fields
a client did not send (`server.openai.protocol`), and `/v1/models` shows them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from models.base import LoadedModel, ModelLoadError

# generation_config.json key -> the request field it defaults (vLLM's list).
HF_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
FIELDS = frozenset(HF_KEYS.values())
_INT_FIELDS = frozenset({"top_k", "max_tokens"})

# Built-in presets by model name (lower case; a GGUF file's stem is matched by prefix).
PRESETS: dict[str, dict[str, Any]] = {
    # https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct: "temperature=0.2, top_p=0.9"
    "smollm2-135m-instruct": {"temperature": 0.2, "top_p": 0.9},
    # google/gemma-3-270m's generation_config.json: do_sample, top_k 64, top_p 0.95 (temperature
    # 1). A base model, not instruction-tuned: its defaults are for continuing text, and chat
    # goes through the template its GGUF carries with no promise of following instructions.
    "gemma-3-270m": {"top_k": 64, "top_p": 0.95},
}


def read_generation_config(directory: str | Path) -> dict[str, Any]:
    """The sampling defaults in `directory/generation_config.json`; {} when there is none."""
    path = Path(directory) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path} is not a JSON object")
    return validate_defaults(
        {HF_KEYS[k]: v for k, v in raw.items() if k in HF_KEYS and v is not None}, str(path)
    )


def preset_for(name: str) -> dict[str, Any]:
    """The built-in preset for a model name or GGUF file stem, {} if none."""
    key = name.lower().replace("_", "-")
    for preset_name, values in PRESETS.items():
        if key == preset_name or key.startswith(preset_name + "."):
            return dict(values)
    return {}


def model_generation_defaults(lm: LoadedModel) -> dict[str, Any]:
    """What `--generation-config auto` uses: the model directory's generation_config.json,
    else the built-in preset for its name, else {}."""
    source = lm.config.extra.get("source") if lm.config.extra else None
    if source and Path(source).is_dir():
        found = read_generation_config(source)
        if found:
            return found
    return preset_for(lm.name)


def resolve_generation_defaults(
    lm: LoadedModel, generation_config: str = "auto", override: str | dict | None = None
) -> dict[str, Any]:
    """The defaults in force: `generation_config` is "auto" (the model's own), "none" (OpenAI's
    defaults) or a directory holding a generation_config.json; `override` (a JSON object, or its
    text) replaces single fields on top. `ModelLoadError` for a bad source or value."""
    if generation_config == "auto":
        defaults = model_generation_defaults(lm)
    elif generation_config == "none":
        defaults = {}
    else:
        directory = Path(generation_config).expanduser()
        if not (directory / "generation_config.json").is_file():
            raise ModelLoadError(
                f"--generation-config {generation_config!r}: expected auto, none or a directory "
                "holding generation_config.json"
            )
        defaults = read_generation_config(directory)
    if override:
        if isinstance(override, str):
            try:
                override = json.loads(override)
            except ValueError as e:
                raise ModelLoadError(f"--override-generation-config is not JSON: {e}") from e
        if not isinstance(override, dict):
            raise ModelLoadError("--override-generation-config must be a JSON object")
        # Accept generation_config.json's spelling too ("max_new_tokens").
        mapped = {HF_KEYS.get(k, k): v for k, v in override.items()}
        defaults = {**defaults, **validate_defaults(mapped, "--override-generation-config")}
    return defaults


def validate_defaults(values: dict[str, Any], where: str) -> dict[str, Any]:
    """Check field names and value types (ranges are SamplingParams' to check, per request)."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if key not in FIELDS:
            raise ModelLoadError(
                f"{where}: unknown sampling field {key!r}; known: {sorted(FIELDS)}"
            )
        if key in _INT_FIELDS:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ModelLoadError(f"{where}: {key} must be an integer, got {value!r}")
        elif (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise ModelLoadError(f"{where}: {key} must be a number, got {value!r}")
        out[key] = value
    # top_k: generation_config.json spells "off" 0 (transformers), as OpenAI clients spell -1.
    if out.get("top_k") in (0, -1):
        del out["top_k"]
    return out
