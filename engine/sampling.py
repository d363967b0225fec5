"""Batched sampling over a `[batch, vocab]` logits tensor.

Every processing step works on the whole batch, and is skipped when no row needs it (a greedy
batch is one argmax). Randomness comes only from each request's own `torch.Generator`, drawn per
row, so a seeded request samples the same tokens whatever else shares its batch.

Order, as vLLM applies it: the structured-output grammar mask (constrained rows only, see
`engine.structured`), logit bias, min_tokens (stop ids masked), penalties, then either argmax
(temperature 0) or temperature, top-k, top-p, min-p and a draw. Logprobs are reported from the
model's raw distribution (vLLM's default), not the processed one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.request import RequestState, TokenLogprob
from engine.structured import apply_constraints


def _apply_logit_bias(logits: torch.Tensor, states: Sequence[RequestState]) -> None:
    vocab = logits.shape[1]
    for i, s in enumerate(states):
        for tok, bias in s.params.logit_bias:
            if tok < vocab:
                logits[i, tok] += bias


def _apply_min_tokens(logits: torch.Tensor, states: Sequence[RequestState]) -> None:
    for i, s in enumerate(states):
        if s.num_output_tokens < s.params.min_tokens and s.stop_ids:
            logits[i, list(s.stop_ids)] = float("-inf")


def _apply_penalties(logits: torch.Tensor, states: Sequence[RequestState]) -> None:
    vocab = logits.shape[1]
    rows = [i for i, s in enumerate(states) if s.params.needs_penalties]
    for i in rows:
        s, p = states[i], states[i].params
        row = logits[i]
        if p.repetition_penalty != 1.0:
            # HF semantics: every token seen in prompt or output is made less likely.
            seen = torch.tensor(sorted(set(s.token_ids)), dtype=torch.long)
            vals = row[seen]
            row[seen] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
        if p.presence_penalty or p.frequency_penalty:
            # OpenAI semantics: over generated tokens only.
            out = s.output_token_ids
            if out:
                counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=vocab)[
                    :vocab
                ]
                row -= p.frequency_penalty * counts.to(row.dtype)
                row -= p.presence_penalty * (counts > 0).to(row.dtype)


def _filter_top_k_top_p_min_p(logits: torch.Tensor, states: Sequence[RequestState]) -> torch.Tensor:
    """Mask (to -inf) what top-k, top-p and min-p exclude; rows that use none are untouched."""
    vocab = logits.shape[1]
    top_k = [vocab if s.params.top_k is None else s.params.top_k for s in states]
    top_p = [s.params.top_p for s in states]
    min_p = [s.params.min_p for s in states]
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V)
        ranks = torch.arange(vocab).expand_as(sorted_logits)
        drop = ranks >= torch.tensor(top_k)[:, None]
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before
        # it already reaches p. The first token always stays.
        mass_before = probs.cumsum(dim=-1) - probs
        drop |= mass_before >= torch.tensor(top_p, dtype=probs.dtype)[:, None]
        drop[:, 0] = False
        mask = torch.zeros_like(drop).scatter_(1, order, drop)
        logits = logits.masked_fill(mask, float("-inf"))
    if any(p > 0.0 for p in min_p):
        probs = logits.softmax(dim=-1)
        floor = (
            torch.tensor(min_p, dtype=probs.dtype)[:, None] * probs.max(dim=-1, keepdim=True).values
        )
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


def _logprobs(
    raw: torch.Tensor, tokens: list[int], states: Sequence[RequestState]
) -> list[TokenLogprob | None]:
    result: list[TokenLogprob | None] = [None] * len(states)
    rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
    if not rows:
        return result
    lp = raw[rows].log_softmax(dim=-1)  # (R, V)
    n_top = max(states[i].params.logprobs for i in rows)
    top_vals, top_ids = lp.topk(max(n_top, 1), dim=-1) if n_top else (None, None)
    for j, i in enumerate(rows):
        n = states[i].params.logprobs
        top = ()
        if n:
            top = tuple(zip(top_ids[j, :n].tolist(), top_vals[j, :n].tolist(), strict=True))
        result[i] = TokenLogprob(tokens[i], float(lp[j, tokens[i]]), top)
    return result


def _keep_a_grammar_token(
    logits: torch.Tensor,
    raw: torch.Tensor,
    states: Sequence[RequestState],
    disallowed: torch.Tensor,
) -> None:
    """A constrained row that bias or min_tokens left with no allowed token (min_tokens masking
    the EOS a finished grammar needs) samples from the grammar's tokens alone instead."""
    rows = [i for i, s in enumerate(states) if s.constraint is not None]
    for j, i in enumerate(rows):
        if torch.isneginf(logits[i]).all():
            logits[i] = raw[i].masked_fill(disallowed[j], float("-inf"))


def sample(
    logits: torch.Tensor, states: Sequence[RequestState]
) -> tuple[list[int], list[TokenLogprob | None]]:
    """Pick one token per row. logits: (B, V) fp32, row i belongs to states[i]."""
    raw = logits
    disallowed = None
    if any(s.constraint is not None for s in states):
        logits = logits.clone()
        disallowed = apply_constraints(logits, states)
    if (
        any(s.params.logit_bias for s in states)
        or any(s.params.min_tokens and s.num_output_tokens < s.params.min_tokens for s in states)
        or any(s.params.needs_penalties for s in states)
    ):
        if disallowed is None:
            logits = logits.clone()
        _apply_logit_bias(logits, states)
        _apply_min_tokens(logits, states)
        _apply_penalties(logits, states)
        if disallowed is not None:
            _keep_a_grammar_token(logits, raw, states, disallowed)

    tokens = logits.argmax(dim=-1).tolist()
    random_rows = [i for i, s in enumerate(states) if not s.params.greedy]
    if random_rows:
        sub = [states[i] for i in random_rows]
        temps = torch.tensor([s.params.temperature for s in sub], dtype=logits.dtype)[:, None]
        scaled = _filter_top_k_top_p_min_p(logits[random_rows] / temps, sub)
        probs = scaled.softmax(dim=-1)  # (R, V)
        for j, (i, s) in enumerate(zip(random_rows, sub, strict=True)):
            # Exponential race (Gumbel-max in another form): argmax p / E with E ~ Exp(1) is an
            # exact draw from p, and needs only this request's generator.
            noise = torch.empty_like(probs[j]).exponential_(generator=s.generator)
            tokens[i] = int((probs[j] / noise).argmax())
    return tokens, _logprobs(raw, tokens, states)
