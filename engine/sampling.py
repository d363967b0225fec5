"""Batched sampling over a `[batch, vocab]` logits tensor.

The masks, bias and penalties work on the whole batch and are skipped when no row needs them (a
greedy batch is one argmax, through the project's kernel where it is built: torch's reads ~4.5 GB/s,
1.1 ms of a 32-row step). Each random row is then drawn on its own: its filters start from its
top-k candidates instead of sorting the vocabulary, and the draw is one uniform number from the
request's own `torch.Generator` against the kept tokens' cumulative probabilities; every
operation sees only that row, so a seeded request samples the same tokens whatever else shares
its batch. (With SmolLM2's default sampling, temperature 0.2 and top_p 0.9, sorting the 49,152
logits and drawing noise for each of them cost ~7 ms a row, more than the model's decode step.)

Order, as vLLM applies it: the structured-output grammar mask (constrained rows only, see
`engine.structured`), logit bias, min_tokens (stop ids masked), penalties, then either argmax
(temperature 0) or temperature, top-k, top-p, min-p and a draw. Logprobs are reported from the
model's raw distribution (vLLM's default), not the processed one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from engine.request import RequestState, TokenLogprob
from engine.structured import apply_constraints
from models import kernels, ops


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


# Candidates a filtered row starts from: the nucleus is almost always far smaller (a chat model at
# temperature 0.2 and top_p 0.9 keeps a handful of tokens), and topk of 256 costs ~0.1 ms a row
# where sorting a 49,152-token vocabulary costs ~3.6 ms (measured here, 2 threads). When the
# candidates hold less than top_p of the mass (a flat distribution), the row sorts in full.
CANDIDATES = 256


# exp of arguments below about -87 underflows float32, and torch's vectorized exp takes a slow path
# for those: over a 32 x 49,152 batch at temperature 0.2 (log-probabilities down to -200) it took
# 12.8 ms instead of 1.6. Clamping first costs nothing in the result: each clamped term adds
# e^-87 ~ 1.6e-38 to a sum that is at least 1.
EXP_FLOOR = -87.0


def _log_norm(x: torch.Tensor) -> torch.Tensor:
    """log(sum(exp(x))) of one row (1-D)."""
    top = x.max()
    return top + (x - top).clamp_(min=EXP_FLOOR).exp_().sum().log()


def _cut(
    vals: torch.Tensor,
    ids: torch.Tensor,
    log_norm: torch.Tensor | None,
    top_p: float,
    min_p: float,
    complete: bool,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Top-p, then min-p, over candidates sorted best first (`log_norm`: the log of the
    distribution's normalizer). None when the candidates are not `complete` and hold less than
    top_p of the mass: the nucleus may reach past them."""
    if top_p < 1.0:
        probs = (vals - log_norm).clamp_(min=EXP_FLOOR).exp_()
        before = probs.cumsum(dim=0) - probs
        if not complete and float(before[-1] + probs[-1]) < top_p:
            return None
        # Keep the smallest prefix whose mass reaches top_p: a token goes when the mass before it
        # already reaches p. The first token always stays.
        keep = before < top_p
        keep[0] = True
        vals, ids = vals[keep], ids[keep]
    if min_p > 0.0:
        # p >= min_p * p_max is x >= x_max + log(min_p): no normalizer, no exponentials.
        keep = vals >= vals.max() + math.log(min_p)
        vals, ids = vals[keep], ids[keep]
    return ids, vals


