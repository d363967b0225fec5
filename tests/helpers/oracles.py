"""The independent computations tests compare with: transformers' logits, greedy tokens,
log-probabilities and hidden states, and transformers' own reading of a GGUF file; with our full
forward, the thing compared.

Tolerance: logits agree within `ATOL` absolute (fp32; observed ~1e-4 on SmolLM2, whose logits
reach ~40) and their argmax agrees everywhere.
"""

from __future__ import annotations

from pathlib import Path

import torch

from models import AttentionMetadata, LoadedModel, PrefillChunk
from models.gguf_reader import transformers_reads_fast
from tests.helpers.engine_runs import engine_logits
from tests.helpers.model_files import random_ids
from tests.helpers.tiny_archs import VOCAB

ATOL = 1e-3


def our_logits(lm: LoadedModel, ids: list[int]) -> torch.Tensor:
    """Full-prompt forward without a KV pool: (T, vocab) fp32."""
    t = len(ids)
    meta = AttentionMetadata(
        slot_mapping=None,
        num_decode_tokens=0,
        decode_block_tables=None,
        decode_context_lens=None,
        prefills=[PrefillChunk(0, t, t, None)],
    )
    with torch.inference_mode():
        hidden = lm.model(torch.tensor(ids), torch.arange(t), None, meta)
        return lm.model.compute_logits(hidden)


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """(T, vocab) log-probabilities of the next token at each position."""
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def hf_hidden(model, ids: list[int]) -> torch.Tensor:
    """(T, hidden) final hidden states (after the last norm), in float64."""
    with torch.inference_mode():
        return model.model(torch.tensor([ids])).last_hidden_state[0].double()


def assert_logits_match(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    assert diff <= ATOL, f"max |logit difference| {diff:.2e} > {ATOL}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    model.generation_config.eos_token_id = None  # run the full n tokens, as ignore_eos does
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


def hf_from_gguf(path: Path):
    """transformers' own reading of a GGUF file: its config, dequantization and Q/K un-permute."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with transformers_reads_fast():
        cfg = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        with torch.device("meta"):  # skip random init; every weight is assigned below
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)
    tensors = tensors["tensors"]
    model.load_state_dict(tensors, strict=False, assign=True)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg)  # built on meta above
    model.tie_weights()
    meta_left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    assert not meta_left, f"transformers left tensors unloaded: {meta_left}"
    return model.eval()


def check_against(lm, ref, seed: int, short_lm=None) -> None:
    """Full forward and engine against transformers; `short_lm`: the model loaded for contexts
    within LongRoPE's original one, for the sequences within it (transformers' short factors)."""
    ids = random_ids(40, VOCAB, seed=seed)  # 40 > WINDOW
    assert_logits_match(our_logits(lm, ids), hf_logits(ref, ids))
    # the engine: the same tokens as transformers' greedy continuation, and its logits at each
    prompt = ids[:30]
    got, rows = engine_logits(lm, prompt, 6)
    seq = prompt + got
    expected = hf_logits(ref, seq)[len(prompt) - 1 : -1]
    assert torch.equal(torch.stack(rows).argmax(-1), expected.argmax(-1))
    assert (torch.stack(rows) - expected).abs().max().item() <= ATOL
    # a prompt shorter than the window whose decode grows past it (K/V written while the
    # window masks nothing are read once it does)
    got, rows = engine_logits(short_lm or lm, ids[:5], 8)
    expected = hf_logits(ref, ids[:5] + got)[4:-1]
    assert torch.equal(torch.stack(rows).argmax(-1), expected.argmax(-1))
    assert (torch.stack(rows) - expected).abs().max().item() <= ATOL
