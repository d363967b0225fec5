"""Gemma 3 (text) and Gemma 2: the Llama decoder's attention and gated MLP inside Gemma's layer
shape. Gemma 2 is the same layer without QK-norm, with a sliding window on every other layer and
its attention scores soft-capped (`ModelConfig.attn_logit_softcapping`, which the attention
kernel applies), its logits too (`final_logit_softcapping`, as Gemma 3 may).

What differs from `models.llama` (everything else, the packed kernels included, is
`models.decoder`'s):
four RMSNorms a layer (before and after attention, before and after the MLP, the "after" ones on
the branch before it joins the residual stream); GeGLU with tanh GELU; QK-norm, sliding windows
on most layers with their own RoPE base, the attention scale 1/sqrt(query_pre_attn_scalar) and
embeddings times sqrt(hidden) (`ModelConfig` options the shared attention reads); and norm
weights stored as w for a (1 + w) multiplier in Hugging Face checkpoints (GGUF files store w + 1;
their loader hands Hugging Face values here).
"""

from __future__ import annotations

import torch

from models.config import ModelConfig
from models.decoder import MLP, Attention, DecoderForCausalLM, DecoderLayer, RMSNorm


class Gemma3DecoderLayer(DecoderLayer):
    NORMS = (
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    )

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(d, eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.pre_feedforward_layernorm = RMSNorm(d, eps)
        self.mlp = MLP(config)
        self.post_feedforward_layernorm = RMSNorm(d, eps)

    def forward(self, x, rope, kv_cache, meta) -> torch.Tensor:
        # The branch is normed before it joins the stream, so the residual cannot ride into the
        # projection's epilogue as in the Llama layer.
        h = self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class Gemma3ForCausalLM(DecoderForCausalLM):
    layer_class = Gemma3DecoderLayer
    hf_norm_offset = 1.0
