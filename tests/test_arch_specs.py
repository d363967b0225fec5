"""The architecture specs (`models.arch`) as the registry, the loaders and tools.synth_model read
them: every family module is listed and complete, names are unambiguous, and the lookups and
their refusals come from the specs. (Each family against transformers: tests/test_models_arch.py,
tests/test_synth_model.py.)"""

from __future__ import annotations

import importlib
import pkgutil

import pytest
import torch

import models.arch
from models import CausalLM, ModelLoadError, load_model, registry
from models.arch import FAMILIES, specs
from models.packing import pack_for_kernels
from models.quant import KernelOptions


def test_every_family_module_is_listed_once():
    modules = {
        m.name
        for m in pkgutil.iter_modules(models.arch.__path__)
        if hasattr(importlib.import_module(f"models.arch.{m.name}"), "SPECS")
    }
    assert sorted(FAMILIES) == sorted(modules)


def test_names_are_unambiguous_and_specs_complete():
    hf = [t for s in specs() for t in (*s.hf_model_types, *s.hf_wrapper_types)]
    gguf = [s.gguf_architecture for s in specs() if s.gguf_architecture]
    presets = [p for s in specs() if s.synth for p in s.synth.presets]
    names = [s.name for s in specs()]
    for values in (hf, gguf, presets, names):
        assert len(values) == len(set(values)), values
    for s in specs():
        assert (s.hf_config is not None) == bool(s.hf_model_types), s.name
        assert (s.gguf_config is not None) == (s.gguf_architecture is not None), s.name
        assert (s.gguf_tensors is not None) == (s.gguf_architecture is not None), s.name
        assert s.synth is None or s.gguf_architecture is not None, s.name
        assert bool(s.hf_model_types or s.gguf_architecture) != (s.builtin is not None), s.name


def test_lookups_and_refusals_come_from_the_specs():
    for s in specs():
        for t in s.hf_model_types:
            assert registry.hf_spec(t, "x") is s and registry.model_class(t, "x") is s.model_class
        if s.gguf_architecture:
            assert registry.gguf_spec(s.gguf_architecture, "x") is s
    with pytest.raises(ModelLoadError) as e:
        registry.gguf_spec("rwkv7", "f.gguf")
    for s in registry.gguf_architectures():
        assert s.gguf_architecture in str(e.value)
    with pytest.raises(ModelLoadError) as e:
        registry.hf_spec("rwkv7", "dir")
    for t in registry.hf_architectures():
        assert t in str(e.value)
    assert registry.builtin("tinygpt") is not None and registry.builtin("llama") is None


def test_loaded_models_are_causal_lms_and_packing_returns_the_model():
    from models import kernels

    lm = load_model("tinygpt", use_kernels=False)
    assert isinstance(lm.model, CausalLM) and not lm.model.kernels
    if not kernels.available():
        pytest.skip(kernels.unavailable_reason() or "no kernels")
    packed = pack_for_kernels(lm.model, KernelOptions("none", "float32"))
    assert packed is lm.model and packed.kernels
    assert isinstance(packed, CausalLM)
    bf16 = load_model("tinygpt", dtype="bfloat16")
    assert bf16.config.matmul_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="float32"):
        pack_for_kernels(bf16.model, KernelOptions())
