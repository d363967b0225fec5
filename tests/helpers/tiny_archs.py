"""The tiny random configuration of each architecture the decoder serves (transformers' own
config classes; nothing downloaded), and a table of what each one has, from which the tests build
their per-architecture parameter lists: a test runs on exactly the architectures that have what it
checks, and none is collected only to be skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

VOCAB = 272  # > the byte-level tokenizer's 259 ids: a padded embedding, as real checkpoints have
WINDOW = 8


def _base(**kw) -> dict:
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
    )
    return {**base, **kw}


def gemma3_config():
    from transformers import Gemma3TextConfig

    # 7 layers: the sixth global, the others windowed (transformers' default pattern); head_dim
    # and query_pre_attn_scalar unlike hidden / heads, so each scale is checked
    return Gemma3TextConfig(
        **{
            **_base(num_key_value_heads=1, head_dim=32, sliding_window=WINDOW),
            "num_hidden_layers": 7,
            "query_pre_attn_scalar": 24,
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 100_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1_000.0},
            },
        }
    )


def gemma2_config():
    from transformers import Gemma2Config

    # 3 layers: windowed, global, windowed; soft caps low enough that this random model's scores
    # and logits reach them (`test_gemma2_soft_caps_change_what_it_computes`)
    return Gemma2Config(
        **{**_base(head_dim=32, sliding_window=WINDOW), "num_hidden_layers": 3},
        query_pre_attn_scalar=24,
        attn_logit_softcapping=SCORE_CAP,
        final_logit_softcapping=LOGIT_CAP,
    )


SCORE_CAP, LOGIT_CAP = 0.5, 2.0


def qwen3_config():
    from transformers import Qwen3Config

    return Qwen3Config(**_base(head_dim=32, tie_word_embeddings=False))


def qwen2_config():
    from transformers import Qwen2Config

    return Qwen2Config(**_base(tie_word_embeddings=True))


def phi3_config():
    from transformers import Phi3Config

    return Phi3Config(
        **_base(sliding_window=WINDOW, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    )


# LongRoPE with an original context of 16 tokens: a sequence longer than that runs transformers
# on the long factors, one within it on the short ones. Unlike factors, so each is checked.
ORIGINAL = 16


def _longrope(n: int) -> dict:
    return {
        "rope_type": "longrope",
        "rope_theta": 10_000.0,
        "short_factor": [1.0 + 0.25 * i for i in range(n)],
        "long_factor": [1.0 + 3.0 * i for i in range(n)],
        "original_max_position_embeddings": ORIGINAL,
    }


# (Phi3Config's own field, which it copies over the rope parameters' one)
_ORIGINAL = {"original_max_position_embeddings": ORIGINAL}


def phi3_longrope_config():
    """Phi-3.5-mini's (and Phi-3's 128k) form: LongRoPE over the whole head."""
    from transformers import Phi3Config

    return Phi3Config(**_base(pad_token_id=0, rope_parameters=_longrope(8), **_ORIGINAL))


def phi4_mini_config():
    """Phi-4-mini's form: LongRoPE over the first 3/4 of each head, tied embeddings."""
    from transformers import Phi3Config

    rope = {**_longrope(6), "partial_rotary_factor": 0.75}
    return Phi3Config(
        **_base(pad_token_id=0, rope_parameters=rope, tie_word_embeddings=True, **_ORIGINAL)
    )


def smollm3_config():
    """SmolLM3: NoPE every fourth layer (the fourth of four here)."""
    from transformers import SmolLM3Config

    return SmolLM3Config(**_base(num_hidden_layers=4, pad_token_id=0))


def llama3_config():
    from transformers import LlamaConfig

    scaling = {
        "rope_type": "llama3",
        "rope_theta": 500_000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,  # short: the prompts reach the scaled range
    }
    return LlamaConfig(**_base(rope_parameters=scaling))


def qwen3moe_config():
    """Qwen3-MoE: 8 experts, 2 a token, every layer sparse; the dense size unused."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        **_base(head_dim=32, tie_word_embeddings=False),
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
    )


@dataclass(frozen=True)
class TinyArch:
    config: Callable[[], Any]
    # The llama.cpp architecture tests/test_models_arch.py's GGUF writer stores it as; None where
    # that writer does not write it (Llama 3 and SmolLM3 GGUFs have their q/k rows permuted: they
    # are written and checked by tools.synth_model's tests and tests/test_models_real.py).
    gguf_arch: str | None
    longrope: bool = False  # LongRoPE: a short and a long set of rotary factors
    moe: bool = False  # a sparse (mixture of experts) MLP: runs layer by layer, not as one op


ARCHS: dict[str, TinyArch] = {
    "gemma3": TinyArch(gemma3_config, "gemma3"),
    "gemma2": TinyArch(gemma2_config, "gemma2"),
    "qwen3": TinyArch(qwen3_config, "qwen3"),
    "qwen2": TinyArch(qwen2_config, "qwen2"),
    "phi3": TinyArch(phi3_config, "phi3"),
    "llama3": TinyArch(llama3_config, None),
    "phi3_longrope": TinyArch(phi3_longrope_config, "phi3", longrope=True),
    "phi4_mini": TinyArch(phi4_mini_config, "phi3", longrope=True),
    "smollm3": TinyArch(smollm3_config, None),
    "qwen3moe": TinyArch(qwen3moe_config, "qwen3moe", moe=True),
}


def arch_names(where: Callable[[TinyArch], bool] = lambda arch: True) -> list[str]:
    """The architectures `where` holds for, in the table's order."""
    return [name for name, arch in ARCHS.items() if where(arch)]
