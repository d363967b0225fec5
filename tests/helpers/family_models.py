"""Tiny random models of the newer families, written as both sources a server loads (a Hugging
Face directory and a GGUF file) with one tokenizer between them.

- `gemma4_config`, `gpt_oss_config`: transformers' configs of Gemma 4 (text) and gpt-oss with
  what the published models have (the shapes tests/test_gemma4.py and tests/test_gpt_oss.py
  check against transformers): sliding and global layers, shared KV, per-layer inputs and a soft
  cap; sinks, biases, experts and YaRN.
- `draw_layer_scalars`, `draw_sinks`: the parameters `randomize_` leaves as initialised (buffers,
  or small values that would hide a missing sink).
- `byte_bpe_tokenizer`: a byte-level BPE (three specials, the 256 bytes, three merges, any extra
  special tokens) with a chat template, in transformers' form.
- `gguf_tokenizer`: that same tokenizer as a GGUF file's metadata (for tools.synth_model), so a
  prompt or chat tokenizes to the same ids from either source.
"""

from __future__ import annotations

import torch

VOCAB = 272  # > the tokenizer's ids: a padded embedding, as real checkpoints have
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # pad 0, bos 1, eos 2
MERGES = (("Ġ", "t"), ("Ġt", "h"), ("Ġth", "e"))
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)

SLIDING, FULL = "sliding_attention", "full_attention"


def gemma4_config(**kw):
    """Gemma 4 (E2B's kinds of layer at a tiny width): five sliding layers (window 8, 32-dim
    heads), global ones (64-dim, proportional RoPE), the last two sharing the K/V of the last
    owner of their kind with a double-wide MLP, per-layer inputs, a soft cap that bends logits."""
    from transformers import Gemma4TextConfig

    fields = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, global_head_dim=64,
        max_position_embeddings=256, rms_norm_eps=1e-6,
        layer_types=[SLIDING] * 5 + [FULL, SLIDING, FULL], num_kv_shared_layers=2,
        use_double_wide_mlp=True, hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=VOCAB, final_logit_softcapping=1.5, sliding_window=8, **IDS,
    )  # fmt: skip
    return Gemma4TextConfig(**{**fields, **kw})


def gpt_oss_config(truncate: bool = True, **kw):
    """gpt-oss: windowed, full, windowed layers (window 8), four experts of which two a token,
    YaRN. `truncate`: YaRN's correction range rounded out to whole dims (ggml's rule, which a
    GGUF gets); the published config says False (transformers' exact range)."""
    from transformers import GptOssConfig

    yarn = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "truncate": truncate, "original_max_position_embeddings": 4096}  # fmt: skip
    fields = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=131072,
        sliding_window=8, num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-5,
        rope_parameters=yarn, tie_word_embeddings=False, **IDS,
    )  # fmt: skip
    return GptOssConfig(**{**fields, **kw})


def draw_layer_scalars(model, seed: int) -> None:
    """Gemma 4's layer scalars in [0.5, 1.5) (a buffer of ones as initialised would hide one
    left out)."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.layer_scalar.copy_(0.5 + torch.rand(1, generator=g))


def draw_sinks(model, seed: int) -> None:
    """gpt-oss's sinks around 2: a head's sink then outweighs several keys."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            sinks = layer.self_attn.sinks
            sinks.copy_(2 + torch.randn(sinks.shape, generator=g))


def write_gpt_oss(path, truncate: bool = True, seed: int = 5):
    """The random transformers gpt-oss (`gpt_oss_config(truncate)`) saved in `path`, its sinks
    drawn around 2 (without the sinks the logits then differ)."""
    from tests.helpers.model_files import write_hf_checkpoint

    ref = write_hf_checkpoint(path, gpt_oss_config(truncate), seed=seed)
    draw_sinks(ref, seed)
    ref.save_pretrained(path)
    return ref


def byte_bpe_tokenizer(chat_template: str, extra_specials: tuple[str, ...] = ()):
    """The byte-level BPE in transformers' form: SPECIALS (0-2), the 256 bytes (3-258), the
    merged "Ġt", "Ġth", "Ġthe" (259-261), then `extra_specials` (a family's turn tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    pieces = [*SPECIALS, *bytes_to_unicode().values(), *("".join(m) for m in MERGES)]
    tk = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=list(MERGES)))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([*SPECIALS, *extra_specials])
    assert len(tk.get_vocab()) == len(pieces) + len(extra_specials) <= VOCAB
    return PreTrainedTokenizerFast(
        tokenizer_object=tk,
        pad_token=SPECIALS[0],
        bos_token=SPECIALS[1],
        eos_token=SPECIALS[2],
        chat_template=chat_template,
    )


def gguf_tokenizer(tok):
    """`tok` (from `byte_bpe_tokenizer`) as GGUF metadata: its tokens in id order (specials
    control tokens), merges, special ids and chat template; tools.synth_model pads it to the
    embedding's size with unused tokens."""
    from gguf import GGUFValueType as V

    from tools.synth_model import Tokenizer

    tokens = tok.convert_ids_to_tokens(list(range(len(tok))))
    special = set(tok.all_special_ids) | set(tok.added_tokens_decoder)
    types = [3 if i in special else 1 for i in range(len(tokens))]
    fields = {
        "tokenizer.ggml.model": ("gpt2", V.STRING, None),
        "tokenizer.ggml.pre": ("default", V.STRING, None),
        "tokenizer.ggml.tokens": (tokens, V.ARRAY, V.STRING),
        "tokenizer.ggml.token_type": (types, V.ARRAY, V.INT32),
        "tokenizer.ggml.merges": ([f"{a} {b}" for a, b in MERGES], V.ARRAY, V.STRING),
        "tokenizer.ggml.padding_token_id": (tok.pad_token_id, V.UINT32, None),
        "tokenizer.ggml.bos_token_id": (tok.bos_token_id, V.UINT32, None),
        "tokenizer.ggml.eos_token_id": (tok.eos_token_id, V.UINT32, None),
        "tokenizer.chat_template": (tok.chat_template, V.STRING, None),
    }
    return Tokenizer(fields, "byte-level test tokenizer")
