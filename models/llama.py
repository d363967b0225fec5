"""The Llama family's decoder: pre-norm layers (RMSNorm, attention, RMSNorm, gated MLP), the
skip connections added in the projections' epilogues.

One model class serves TinyGPT, SmolLM2/3, Llama 2/3, Mistral, Qwen2/2.5, Qwen3 and Phi-3
checkpoints: they differ only in `ModelConfig` (biases, QK-norm, windows, NoPE layers, LongRoPE,
partial rotary) and in their checkpoints' tensor names (Phi-3 stores q/k/v and gate/up fused,
which is the shared pieces' own layout), which `models.arch` reads for each. The pieces are
`models.decoder`'s.
"""

from __future__ import annotations

import torch

from models.config import ModelConfig
from models.decoder import MLP, Attention, DecoderForCausalLM, DecoderLayer, RMSNorm


class LlamaDecoderLayer(DecoderLayer):
    NORMS = ("input_layernorm", "post_attention_layernorm")

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, rope, kv_cache, meta) -> torch.Tensor:
        # The skip connections ride into the projections (added in the packed kernel's epilogue).
        x = self.self_attn(self.input_layernorm(x), rope, kv_cache, meta, residual=x)
        return self.mlp(self.post_attention_layernorm(x), residual=x)


class LlamaForCausalLM(DecoderForCausalLM):
    layer_class = LlamaDecoderLayer
