"""What the rest of models/ and the engine share: the model interface, the loaded-model record,
the load error, and where models live on disk.

`CausalLM` is everything the engine, the loaders and `models.packing` use of a model: its config
(shape, special tokens, KV layout), a forward over one flat batch of tokens that reads and writes
the paged KV pool through `AttentionMetadata`, the output head, its parameter counts and weight
formats, the loading hooks, packing for the kernels, and the serving options applied after
loading (`reconfigure`, `cast_matmuls`). Every family in `models.arch` implements it. This module
imports no loader, so every loader can import it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, Self, runtime_checkable

import torch

from models.attention import AttentionMetadata
from models.config import ModelConfig
from models.tokenizer import Tokenizer

if TYPE_CHECKING:
    from models.ops import Kind
    from models.packing import Packer

# One layer's (K pool, V pool), each (num_blocks, block_size, kv_heads, head_dim).
KVCache = tuple[torch.Tensor, torch.Tensor]


class ModelLoadError(ValueError):
    """A model name or file that cannot be loaded; the message says why and what is supported."""


def is_stand_in(t: torch.Tensor) -> bool:
    """A loader's stand-in for a weight the kernels take from the file's blocks instead
    (`models.gguf_loader.GGUFWeights`): a stride-0 view, never read, so no float copy is made of
    it. Packing replaces every one (`models.packing.pack_for_kernels` checks)."""
    return t.dim() == 2 and t.stride() == (0, 0)


@runtime_checkable
class CausalLM(Protocol):
    """A decoder the engine can run (see the module docstring)."""

    config: ModelConfig
    # True once `models.packing.pack_for_kernels` packed it: it computes through `models.ops`.
    kernels: bool

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

    def num_active_parameters(self) -> int:
        """The parameters one token's forward multiplies (a mixture of experts: not the experts
        the token did not choose)."""
        ...

    def weight_formats(self) -> dict[str, int]:
        """Bytes of projection and head weights by format ("f32", "q4_1", "bfloat16", ...)."""
        ...

    def packed_kinds(self) -> set[Kind]:
        """The layout (`models.ops.Kind`) of every packed projection and head."""
        ...

    # -- loading -----------------------------------------------------------------------------------

    @classmethod
    def without_weights(cls, config: ModelConfig) -> Self:
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

    # -- after loading -----------------------------------------------------------------------------

    def pack(self, packer: Packer) -> None:
        """Replace every projection (and the head) by `packer`'s packed module, naming the
        checkpoint tensors each comes from, and switch the rest to the kernels; set `kernels`.
        Only `models.packing.pack_for_kernels` calls it."""
        ...

    def reconfigure(self, config: ModelConfig) -> None:
        """Serve with `config`: this model's config with serving options changed (the KV pool's
        dtype, the context and so LongRoPE's factors), and what depends on them rebuilt."""
        ...

    def cast_matmuls(self, dtype: torch.dtype) -> None:
        """Projection weights and the head in `dtype` (bfloat16 mode; the residual stream, norms,
        attention and logits stay float32); sets `config.matmul_dtype`."""
        ...

    # (torch.nn.Module's, which the loaders use)
    def eval(self) -> Self: ...

    def requires_grad_(self, requires_grad: bool = True) -> Self: ...

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]: ...


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
