"""Prompt logprobs on /v1/completions: `echo` with `logprobs` (OpenAI's legacy shape, as
lm-evaluation-harness reads it) and vLLM's `prompt_logprobs` field.

The engine computes them in the prompt's prefill (`engine.prompt_outputs`) and sends them with
a choice's first output; this module asks for them (`prompt_logprobs_wanted`) and shapes them.
With echo and logprobs, a choice's `logprobs` cover the prompt's tokens, then the completion's:
the first prompt token has a null logprob and null alternatives, offsets count from the start
of the prompt's text. `prompt_logprobs` is vLLM's list: null for the first token, then for each
token a map from token id (a string) to {logprob, rank, decoded_token}: the token itself and
the top-N alternatives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from engine import TokenLogprob

if TYPE_CHECKING:
    from server.openai.formats import TokenText
    from server.openai.protocol import CompletionRequest


def prompt_logprobs_wanted(req: CompletionRequest) -> int | None:
    """Top-N the engine computes for each prompt token, None when neither field asks."""
    wanted = [n for n in (req.prompt_logprobs, req.logprobs if req.echo else None) if n is not None]
    return max(wanted) if wanted else None


def echoed_logprobs(
    tokens: TokenText, plps: Sequence[TokenLogprob | None], top_n: int
) -> dict[str, Any]:
    """The prompt's part of a choice's `logprobs` (OpenAI's completions shape)."""
    from server.openai.formats import _clamp  # the same floor as sampled tokens' logprobs

    out: dict[str, list] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    offset = 0
    for lp in plps:
        if lp is None:  # the first token: nothing predicts it
            continue
        text = tokens(lp.token_id)[0]
        out["tokens"].append(text)
        out["token_logprobs"].append(_clamp(lp.logprob))
        top: dict[str, float] = {}
        for t, v in lp.top[:top_n]:  # best first: tokens of equal text keep the best one's
            top.setdefault(tokens(t)[0], _clamp(v))
        top.setdefault(text, _clamp(lp.logprob))
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def with_first_token(tokens: TokenText, first_id: int, part: dict[str, Any]) -> dict[str, Any]:
    """Prepend the prompt's first token (null logprob, null alternatives) and shift offsets."""
    text = tokens(first_id)[0]
    return {
        "tokens": [text, *part["tokens"]],
        "token_logprobs": [None, *part["token_logprobs"]],
        "top_logprobs": [None, *part["top_logprobs"]],
        "text_offset": [0, *(o + len(text) for o in part["text_offset"])],
    }


def prompt_part(
    tokens: TokenText, prompt_ids: Sequence[int], plps: Sequence[TokenLogprob | None], top_n: int
) -> dict[str, Any]:
    return with_first_token(tokens, prompt_ids[0], echoed_logprobs(tokens, plps, top_n))


def joined(prompt: dict[str, Any], completion: dict[str, Any] | None) -> dict[str, Any]:
    """A choice's `logprobs`: the prompt's, then the completion's (whose offsets already count
    from the end of the prompt's text)."""
    if completion is None:
        return prompt
    return {key: prompt[key] + completion[key] for key in prompt}


def prompt_text_length(part: dict[str, Any]) -> int:
    """Characters the prompt's tokens span, where the completion's offsets start."""
    if not part["tokens"]:
        return 0
    return part["text_offset"][-1] + len(part["tokens"][-1])


def vllm_prompt_logprobs(
    tokens: TokenText, plps: Sequence[TokenLogprob | None], top_n: int
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: null, then {token id: {logprob, rank, decoded_token}} per token."""
    from server.openai.formats import _clamp

    out: list[dict[str, dict[str, Any]] | None] = []
    for lp in plps:
        if lp is None:
            out.append(None)
            continue
        entry = {
            str(lp.token_id): {
                "logprob": _clamp(lp.logprob),
                "rank": lp.rank,
                "decoded_token": tokens(lp.token_id)[0],
            }
        }
        for rank, (t, v) in enumerate(lp.top[:top_n], start=1):
            entry.setdefault(
                str(t), {"logprob": _clamp(v), "rank": rank, "decoded_token": tokens(t)[0]}
            )
        out.append(entry)
    return out
