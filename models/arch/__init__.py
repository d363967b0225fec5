"""The architectures this project runs, one module per family, each defining `SPECS`: its
`models.arch.spec.ArchSpec`s (the names Hugging Face and llama.cpp give it, its config readers,
its GGUF tensor map, its model class, tools.synth_model's presets). The registry, both loaders
and tools.synth_model loop over them and name no family.

A new family is a module here (listed in `FAMILIES`), its layer code in `models/`, its kernels,
its tests.
"""

from __future__ import annotations

import importlib
from functools import cache

from models.arch.spec import ArchSpec

# The family modules, in the order lists of supported architectures name them.
FAMILIES = (
    "tinygpt", "llama", "qwen2", "qwen3", "phi3", "smollm3", "gemma", "qwen3_moe", "gpt_oss",
    "gemma4", "lfm2", "qwen35", "granite_hybrid",
)  # fmt: skip


@cache
def specs() -> tuple[ArchSpec, ...]:
    """Every family's specs, in `FAMILIES` order (imported on first use: the model classes)."""
    out: list[ArchSpec] = []
    for family in FAMILIES:
        out.extend(importlib.import_module(f"models.arch.{family}").SPECS)
    return tuple(out)
