"""Request fields -> `engine.SamplingParams`: one per choice of each prompt.

Owns how the OpenAI fields of a validated request (`server.openai.protocol`) and the model's sampling
defaults (`ModelCard.default_sampling_params`) become engine sampling parameters, and the checks
that need the vocabulary (token ids in prompts, `logit_bias`, `stop_token_ids`). A new sampling
field is a field on `protocol.SamplingFields` plus one line in `_sampling_params`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel

from engine import SamplingParams
from server.errors import APIError
from server.openai.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields

TOKEN_ID_KEY = re.compile(r"0|[1-9][0-9]*")  # a logit_bias key
# Below this a temperature is greedy (as vLLM's _SAMPLING_EPS): dividing logits by 1e-38 overflows
# to inf and the draw degenerates to token 0. SamplingParams.greedy uses the same bound.
GREEDY_TEMPERATURE = 1e-5


def check_token_ids(ids: Sequence[int], vocab_size: int, param: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise APIError(
            400,
            f"{param} contains token id {bad}, outside the vocabulary [0, {vocab_size})",
            param=param,
        )


# OpenAI's defaults, for fields neither the request nor the model's defaults set.
OPENAI_DEFAULTS: dict[str, float] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}


def sent(req: BaseModel, name: str) -> bool:
    """Whether the client gave `name` a value (an explicit null counts as not given)."""
    return name in req.model_fields_set and getattr(req, name) is not None


def completion_sampling_params(
    req: CompletionRequest, vocab_size: int, defaults: Mapping[str, Any] | None = None
) -> list[SamplingParams]:
    """One `SamplingParams` per choice of each prompt (choice j samples with seed + j).
    `defaults` (the model card's `default_sampling_params`) fill the fields the client did not
    send; request fields always win."""
    defaults = defaults or {}
    max_tokens = req.max_output_tokens()
    if not sent(req, "max_tokens") and "max_tokens" in defaults:
        max_tokens = defaults["max_tokens"]
    return _sampling_params(req, max_tokens, req.logprobs, vocab_size, defaults)


def prompt_logprobs_wanted(req: CompletionRequest) -> int | None:
    """Top-N the engine computes for each prompt token (echo with logprobs, or vLLM's
    `prompt_logprobs`; `server.openai.logprobs` shows them), None when neither field asks."""
    wanted = [n for n in (req.prompt_logprobs, req.logprobs if req.echo else None) if n is not None]
    return max(wanted) if wanted else None


def chat_sampling_params(
    req: ChatCompletionRequest,
    vocab_size: int,
    max_tokens: int,
    defaults: Mapping[str, Any] | None = None,
) -> list[SamplingParams]:
    """As `completion_sampling_params`; `max_tokens` is `req.max_output_tokens(...)`, which
    needs the prompt's length (a default max_tokens only lowers it)."""
    defaults = defaults or {}
    if not (sent(req, "max_tokens") or sent(req, "max_completion_tokens")):
        max_tokens = min(max_tokens, defaults.get("max_tokens", max_tokens))
    return _sampling_params(req, max_tokens, req.num_logprobs, vocab_size, defaults)


def _sampling_params(
    req: SamplingFields,
    max_tokens: int,
    logprobs: int | None,
    vocab_size: int,
    defaults: Mapping[str, Any],
) -> list[SamplingParams]:
    bias: list[tuple[int, float]] = []
    for key, value in (req.logit_bias or {}).items():
        # Exactly what the OpenAPI document's pattern allows: a decimal number without sign,
        # spaces, underscores, leading zeros or non-ASCII digits (all of which int() takes).
        if TOKEN_ID_KEY.fullmatch(key) is None:
            raise APIError(
                400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
            )
        tok = int(key)
        if not 0 <= tok < vocab_size:
            raise APIError(
                400, f"logit_bias token id {tok} is outside the vocabulary", param="logit_bias"
            )
        if not math.isfinite(value):
            raise APIError(400, "logit_bias values must be finite", param="logit_bias")
        bias.append((tok, float(value)))
    stop_ids = tuple(req.stop_token_ids or ())
    check_token_ids(stop_ids, vocab_size, "stop_token_ids")
    if req.min_tokens > max_tokens:
        # As vLLM: a 400, not a silent cap. With its own code, because no JSON Schema keyword can
        # bound one field by another (server.http.openapi.UNSTATED_RULE_CODES).
        raise APIError(
            400,
            f"min_tokens ({req.min_tokens}) must be less than or equal to max_tokens "
            f"({max_tokens})",
            param="min_tokens",
            code="min_tokens_exceeds_max_tokens",
        )

    def given(name: str) -> Any:
        # The request's value, else the model's default, else OpenAI's.
        if sent(req, name):
            return getattr(req, name)
        return defaults.get(name, OPENAI_DEFAULTS.get(name))

    top_k = given("top_k")
    temperature = given("temperature")

    # Choice j of every prompt samples with seed + j (as vLLM does for n > 1): reproducible,
    # and the n choices differ from one another. SamplingParams checks the values.
    return [
        SamplingParams(
            max_tokens=max_tokens,
            # greedy below the threshold, not an overflowing division
            temperature=0.0 if temperature < GREEDY_TEMPERATURE else temperature,
            # OpenAI / vLLM spell "off" -1 (and 0); the engine spells it None.
            top_k=None if top_k in (None, 0, -1) else top_k,
            top_p=given("top_p"),
            min_p=given("min_p"),
            repetition_penalty=given("repetition_penalty"),
            presence_penalty=given("presence_penalty"),
            frequency_penalty=given("frequency_penalty"),
            stop_token_ids=stop_ids,
            ignore_eos=req.ignore_eos,
            min_tokens=req.min_tokens,
            logprobs=logprobs,
            seed=None if req.seed is None else req.seed + j,
            logit_bias=tuple(bias),
        )
        for j in range(req.n)
    ]


def context_too_long(limit: int, prompt_len: int, max_tokens: int) -> APIError:
    """The 400 for a prompt plus max_tokens beyond the model's context (OpenAI's wording)."""
    return APIError(
        400,
        f"This model's maximum context length is {limit} tokens. However, you requested "
        f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
        f"completion). Please reduce the prompt or max_tokens.",
        param="max_tokens",
        code="context_length_exceeded",
    )
