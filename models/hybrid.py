"""Hybrid decoders: a stack whose layers either attend over the paged KV pool or run a
recurrent mixer over per-request state slots (LFM2's short convolutions, Qwen3.5's Gated
DeltaNet, Granite 4.0-H's Mamba2).

Owns `HybridForCausalLM`, the model around such a stack: it picks each layer's class from the
config's `RecurrentConfig` (`attention_layer` or `recurrent_layer`), hands attention layers
their K/V pools (the pool holds the attention layers only, in order: `ModelConfig.kv_layout`)
and recurrent layers their state pools (`models.state.StateMetadata.pools`, in order), and runs
a full recompute without a pool (the naive engine, tests) from zero states in temporary pools.
Everything else (embedding, head, loading under Hugging Face names, packing) is
`models.decoder.DecoderForCausalLM`'s; the layer stack runs layer by layer (no one-op plan).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from models.attention import AttentionMetadata
from models.config import ModelConfig
from models.decoder import DecoderForCausalLM, DecoderLayer, HFLoader, Rotary
from models.state import StateMetadata

if TYPE_CHECKING:
    from models.packing import Packer

# A recurrent layer's (conv history pool, recurrent state pool).
StatePools = tuple[torch.Tensor, torch.Tensor]


class RecurrentLayer(DecoderLayer):
    """A layer whose mixer keeps per-request state instead of K/V: `forward(x, pools, state)`
    over its state pools. `use_kernel` is set when the model is packed for the kernels (its
    sequence ops then run in `models.ops`)."""

    use_kernel = False

    def forward(self, x, pools, state) -> torch.Tensor:  # type: ignore[override]
        raise NotImplementedError

    @classmethod
    def hf_weight_names(cls, config: ModelConfig, prefix: str) -> set[str]:
        raise NotImplementedError

    def load(self, loader: HFLoader, src: str, dst: str) -> None:
        raise NotImplementedError

    def pack(self, packer: Packer, src: str) -> None:
        self.use_kernel = True


class HybridForCausalLM(DecoderForCausalLM):
    """A decoder whose layers in `config.recurrent.layers` are `recurrent_layer`s, the others
    `attention_layer`s (see the module docstring)."""

    attention_layer: type[DecoderLayer]
    recurrent_layer: type[RecurrentLayer]

    @classmethod
    def layer_classes(cls, config: ModelConfig) -> list[type[DecoderLayer]]:
        assert config.recurrent is not None, "a hybrid model needs its recurrent layers"
        recurrent = set(config.recurrent.layers)
        return [
            cls.recurrent_layer if i in recurrent else cls.attention_layer
            for i in range(config.num_layers)
        ]

    def _rotaries(self, config: ModelConfig) -> None:
        self.rotary = Rotary(config)
        self.rotary_local = None

    def _make_plan(self) -> None:
        return None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: (T,). Returns final hidden states (T, d_model)."""
        x = self.embed(input_ids)  # (T, d)
        rope, _ = self.ropes(positions)
        state = meta.state if meta.state is not None else self._fresh_state(meta)
        attn = rec = 0
        for layer in self.layers:
            if isinstance(layer, RecurrentLayer):
                x = layer(x, state.pools[rec], state)
                rec += 1
            else:
                x = layer(x, rope, None if kv_caches is None else kv_caches[attn], meta)
                attn += 1
        return self.norm(x)

    def _fresh_state(self, meta: AttentionMetadata) -> StateMetadata:
        """Zero states for a step without a pool: each prefill chunk a sequence of its own."""
        layout = self.config.state_layout
        assert layout is not None
        spans = [(c.token_start, c.num_tokens) for c in meta.prefills]
        if meta.num_decode_tokens:
            raise ValueError("decode rows need the state pool")
        pools = [
            (
                torch.zeros(len(spans), *layout.conv_shape),
                torch.zeros(len(spans), *layout.ssm_shape),
            )
            for _ in range(layout.num_layers)
        ]
        return StateMetadata.fresh(spans, pools)


def take_conv_weight(loader: HFLoader, name: str, channels: int) -> torch.Tensor:
    """A depthwise conv's weight as (channels, K): Hugging Face's (C, 1, K) or the GGUF
    converter's squeezed (C, K)."""
    w = loader.take(name)
    return w.reshape(channels, -1)


def conv_parameter(channels: int, kernel: int) -> nn.Parameter:
    return nn.Parameter(torch.zeros(channels, kernel))
