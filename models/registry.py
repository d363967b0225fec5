"""The architectures this project can run, looked up by name: a Hugging Face `model_type`
(config.json) or a llama.cpp `general.architecture` (GGUF) -> its `models.arch` spec and model
class. Nothing here names a family: the specs do (`models.arch.specs`).
"""

from __future__ import annotations

from models.arch import specs
from models.arch.spec import ArchSpec
from models.base import CausalLM, ModelLoadError


def hf_architectures() -> dict[str, ArchSpec]:
    """Hugging Face model_type -> spec, for every model type the specs read."""
    return {t: s for s in specs() for t in s.hf_model_types}


def gguf_architectures() -> list[ArchSpec]:
    """The specs that read GGUF files."""
    return [s for s in specs() if s.gguf_architecture is not None]


def builtin(name: str) -> ArchSpec | None:
    """The spec of a built-in model loaded by `name` alone (tinygpt), if `name` is one."""
    return next((s for s in specs() if s.builtin is not None and s.name == name), None)


def _described() -> str:
    return ", ".join(s.describes for s in specs() if s.hf_model_types or s.gguf_architecture)


def hf_spec(model_type: str | None, where: str) -> ArchSpec:
    """The spec for a config.json's model_type; `ModelLoadError` naming the supported ones if
    none."""
    spec = hf_architectures().get(model_type)  # type: ignore[arg-type]
    if spec is None:
        wrappers = [t for s in specs() for t in s.hf_wrapper_types]
        raise ModelLoadError(
            f"{where}: model_type {model_type!r} is not supported; supported: "
            f"{', '.join([*hf_architectures(), *wrappers])} ({_described()})"
        )
    return spec


def gguf_spec(architecture: str, where: str) -> ArchSpec:
    """The spec for a GGUF file's general.architecture; `ModelLoadError` naming the supported
    ones if none."""
    for spec in gguf_architectures():
        if spec.gguf_architecture == architecture:
            return spec
    raise ModelLoadError(
        f"{where}: GGUF architecture {architecture!r} is not supported; supported: "
        f"{', '.join(s.gguf_architecture for s in gguf_architectures())} ({_described()})"
    )


def model_class(architecture: str, where: str) -> type[CausalLM]:
    """The class for a Hugging Face model_type; `ModelLoadError` naming the supported ones if
    none."""
    return hf_spec(architecture, where).model_class


# model_type -> class
ARCHITECTURES: dict[str, type[CausalLM]] = {t: s.model_class for t, s in hf_architectures().items()}