def _nucleus(
    x: torch.Tensor, top_k: int | None, top_p: float, min_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens a row keeps after top-k, top-p and min-p, and their logits: best first, except
    with min-p alone (vocabulary order). x: the row's temperature-scaled logits (V,).
    Semantics as vLLM's: top-p over the top-k distribution renormalized, then min-p against the
    best kept token's probability."""
    vocab = x.shape[0]
    if top_k is not None and top_k < vocab:
        vals, ids = x.topk(top_k)  # sorted, best first: the whole top-k distribution
        return _cut(vals, ids, torch.logsumexp(vals, dim=0), top_p, min_p, complete=True)
    if top_p < 1.0:
        vals, ids = x.topk(min(CANDIDATES, vocab))
        return _cut_or_sort(vals, ids, _log_norm(x), top_p, min_p, vocab, lambda: x)
    ids = (x >= x.max() + math.log(min_p)).nonzero().squeeze(1)  # min-p alone, as `_cut` keeps
    return ids, x[ids]


def _cut_or_sort(
    vals: torch.Tensor,
    ids: torch.Tensor,
    log_norm: torch.Tensor,
    top_p: float,
    min_p: float,
    vocab: int,
    row: Callable[[], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_cut` of a row's best candidates, or of its whole sorted vocabulary when the nucleus
    reaches past them. `row()`: the scaled row (made only when a flat row needs it)."""
    cut = _cut(vals, ids, log_norm, top_p, min_p, complete=len(vals) == vocab)
    if cut is not None:
        return cut
    vals, ids = row().sort(descending=True)
    return _cut(vals, ids, log_norm, top_p, min_p, complete=True)


def _pick(ids: torch.Tensor | None, vals: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw among `vals` (logits; `ids` their tokens, None: the whole vocabulary).

    Inverse CDF: one uniform number from the request's generator against the cumulative
    probabilities (float64, so the rounding of a 49,152-term sum stays ~1e-12); a zero-width
    interval (a masked token) can never hold it. ~0.07 ms over the whole vocabulary, where an
    exponential race (noise for every token) cost ~1 ms a row here: torch's CPU generator is
    sequential."""
    cdf = vals.softmax(dim=0).double().cumsum(dim=0)
    u = torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1]
    j = min(int(torch.searchsorted(cdf, u, right=True)), len(cdf) - 1)
    return j if ids is None else int(ids[j])


def _greedy_tokens(logits: torch.Tensor, states: Sequence[RequestState]) -> list[int]:
    """Each row's argmax (the first maximum, as torch.argmax); a batch without a greedy row gets
    placeholders, which the draws replace."""
    if not any(s.params.greedy for s in states):
        return [0] * len(states)
    return argmax_rows(logits)


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """torch.argmax(logits, -1) as a list, through the project's kernel where it is built."""
    if logits.dtype == torch.float32 and kernels.available():
        return ops.argmax_rows(logits).tolist()
    return logits.argmax(dim=-1).tolist()


def _draw_random_rows(
    logits: torch.Tensor, states: Sequence[RequestState], tokens: list[int]
) -> None:
    """The random rows' tokens: temperature, the filters, a draw with each request's own
    generator. Rows with top-p and no top-k take their candidates from one batched selection
    (`_batched_candidates`; a top-k row's own topk of k is cheaper); everything whose
    arithmetic could depend on the rows beside it (the cut, the draw) runs on the row alone, so a
    seeded request draws the same tokens whatever shares its batch."""
    vocab = logits.shape[1]
    batched, single = [], []
    for i, s in enumerate(states):
        if s.params.greedy:
            continue
        p = s.params
        if vocab > CANDIDATES and p.top_p < 1.0 and (p.top_k is None or p.top_k >= vocab):
            batched.append(i)
        else:
            single.append(i)
    if batched:
        vals, ids, norms = _batched_candidates(logits, states, batched)
        for j, i in enumerate(batched):
            p = states[i].params
            cut = _cut_or_sort(
                vals[j], ids[j], norms[j], p.top_p, p.min_p, vocab,
                lambda i=i, t=p.temperature: logits[i] / t,
            )  # fmt: skip
            tokens[i] = _pick(*cut, states[i].generator)
    for i in single:
        p = states[i].params
        x = logits[i] / p.temperature
        if p.top_k is None and p.top_p >= 1.0 and p.min_p <= 0.0:
            tokens[i] = _pick(None, x, states[i].generator)
        else:
            tokens[i] = _pick(*_nucleus(x, p.top_k, p.top_p, p.min_p), states[i].generator)


def _batched_candidates(
    logits: torch.Tensor, states: Sequence[RequestState], rows: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For `rows` of the batch: their CANDIDATES best temperature-scaled logits (values, ids,
    best first) and each scaled row's log normalizer, as (len(rows), CANDIDATES) and (len(rows),).
    The kernel reads the batch in place (no scaled copy, a selection instead of torch's topk:
    over Gemma 3's 262,144-token vocabulary 64 rows took ~13 ms where torch took ~90); torch
    otherwise. Both are exact per row."""
    if logits.dtype == torch.float32 and kernels.available():
        temps = torch.zeros(logits.shape[0], dtype=torch.float32)
        temps[rows] = torch.tensor([states[i].params.temperature for i in rows])
        vals, ids, norms = ops.top_candidates(logits, temps, CANDIDATES)
        if len(rows) == logits.shape[0]:
            return vals, ids, norms
        return vals[rows], ids[rows], norms[rows]
    temps = torch.tensor([states[i].params.temperature for i in rows], dtype=logits.dtype)
    scaled = logits[rows] / temps[:, None]
    vals, ids = scaled.topk(CANDIDATES, dim=1)  # a selection: exact per row
    return vals, ids, torch.stack([_log_norm(row) for row in scaled])


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

    tokens = _greedy_tokens(logits, states)
    _draw_random_rows(logits, states, tokens)
    return tokens, _logprobs(raw, tokens, states)
