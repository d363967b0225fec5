"""`load_model(name_or_path)`: one entry point from a name or a path to a ready model.

Returns a `LoadedModel`: the torch module, its tokenizer and its config. Names: "tinygpt"
(built in); "smollm2-135m-instruct", "gemma-3-270m" (GGUF files `python -m models.fetch NAME`
puts in the model cache, fetched on first use if they are not there yet: `models.fetch.MODELS`);
a path to a `.gguf` file or a Hugging Face model directory of a supported family.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
from pathlib import Path

import torch

from models.base import LoadedModel, ModelLoadError
from models.gguf_loader import load_gguf
from models.gguf_reader import is_gguf_file
from models.hf_loader import load_hf_directory
from models.packing import pack_for_kernels
from models.quant import KernelOptions
from models.registry import builtin

SUPPORTED = (
    '"tinygpt", "smollm2-135m-instruct", "gemma-3-270m", a path to a GGUF file, or a Hugging '
    "Face model directory (config.json + *.safetensors), of Llama 2/3, Mistral, Qwen2/2.5, Qwen3, "
    "Phi-3, Gemma 3 or SmolLM"
)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
KV_DTYPES = {"float32": torch.float32, "float16": torch.float16, "int8": torch.int8}


def load_model(
    name_or_path: str,
    dtype: str | torch.dtype | None = None,
    quantization: str = "auto",
    kv_cache_dtype: str = "auto",
    use_kernels: bool = True,
    activations: str = "auto",
    max_model_len: int | None = None,
) -> LoadedModel:
    """Load a model, ready to serve.

    Where the cbserve CPU kernels run (`models.kernels`: x86-64 with AVX2, a C++ compiler at
    first use; `CBSERVE_KERNELS=0` turns them off), a float32 model computes through them:
    projections as packed weights per `quantization` (see `models.packing.pack_for_kernels`:
    "auto" keeps a GGUF file's own 4/8-bit blocks, "none" float weights, "q8_0"/"q4_1"
    quantize), attention over the paged pool in place. Elsewhere the pure-torch path computes
    the same model (dequantized weights), slower.

    `use_kernels=False` is the pure-torch path even where the kernels run (the reference that
    `tools.quant_quality` and tests compare against).

    `activations`: "auto" (int8 for quantized weights wherever the kernels run), "int8" or
    "float32": what the projections multiply (see `models.quant.KernelOptions`).

    `kv_cache_dtype`: "auto" is int8 when the projections run int8 activations (quantized
    weights, the default on AVX2 and AVX512-VNNI alike) and head_dim is a multiple of 32,
    float16 when the weights are quantized otherwise (as llama.cpp's default cache) and float32
    for float weights; "float16" and "int8" (per 32 values
    an int8 and a float32 scale: 0.56 of float16's bytes at head_dim 64, so long-context decode
    reads about half as much) need the kernels.

    `max_model_len`: the context the model will serve (None: its own). A LongRoPE model (Phi-3.5,
    Phi-4-mini) serving no more than its original context takes the short factors and is
    limited to that context, as llama.cpp chooses by its context size; else the long ones.

    `dtype="bfloat16"` is the pure-torch bfloat16-matmul mode: projection weights and the head in
    bfloat16 (the residual stream, norms, attention, KV cache and logits stay float32). It pays
    on CPUs with AVX512-BF16; its tokens are not float32's.
    """
    from models import kernels
    from models.quant import ACTIVATIONS, F32, INT8_KINDS, SCHEME_KINDS, SCHEMES

    if quantization not in SCHEMES:
        raise ModelLoadError(f"unknown quantization {quantization!r}; choose one of {SCHEMES}")
    if activations not in ACTIVATIONS:
        raise ModelLoadError(f"unknown activations {activations!r}; choose one of {ACTIVATIONS}")
    if kv_cache_dtype != "auto" and kv_cache_dtype not in KV_DTYPES:
        raise ModelLoadError(
            f"unknown kv_cache_dtype {kv_cache_dtype!r}; choose auto, {', '.join(KV_DTYPES)}"
        )
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ModelLoadError(f"unsupported dtype {dtype!r}; choose one of {sorted(DTYPES)}")
        dtype = DTYPES[dtype]
    wants_bf16 = dtype is not None and dtype != torch.float32
    use_kernels = use_kernels and not wants_bf16 and kernels.available()
    if SCHEME_KINDS[quantization] not in (None, F32) and not use_kernels:
        why = "it runs float32" if wants_bf16 else kernels.unavailable_reason() or "turned off"
        raise ModelLoadError(f"--quantization {quantization} needs the CPU kernels: {why}")
    if activations == "int8" and not use_kernels:
        why = "bfloat16 mode" if wants_bf16 else kernels.unavailable_reason() or "turned off"
        raise ModelLoadError(f"int8 activations need the CPU kernels: {why}")
    if kv_cache_dtype in ("float16", "int8") and not use_kernels:
        why = "bfloat16 mode" if wants_bf16 else kernels.unavailable_reason() or "turned off"
        raise ModelLoadError(f"a {kv_cache_dtype} KV cache needs the CPU kernels: {why}")

    options = KernelOptions(quantization, activations) if use_kernels else None
    lm = _load(name_or_path, options)
    if options is not None and not lm.model.kernels:
        # (a GGUF file's loader already did, with its blocks)
        model = pack_for_kernels(lm.model, options)
        lm = LoadedModel(lm.name, model, lm.tokenizer, lm.config)
    if wants_bf16:
        lm = _to_bfloat16(lm, dtype)  # type: ignore[arg-type]
    original = lm.config.rope_original_context
    if lm.config.rope_long and max_model_len is not None and max_model_len <= (original or 0):
        lm = _short_rope(lm)
    layouts = lm.model.packed_kinds() if use_kernels else set()
    quantized = bool(layouts - {F32})
    if kv_cache_dtype == "auto":
        # int8 where the projections already multiply int8 activations: it halves the bytes
        # long-context decode reads each step (on AVX2 too, where q.k dequantizes the keys:
        # decode 13-24% faster at 1-2k tokens of context, no slower at 128) for a perplexity
        # cost within the int8 activations' own (SmolLM2 perplexity +0.4% on Zen 4, +0.03% on
        # Zen 3). float16 with quantized weights otherwise.
        if layouts & INT8_KINDS and lm.config.head_dim % 32 == 0:
            kv = torch.int8
        else:
            kv = torch.float16 if quantized else torch.float32
    else:
        kv = KV_DTYPES[kv_cache_dtype]
    if kv == torch.int8 and lm.config.head_dim % 32:
        raise ModelLoadError(
            f"an int8 KV cache needs head_dim to be a multiple of 32 (this model's is "
            f"{lm.config.head_dim})"
        )
    if kv != lm.config.kv_dtype:
        config = dataclasses.replace(lm.config, kv_cache_dtype=kv)
        lm.model.reconfigure(config)
        lm = LoadedModel(lm.name, lm.model, lm.tokenizer, config)
    _return_freed_memory()
    return lm


def _to_bfloat16(lm: LoadedModel, dtype: torch.dtype) -> LoadedModel:
    if dtype == (lm.config.matmul_dtype or lm.config.dtype):
        return lm
    lm.model.cast_matmuls(dtype)
    return LoadedModel(lm.name, lm.model, lm.tokenizer, lm.model.config)


def _short_rope(lm: LoadedModel) -> LoadedModel:
    """The LongRoPE model with its short factors, its context its original one."""
    config = dataclasses.replace(lm.config, max_position_embeddings=lm.config.rope_original_context)
    lm.model.reconfigure(config)
    return LoadedModel(lm.name, lm.model, lm.tokenizer, config)


def _return_freed_memory() -> None:
    """Hand the float32 copy's freed pages back to the OS (glibc keeps them in its heap
    otherwise: 660 MiB of resident set for SmolLM2)."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to do
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _load(name_or_path: str, kernels: KernelOptions | None) -> LoadedModel:
    """The model as its checkpoint holds it; a GGUF file's loader (and a Hugging Face
    directory's, for a checkpoint of quantized blocks) also packs its own blocks for the kernels
    when `kernels` is given."""
    key = str(name_or_path).strip()
    if (spec := builtin(key.lower())) is not None and spec.builtin is not None:
        return spec.builtin()
    # Imported here, not with the package: `python -m models.fetch` runs that module as __main__,
    # and runpy warns when the package has already imported it under its own name.
    from models.fetch import find as find_fetchable
    from models.fetch import model_path

    if (fetchable := find_fetchable(key)) is not None:
        # Fetched on first use, unless CBSERVE_OFFLINE / HF_HUB_OFFLINE says not to.
        path = model_path(fetchable.name, fetch=True)
        return load_gguf(path, name=fetchable.name, kernels=kernels)
    path = Path(key).expanduser()
    if path.is_file() and (path.suffix == ".gguf" or is_gguf_file(path)):
        return load_gguf(path, name=path.stem, kernels=kernels)
    if path.is_dir() and (path / "config.json").is_file():
        return load_hf_directory(path, kernels=kernels)
    if path.exists():
        raise ModelLoadError(f"cannot load {key!r}: expected {SUPPORTED}")
    if path.suffix == ".gguf" or "/" in key or "\\" in key:
        raise ModelLoadError(f"no such file or directory: {key!r}; expected {SUPPORTED}")
    raise ModelLoadError(f"unknown model {key!r}: expected {SUPPORTED}")
