"""Model definitions and loaders: the Llama-family decoder, TinyGPT, GGUF and HF checkpoints.

`models.base` holds the interface the engine is typed against (`CausalLM`) and `LoadedModel`;
`models.registry` maps architecture names to implementations; `load_model` is the one entry point.
"""

from models.attention import AttentionMetadata, PrefillChunk
from models.base import CausalLM, LoadedModel, ModelLoadError
from models.config import KVLayout, ModelConfig, RopeScaling
from models.llama import LlamaForCausalLM
from models.loader import load_model
from models.registry import ARCHITECTURES
from models.tokenizer import ByteTokenizer, IncrementalDetokenizer, Tokenizer

__all__ = [
    "ARCHITECTURES",
    "AttentionMetadata",
    "ByteTokenizer",
    "CausalLM",
    "IncrementalDetokenizer",
    "KVLayout",
    "LlamaForCausalLM",
    "LoadedModel",
    "ModelConfig",
    "ModelLoadError",
    "PrefillChunk",
    "RopeScaling",
    "Tokenizer",
    "load_model",
]
