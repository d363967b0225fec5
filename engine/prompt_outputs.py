"""What a request asks of its prompt's forward: prompt logprobs and pooled embeddings.

Both are computed in the prefill that runs anyway, chunk by chunk, from the final hidden states
the model's forward returns (before `compute_logits`): the runner hands each chunk's rows here
(`collect`), and a request's `PromptOutputs` keeps what they gave until its prompt is done.

- Prompt logprobs (`SamplingParams.prompt_logprobs`): position p's logits give token p + 1's
  logprob under the model's raw distribution (as sampled tokens' logprobs are reported), with
  the top-N alternatives; the first prompt token has none.
- Embeddings (`Request.pooling`): the hidden states of the prompt, mean-pooled or the last
  token's, L2-normalised.

A request that wants either skips the prefix cache for its prompt (it recomputes a cached
prefix, see `BlockManager.lookup_prefix`): a cached block keeps K/V, not the hidden states or
logits these need, and keeping those per block would cost far more memory than the K/V itself
(a 49,152-token vocabulary's logits are ~100x a block's K/V per token). Its own blocks still
enter the cache for the requests after it. A preempted request recomputes from position 0 and
overwrites what it had, so the result is the same.

A request with `max_tokens == 0` or `pooling` is prefill-only: it finishes when its prompt has
been computed (`finish_prefill_only`), without sampling.
"""

from __future__ import annotations

import torch

from engine.request import (  # noqa: F401 (Pooling, PromptOutputs: this module's names too)
    Pooling,
    PromptOutputs,
    RequestState,
    RequestStatus,
    StepOutput,
    TokenLogprob,
)
from models.base import CausalLM

LOGITS_SLICE = 128  # prompt positions whose logits are computed at once


def collect(
    model: CausalLM, hidden: torch.Tensor, spans: list[tuple[RequestState, int, int, int]]
) -> None:
    """Take what prompt-output requests need from one forward's final hidden states.

    hidden: (T, d) for the step's flat tokens; spans: (state, first flat index, first position,
    number of tokens) of each row whose request has `prompt_out`."""
    for state, flat, start, n in spans:
        po: PromptOutputs = state.prompt_out
        end = min(start + n, state.num_prompt_tokens)  # positions of prompt tokens in the row
        if end <= start:
            continue
        h = hidden[flat : flat + end - start]  # (n', d)
        if po.pooling is Pooling.MEAN:
            part = h.sum(dim=0, dtype=torch.float64)
            po.pooled = part if start == 0 or po.pooled is None else po.pooled + part
        elif po.pooling is Pooling.LAST and end == state.num_prompt_tokens:
            po.pooled = h[-1].to(torch.float64)
        if po.logprobs is not None:
            # Position p predicts token p + 1; the prompt's last position predicts the first
            # generated token, which the sampler reports.
            last = min(end, state.num_prompt_tokens - 1)
            # In slices: a chunk's full-vocabulary logits are large (512 tokens x 49,152 is
            # 100 MB, twice over with the log-softmax).
            for a in range(start, last, LOGITS_SLICE):
                b = min(a + LOGITS_SLICE, last)
                _prompt_logprobs(model, h[a - start : b - start], state, a, po)


def _prompt_logprobs(
    model: CausalLM, h: torch.Tensor, state: RequestState, start: int, po: PromptOutputs
) -> None:
    n = h.shape[0]
    lps = torch.log_softmax(model.compute_logits(h).float(), dim=-1)  # (n, V)
    targets = torch.tensor(state.token_ids[start + 1 : start + 1 + n], dtype=torch.long)
    chosen_t = lps.gather(1, targets[:, None])  # (n, 1)
    ranks = ((lps > chosen_t).sum(dim=1) + 1).tolist()
    chosen = chosen_t[:, 0].tolist()
    k = po.top_n or 0
    top_vals, top_ids = lps.topk(k, dim=-1) if k else (None, None)
    for i in range(n):
        top: tuple[tuple[int, float], ...] = ()
        if top_ids is not None:
            top = tuple(zip(top_ids[i].tolist(), top_vals[i].tolist(), strict=True))
        po.logprobs[start + 1 + i] = TokenLogprob(targets[i].item(), chosen[i], top, ranks[i])


def is_prefill_only(state: RequestState) -> bool:
    return state.request.pooling is not None or state.params.max_tokens == 0


def take_prompt_logprobs(state: RequestState) -> list[TokenLogprob | None] | None:
    """The prompt logprobs to send with this output: all of them, once."""
    po = state.prompt_out
    if po is None or po.logprobs is None or po.sent:
        return None
    po.sent = True
    return po.logprobs


def finish_prefill_only(state: RequestState) -> StepOutput:
    """End a prefill-only request whose prompt is computed: its output carries the prompt
    logprobs and the embedding, and no token."""
    po = state.prompt_out
    embedding = None
    if state.request.pooling is not None:
        embedding = po.embedding(state.num_prompt_tokens)
        state.status = RequestStatus.FINISHED_STOPPED
    else:
        state.status = RequestStatus.FINISHED_LENGTH  # max_tokens 0: the length it asked for
    return state.output([], prompt_logprobs=take_prompt_logprobs(state), embedding=embedding)
