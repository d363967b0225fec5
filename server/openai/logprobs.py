"""Logprobs as the responses show them: each token's text and bytes (`TokenText`), the
completions and chat shapes of sampled tokens' logprobs, and prompt logprobs on /v1/completions:
`echo` with `logprobs` (OpenAI's legacy shape, as lm-evaluation-harness reads it) and vLLM's
`prompt_logprobs` field.

A logprob JSON cannot carry (a token the sampler ruled out: -inf; NaN) is shown as a floor
(`clamp`), as vLLM does. The engine computes prompt logprobs in the prompt's prefill
(`engine.prompt_outputs`) and sends them with a choice's first output
(`server.openai.sampling_params` asks for them). With echo and logprobs, a choice's `logprobs`
cover the prompt's tokens, then the completion's: the first prompt token has a null logprob and
null alternatives, offsets count from the start of the prompt's text. `prompt_logprobs` is vLLM's list: null for the first token, then for each
token a map from token id (a string) to {logprob, rank, decoded_token}: the token itself and
the top-N alternatives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine import TokenLogprob
from models import Tokenizer

# JSON has no infinities; a token the sampler ruled out gets this floor, as vLLM does.
LOGPROB_FLOOR = -9999.0


def clamp(logprob: float) -> float:
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR  # also maps NaN to the floor


class TokenText:
    """A token's text and UTF-8 bytes for logprobs, cached per token id. A piece that is not whole
    UTF-8 on its own (one byte of a character) is shown as OpenAI does, `bytes:\\xNN`."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        raw = self.tokenizer.token_bytes(token_id)
        if raw is not None:
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            value = (text, list(raw))
        else:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            value = (text, list(text.encode("utf-8")))
        self._cache[token_id] = value
        return value

    def completion_logprobs(self, lps: Sequence[TokenLogprob], offset: int) -> dict[str, Any]:
        tokens, token_lps, tops, offsets = [], [], [], []
        for lp in lps:
            text = self(lp.token_id)[0]
            tokens.append(text)
            token_lps.append(clamp(lp.logprob))
            top = {self(t)[0]: clamp(v) for t, v in lp.top}
            top.setdefault(text, clamp(lp.logprob))
            tops.append(top)
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def chat_logprobs(self, lps: Sequence[TokenLogprob], top_n: int | None) -> list[dict]:
        content = []
        for lp in lps:
            text, raw = self(lp.token_id)
            top = []
            for t, v in lp.top[: top_n or 0]:
                t_text, t_raw = self(t)
                top.append({"token": t_text, "logprob": clamp(v), "bytes": t_raw})
            content.append(
                {"token": text, "logprob": clamp(lp.logprob), "bytes": raw, "top_logprobs": top}
            )
        return content


def echoed_logprobs(
    tokens: TokenText, plps: Sequence[TokenLogprob | None], top_n: int
) -> dict[str, Any]:
    """The prompt's part of a choice's `logprobs` (OpenAI's completions shape)."""
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
        out["token_logprobs"].append(clamp(lp.logprob))
        top: dict[str, float] = {}
        for t, v in lp.top[:top_n]:  # best first: tokens of equal text keep the best one's
            top.setdefault(tokens(t)[0], clamp(v))
        top.setdefault(text, clamp(lp.logprob))
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
    out: list[dict[str, dict[str, Any]] | None] = []
    for lp in plps:
        if lp is None:
            out.append(None)
            continue
        entry = {
            str(lp.token_id): {
                "logprob": clamp(lp.logprob),
                "rank": lp.rank,
                "decoded_token": tokens(lp.token_id)[0],
            }
        }
        for rank, (t, v) in enumerate(lp.top[:top_n], start=1):
            entry.setdefault(
                str(t), {"logprob": clamp(v), "rank": rank, "decoded_token": tokens(t)[0]}
            )
        out.append(entry)
    return out
