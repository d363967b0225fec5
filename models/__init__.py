"""Model definitions and loaders: the Llama-family decoder, TinyGPT, GGUF and HF checkpoints."""

from models.attention import AttentionMetadata, PrefillChunk
from models.config import ModelConfig, RopeScaling
from models.llama import LlamaForCausalLM
from models.loader import LoadedModel, ModelLoadError, load_model
from models.tokenizer import ByteTokenizer, IncrementalDetokenizer, Tokenizer

__all__ = [
    "AttentionMetadata",
    "ByteTokenizer",
    "IncrementalDetokenizer",
    "LlamaForCausalLM",
    "LoadedModel",
    "ModelConfig",
    "ModelLoadError",
    "PrefillChunk",
    "RopeScaling",
    "Tokenizer",
    "load_model",
]
