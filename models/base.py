"""What the rest of models/ and the engine share: the model interface, the loaded-model record,
the load error, and where models live on disk.

`CausalLM` is all the engine needs of a model: its config (shape, special tokens, KV layout), a
forward over one flat batch of tokens that reads and writes the paged KV pool through
`AttentionMetadata`, the output head, and a parameter count; loaders also use the two loading
hooks. Every architecture in `models.registry` implements it. This module imports no loader, so
every loader can import it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from models.attention import AttentionMetadata
from models.config import ModelConfig
from models.tokenizer import Tokenizer

# One layer's (K pool, V pool), each (num_blocks, block_size, kv_heads, head_dim).
KVCache = tuple[torch.Tensor, torch.Tensor]


class ModelLoadError(ValueError):
    """A model name or file that cannot be loaded; the message says why and what is supported."""


@runtime_checkable
class CausalLM(Protocol):
    """A decoder the engine can run (see the module docstring)."""

    config: ModelConfig

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[KVCache] | None,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The forward: input_ids, positions (T,) -> final hidden states (T, d_model). Writes
        each token's K/V to `meta.slot_mapping`; `kv_caches` None means no pool (full recompute
        of one sequence)."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, d_model) -> (N, vocab) float32."""
        ...

    def num_parameters(self) -> int: ...

    @classmethod
    def without_weights(cls, config: ModelConfig) -> CausalLM:
        """Allocated but uninitialised parameters, for a loader to fill."""
        ...

    def load_hf_weights(self, tensors: Mapping[str, torch.Tensor], adopt: bool = False) -> None:
        """Take weights under Hugging Face tensor names; raises ValueError if any is missing."""
        ...

    @classmethod
    def hf_weight_names(cls, config: ModelConfig) -> set[str]:
        """Every Hugging Face tensor name `load_hf_weights` may take for this config (loaders
        refuse checkpoints holding others, which would be silently dropped)."""
        ...


@dataclass(frozen=True, slots=True)
class LoadedModel:
    name: str
    model: CausalLM
    tokenizer: Tokenizer
    config: ModelConfig

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.config.eos_token_ids

    @property
    def max_model_len(self) -> int:
        return self.config.max_position_embeddings

    @property
    def chat_template(self) -> str | None:
        return self.tokenizer.chat_template

    def num_parameters(self) -> int:
        return self.model.num_parameters()


def model_dir() -> Path:
    """The model cache: `$CBSERVE_MODEL_DIR` if set, else `~/.cache/cbserve/models/`."""
    env = os.environ.get("CBSERVE_MODEL_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "cbserve" / "models"
