"""Perplexity of a text file, computed the way llama.cpp's `llama-perplexity` computes it, so the
two figures can be compared on the same model file and text.

    python -m tools.perplexity --model gemma-3-270m -f README.md -c 512

The method (llama.cpp's tools/perplexity, its default mode without --ppl-stride):

- the whole file is tokenized once, with the tokenizer's special tokens (BOS first where the
  model adds one) and without parsing special-token text inside the file;
- it needs at least 2 * n_ctx tokens; it is cut into floor(tokens / n_ctx) chunks of n_ctx
  tokens (the rest is dropped), each evaluated from an empty cache, its first token replaced by
  BOS when the model adds one;
- only the second half of each chunk is scored (every token there has at least n_ctx / 2 tokens
  of context): the logits at positions n_ctx/2 .. n_ctx-2 predict the tokens after them, so a
  chunk contributes n_ctx/2 - 1 negative log-likelihoods (float64 sums of log-softmax);
- it prints the running perplexity after each chunk, `[i]ppl,`, then
  `Final estimate: PPL = exp(mean nll) +/- its standard error`.

Our side: each chunk is prefilled in one step through a paged KV pool of the loaded model's KV
dtype (as the server computes a prompt; llama.cpp also writes a chunk's K/V to its cache before
attending), and only the scored rows go through the output head, in slices (Gemma's 262,144-token
head would otherwise make a 512 MiB logits matrix per chunk).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from models import LoadedModel
from tools.model_args import add_model_args, load_from_args
from tools.quant_quality import prefill_hidden

HEAD_ROWS = 64  # rows through the output head at once


@dataclass
class PerplexityResult:
    """Running sums as llama-perplexity keeps them, and the perplexity after each chunk."""

    n_ctx: int
    nll: float = 0.0  # sum of negative log-likelihoods
    nll2: float = 0.0  # sum of their squares
    count: int = 0
    running: list[float] = field(default_factory=list)  # perplexity after chunk 1, 2, ...

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.count)

    @property
    def ppl_stderr(self) -> float:
        """llama-perplexity's "+/-": the standard error of the mean nll, times the perplexity."""
        mean = self.nll / self.count
        var = self.nll2 / self.count - mean * mean
        return math.sqrt(max(var, 0.0) / (self.count - 1)) * self.ppl


def tokenize(lm: LoadedModel, text: str) -> tuple[list[int], bool]:
    """(the file's tokens with the model's special prefix, whether that prefix is BOS)."""
    tokens = lm.tokenizer.encode(text, add_special_tokens=True)
    bos = lm.tokenizer.bos_token_id
    return tokens, bool(tokens) and bos is not None and tokens[0] == bos


def chunk_logits(lm: LoadedModel, ids: list[int], first: int) -> torch.Tensor:
    """Logits (len(ids) - 1 - first, vocab) at positions first .. len(ids) - 2 of one sequence
    prefilled in one step through an empty paged pool."""
    hidden = prefill_hidden(lm, ids, chunk=len(ids))[first : len(ids) - 1]
    with torch.inference_mode():
        return torch.cat(
            [
                lm.model.compute_logits(hidden[i : i + HEAD_ROWS])
                for i in range(0, len(hidden), HEAD_ROWS)
            ]
        )


def perplexity(
    lm: LoadedModel,
    tokens: list[int],
    n_ctx: int,
    add_bos: bool,
    n_chunks: int | None = None,
    on_chunk=None,
) -> PerplexityResult:
    """llama-perplexity's estimate over `tokens` (see the module docstring); `on_chunk(i, result)`
    is called after each chunk."""
    if len(tokens) < 2 * n_ctx:
        raise ValueError(
            f"you need at least {2 * n_ctx} tokens to evaluate perplexity with a context of "
            f"{n_ctx}; the text tokenizes to only {len(tokens)}"
        )
    chunks = len(tokens) // n_ctx
    if n_chunks is not None and n_chunks >= 0:
        chunks = min(chunks, n_chunks)
    first = n_ctx // 2
    bos = lm.tokenizer.bos_token_id
    result = PerplexityResult(n_ctx)
    for i in range(chunks):
        ids = tokens[i * n_ctx : (i + 1) * n_ctx]
        if add_bos:
            ids = [bos, *ids[1:]]
        logits = chunk_logits(lm, ids, first).double()
        target = torch.tensor(ids[first + 1 :])
        nll = -torch.log_softmax(logits, dim=-1).gather(1, target[:, None])[:, 0]
        result.nll += float(nll.sum())
        result.nll2 += float((nll * nll).sum())
        result.count += len(target)
        result.running.append(result.ppl)
        if on_chunk is not None:
            on_chunk(i, result)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tools.perplexity",
        description=__doc__.split("\n\n")[0],
    )
    ap.add_argument("-m", "--model", required=True, help="a model name, GGUF file or HF directory")
    ap.add_argument("-f", "--file", required=True, type=Path, help="the text file")
    ap.add_argument("-c", "--ctx-size", type=int, default=512, help="tokens per chunk (n_ctx)")
    ap.add_argument("--chunks", type=int, default=-1, help="at most this many chunks (-1: all)")
    add_model_args(ap)
    args = ap.parse_args(argv)
    if args.ctx_size < 4 or args.ctx_size % 2:
        ap.error("--ctx-size must be an even number >= 4")
    text = args.file.read_text(encoding="utf-8", errors="replace")
    lm = load_from_args(args)
    tokens, add_bos = tokenize(lm, text)
    n_chunks = len(tokens) // args.ctx_size
    if args.chunks >= 0:
        n_chunks = min(n_chunks, args.chunks)
    print(
        f"perplexity: {len(tokens)} tokens; calculating perplexity over {n_chunks} chunks, "
        f"n_ctx={args.ctx_size}",
        file=sys.stderr,
    )

    def show(i: int, r: PerplexityResult) -> None:
        print(f"[{i + 1}]{r.running[-1]:.4f},", end="", flush=True)

    try:
        result = perplexity(lm, tokens, args.ctx_size, add_bos, args.chunks, on_chunk=show)
    except ValueError as e:
        print(f"perplexity: {e}", file=sys.stderr)
        return 1
    print()
    print(f"Final estimate: PPL = {result.ppl:.4f} +/- {result.ppl_stderr:.5f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
