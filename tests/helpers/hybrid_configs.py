"""Tiny transformers configs of the hybrid families (recurrent layers beside attention layers),
shared by their oracle tests and the state pool's."""

from __future__ import annotations

VOCAB = 272


def lfm2_config():
    from transformers import Lfm2Config

    # two attention layers among three conv layers: each finds its own K/V and state pools
    return Lfm2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=5,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        layer_types=["conv", "full_attention", "conv", "conv", "full_attention"],
        block_auto_adjust_ff_dim=False, norm_eps=1e-5, tie_word_embeddings=True,
    )  # fmt: skip


def qwen35_config():
    from transformers import Qwen3_5TextConfig

    # four value heads to two q/k heads: the grouped (Hugging Face) and tiled (GGUF) head orders
    # differ; three GDN layers and one gated attention layer, partial rotary 0.25 of 32
    return Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, tie_word_embeddings=False,
    )  # fmt: skip


def granite_hybrid_config():
    from transformers import GraniteMoeHybridConfig

    # dense (no experts), two groups of B and C over eight Mamba2 heads of 16, three Mamba2
    # layers and one attention layer, Granite's four multipliers away from 1, no RoPE
    return GraniteMoeHybridConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, shared_intermediate_size=96,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, layer_types=["mamba", "attention", "mamba", "mamba"],
        mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4, mamba_expand=2,
        num_local_experts=0, embedding_multiplier=6.0, attention_multiplier=0.125,
        residual_multiplier=0.4, logits_scaling=2.5, rms_norm_eps=1e-5, tie_word_embeddings=False,
    )  # fmt: skip


def qwen35_moe_config():
    from transformers import Qwen3_5MoeTextConfig

    # Qwen3.5's tiny shapes with eight experts of 32 (two a token) and a shared expert of 64
    # (widths the kernels pack: a multiple of 32)
    return Qwen3_5MoeTextConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=8,
        num_experts_per_tok=2, tie_word_embeddings=False,
    )  # fmt: skip


def lfm2_moe_config():
    from transformers import Lfm2MoeConfig

    # a dense leading layer, then sparse ones (eight experts of 32, two a token, an expert bias)
    return Lfm2MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, num_dense_layers=1, num_experts=8, num_experts_per_tok=2,
        layer_types=["conv", "full_attention", "conv", "conv", "full_attention"],
        norm_eps=1e-5, tie_word_embeddings=True,
    )  # fmt: skip
