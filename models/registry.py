"""The architectures this project can run: a name -> the class that implements it.

Names are Hugging Face `model_type`s (config.json); the GGUF loader maps llama.cpp's
`general.architecture` onto them. Mistral, Qwen2/2.5, Qwen3 and Phi-3 are configurations of the
Llama decoder (Qwen2's q/k/v biases, Qwen3's QK-norm and Phi-3's fused projections are
`ModelConfig` options and tensor names), and so is SmolLM3 (its NoPE layers); Gemma 3 has its
own layer, which Gemma 2 shares (no QK-norm; its soft-capped attention scores are a
`ModelConfig` option); Qwen3-MoE its sparse MLP (`models.moe`). A new family is one module with
a class that implements `models.base.CausalLM`, plus one line here.
"""

from __future__ import annotations

from models.base import CausalLM, ModelLoadError
from models.gemma3 import Gemma3ForCausalLM
from models.llama import LlamaForCausalLM
from models.moe import MoeForCausalLM

ARCHITECTURES: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "phi3": LlamaForCausalLM,
    "smollm3": LlamaForCausalLM,
    "gemma2": Gemma3ForCausalLM,  # Gemma 3's layer without QK-norm, scores soft-capped
    "gemma3_text": Gemma3ForCausalLM,
    "qwen3_moe": MoeForCausalLM,
}


def model_class(architecture: str, where: str) -> type[CausalLM]:
    """The class for an architecture name; `ModelLoadError` naming the supported ones if none."""
    cls = ARCHITECTURES.get(architecture)
    if cls is None:
        raise ModelLoadError(
            f"{where}: model_type {architecture!r} is not supported; supported: "
            f"{', '.join(ARCHITECTURES)}, gemma3 (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, Phi-3, "
            "Gemma 2, Gemma 3, SmolLM2/3, Qwen3-MoE)"
        )
    return cls
