"""POST /v1/embeddings: the request body, and its run through the same engine as generation.

Each input becomes one prefill-only engine request (`Request.pooling`): it joins the batch like
any prompt, its final hidden states are pooled and L2-normalised in the step that computes its
last prompt token (`engine.prompt_outputs`), and it ends there, without sampling. So embeddings
share steps with generation and there is no second copy of the model.

Inputs: a string, a list of strings, a list of token ids or a list of token-id lists (as
OpenAI and vLLM take them); `encoding_format` float or base64 (little-endian float32, what the
OpenAI SDK asks for by default and decodes). Pooling is the model card's (`mean` unless the
card says `last`). An input longer than the context is a 400, as a prompt is.
"""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import Field, field_validator
from starlette.requests import Request as HTTPRequest
from starlette.responses import Response

from engine import SamplingParams
from engine.request import Pooling
from server.errors import APIError
from server.generation.submission import Submission
from server.generation.tenancy import client_identity
from server.generation.text import Generation, Update
from server.openai.body import Body
from server.openai.protocol import Prompt, Text

if TYPE_CHECKING:
    from server.openai.serving import OpenAIServing

MAX_INPUTS = 256  # inputs in one call (vLLM sets none; each input is one engine request)


class EmbeddingRequest(Body):
    input: Prompt
    model: Text | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: None = Field(None, description="not supported: null")
    user: Text | None = None

    @field_validator("input")
    @classmethod
    def _input_not_empty(cls, v: Prompt) -> Prompt:
        if isinstance(v, list):
            if not v:
                raise ValueError("input must not be an empty list")
            if len(v) > MAX_INPUTS and not isinstance(v[0], int):
                raise ValueError(f"at most {MAX_INPUTS} inputs are allowed, got {len(v)}")
        return v

    @property
    def inputs(self) -> list[str | list[int]]:
        v = self.input
        if isinstance(v, str):
            return [v]
        if v and isinstance(v[0], int):
            return [list(v)]  # type: ignore[arg-type]
        return list(v)  # type: ignore[arg-type]


def _encode(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


class EmbeddingsRender:
    """The embeddings body, once every input's vector is in (embeddings do not stream)."""

    def __init__(self, gen: Generation, encoding_format: str) -> None:
        self.gen = gen
        self.encoding_format = encoding_format

    def stream(self, updates: AsyncIterator[Update]) -> AsyncIterator[str]:
        raise NotImplementedError("embeddings are not streamed")

    async def whole(self, updates: AsyncIterator[Update]) -> dict[str, Any]:
        async for c, _, _, _ in updates:
            if c.finished and c.embedding is None:
                raise APIError(503, "an embedding request ended early", code="aborted")
        gen = self.gen
        n_tokens = sum(len(p) for p in gen.prompts)
        data = [
            {
                "object": "embedding",
                "index": c.index,
                "embedding": _encode(c.embedding or [], self.encoding_format),
            }
            for c in gen.choices
        ]
        return {
            "object": "list",
            "id": gen.id,
            "created": gen.created,
            "model": gen.model,
            "data": data,
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
        }


async def create_embeddings(
    serving: OpenAIServing, req: EmbeddingRequest, http: HTTPRequest
) -> Response:
    """The route's work: each input one prefill-only choice of one submission."""
    model = serving.check_model(req.model)
    limit = serving.card.max_model_len
    prompts, _ = await serving.prompts.encode_prompts(req.inputs, "input", serving.vocab_size)
    for i, ids in enumerate(prompts):
        if not ids:
            raise APIError(400, f"input[{i}] is empty (it encodes to no tokens)", param="input")
        if len(ids) > limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens; input[{i}] has "
                f"{len(ids)} tokens. Please reduce the input.",
                param="input",
                code="context_length_exceeded",
            )
    total = sum(len(ids) for ids in prompts)
    if total > serving.response_budget:
        raise APIError(
            400,
            f"the inputs have {total} tokens in all, more than the server's budget of "
            f"{serving.response_budget} for one request; send fewer or shorter inputs",
            param="input",
            code="response_too_large",
        )
    sub = Submission(
        id=f"embd-{uuid.uuid4().hex}",
        model=model,
        arrival=time.monotonic(),
        client_id=client_identity(http),
        prompts=prompts,
        prompt_texts=[""] * len(prompts),
        params=[SamplingParams(max_tokens=0)],
        pooling=Pooling(serving.card.embedding_pooling),
        render=lambda gen: EmbeddingsRender(gen, req.encoding_format),
    )
    return await serving.respond(sub, http)
