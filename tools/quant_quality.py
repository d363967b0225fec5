"""What quantization and a float16 or int8 KV cache cost in quality: perplexity and logit error on a text.

    python -m tools.quant_quality [--model smollm2-135m-instruct] [--text FILE] [--tokens 512]

Runs the same text (default: this project's README, a fixed English text) through the model
loaded several ways and compares each with the float32 reference (pure torch, float32 KV):
perplexity of the text, the largest and mean absolute logit difference, and how often the
greedy next token differs. The prompt goes through the paged pool in chunks of 64 tokens, so the
later chunks read their past from the KV cache (where a float16 or int8 cache matters).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from models import AttentionMetadata, PrefillChunk, kernels, load_model

CHUNK = 64
BLOCK = 16


def prefill_hidden(lm, ids: list[int], chunk: int = CHUNK) -> torch.Tensor:
    """(T, hidden) final hidden states of `ids` as one sequence, prefilled `chunk` tokens a step
    through an empty paged pool (block 0 unused, as the engine's padding block)."""
    model = lm.model
    layout = model.config.kv_layout
    nblocks = -(-len(ids) // BLOCK) + 1
    pool = torch.zeros(layout.pool_shape(nblocks, BLOCK), dtype=layout.dtype)
    caches = [(pool[i, 0], pool[i, 1]) for i in range(layout.num_layers)]
    table = torch.arange(1, nblocks)
    out = []
    with torch.inference_mode():
        for start in range(0, len(ids), chunk):
            piece = ids[start : start + chunk]
            n, end = len(piece), start + len(piece)
            nb = -(-end // BLOCK)
            meta = AttentionMetadata(
                slot_mapping=table[torch.arange(start, end) // BLOCK] * BLOCK
                + torch.arange(start, end) % BLOCK,
                num_decode_tokens=0,
                decode_block_tables=None,
                decode_context_lens=None,
                prefills=[PrefillChunk(0, n, end, table[:nb])],
            )
            out.append(model(torch.tensor(piece), torch.arange(start, end), caches, meta))
    return torch.cat(out)


def logits_of(lm, ids: list[int]) -> torch.Tensor:
    """(T, vocab) logits for every position, prefilled through the pool chunk by chunk."""
    with torch.inference_mode():
        return lm.model.compute_logits(prefill_hidden(lm, ids))


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    target = torch.tensor(ids[1:])
    nll = torch.nn.functional.cross_entropy(logits[:-1].float(), target)
    return math.exp(float(nll))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--text", type=Path, default=Path(__file__).parents[1] / "README.md")
    ap.add_argument("--tokens", type=int, default=512)
    args = ap.parse_args(argv)
    f32a = {"activations": "float32"}
    i8a = {"activations": "int8"} if kernels.has_int8_dot() else f32a
    configs = [
        ("float32 weights, float32 KV (pure torch: the reference)", "ref", {}),
        ("file's own blocks, float32 KV (kernels)", "k", {"kv_cache_dtype": "float32", **f32a}),
        ("file's own blocks, float16 KV (kernels)", "k", f32a),
        ("file's own blocks, float16 KV, int8 activations", "k", i8a),
        ("file's own blocks, int8 KV (kernels)", "k", {"kv_cache_dtype": "int8", **f32a}),
        ("file's own blocks, int8 KV, int8 activations", "k", {"kv_cache_dtype": "int8", **i8a}),
        ("q8_0 weights, float16 KV", "k", {"quantization": "q8_0", **f32a}),
        ("q8_0 weights, float16 KV, int8 activations", "k", {"quantization": "q8_0", **i8a}),
        ("q4_1 weights, float16 KV", "k", {"quantization": "q4_1", **f32a}),
        ("float32 weights (dequantized), float32 KV (kernels)", "k", {"quantization": "none"}),
    ]
    text = args.text.read_text()
    ref_logits = None
    ids: list[int] = []
    print(f"model {args.model}, text {args.text.name}, first {args.tokens} tokens\n")
    print(
        f"{'configuration':58} {'ppl':>7} {'max |dlogit|':>12} {'mean':>8} {'argmax differs':>14}"
    )
    for label, mode, kw in configs:
        lm = load_model(args.model, use_kernels=mode != "ref", **kw)
        if not ids:
            ids = lm.tokenizer.encode(text)[: args.tokens]
        logits = logits_of(lm, ids)
        ppl = perplexity(logits, ids)
        if ref_logits is None:
            ref_logits = logits
        diff = (logits - ref_logits).abs()
        flips = (logits.argmax(-1) != ref_logits.argmax(-1)).float().mean()
        print(
            f"{label:58} {ppl:7.3f} {float(diff.max()):12.4f} {float(diff.mean()):8.5f} "
            f"{float(flips):14.2%}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
