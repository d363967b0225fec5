"""`load_model(name_or_path)`: one entry point from a name or a path to a ready model.

Returns a `LoadedModel`: the torch module, its tokenizer and its config. Names: "tinygpt"
(built in); "smollm2-135m-instruct" (the GGUF file `python -m models.fetch` puts in the model
cache, fetched on first use if it is not there yet: `models.fetch.smollm2_path`);
a path to a `.gguf` file or a Hugging Face model directory of the Llama family.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
from pathlib import Path
from typing import Any

import torch

from models.base import LoadedModel, ModelLoadError
from models.fetch import smollm2_path
from models.gguf_loader import load_gguf
from models.hf_loader import load_hf_directory
from models.llama import Linear
from models.tinygpt import build_tinygpt

SUPPORTED = (
    '"tinygpt", "smollm2-135m-instruct", a path to a Llama-architecture .gguf file, '
    "or a Hugging Face model directory (config.json + *.safetensors) of the Llama family "
    "(Llama, Mistral, Qwen2, SmolLM)"
)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_model(name_or_path: str, dtype: str | torch.dtype | None = None) -> LoadedModel:
    """Load a model. `dtype="bfloat16"` stores the projection weights and the output head (the
    bytes a decode step reads) in bfloat16 and runs those matmuls in bfloat16; the residual
    stream, norms, embeddings, attention, KV cache and logits stay float32.

    float32 is the default and the reference. bfloat16 halves the bytes every decode step reads
    and doubles matmul throughput on CPUs with AVX512-BF16; its tokens are not float32's.
    """
    lm = _load(name_or_path)
    if dtype is None:
        return lm
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ModelLoadError(f"unsupported dtype {dtype!r}; choose one of {sorted(DTYPES)}")
        dtype = DTYPES[dtype]
    if dtype == (lm.config.matmul_dtype or lm.config.dtype):
        return lm
    # The Llama family's layout: decoder layers of `models.llama.Linear`, and an `lm_head`.
    model: Any = lm.model
    for layer in model.layers:
        for module in layer.modules():
            if isinstance(module, Linear):
                module.to(dtype)
    # The head gets its own bfloat16 copy: with tied embeddings the float32 table stays for the
    # lookup (which reads a few rows), while every step reads the whole head.
    head = model.lm_head
    head.weight = torch.nn.Parameter(head.weight.detach().to(dtype), requires_grad=False)
    config = dataclasses.replace(lm.config, matmul_dtype=dtype)
    model.config = config
    _return_freed_memory()
    return LoadedModel(lm.name, lm.model, lm.tokenizer, config)


def _return_freed_memory() -> None:
    """Hand the float32 copy's freed pages back to the OS (glibc keeps them in its heap
    otherwise: 660 MiB of resident set for SmolLM2)."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to do
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _load(name_or_path: str) -> LoadedModel:
    key = str(name_or_path).strip()
    if key.lower() == "tinygpt":
        model, tok = build_tinygpt()
        return LoadedModel("tinygpt", model, tok, model.config)
    if key.lower() in ("smollm2-135m-instruct", "smollm2", "smollm2-135m"):
        # Fetched on first use, unless CBSERVE_OFFLINE / HF_HUB_OFFLINE says not to.
        return load_gguf(smollm2_path(fetch=True), name="smollm2-135m-instruct")
    path = Path(key).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf(path, name=path.stem)
    if path.is_dir() and (path / "config.json").is_file():
        return load_hf_directory(path)
    if path.exists():
        raise ModelLoadError(f"cannot load {key!r}: expected {SUPPORTED}")
    if path.suffix == ".gguf" or "/" in key or "\\" in key:
        raise ModelLoadError(f"no such file or directory: {key!r}; expected {SUPPORTED}")
    raise ModelLoadError(f"unknown model {key!r}: expected {SUPPORTED}")
