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
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import Field, field_validator
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

from engine import Request, SamplingParams
from engine.prompt_outputs import Pooling
from server.errors import APIError
from server.generation.tenancy import client_identity
from server.openai.formats import until_disconnect
from server.openai.protocol import Prompt, Text, _Body
from server.openai.sampling_params import check_token_ids

if TYPE_CHECKING:
    from server.openai.serving import OpenAIServing

MAX_INPUTS = 256  # inputs in one call (vLLM sets none; each input is one engine request)


class EmbeddingRequest(_Body):
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


def embedding_limits(schemas: dict[str, Any], max_model_len: int, vocab_size: int) -> None:
    """The served model's limits on `input` in the OpenAPI document (server.http.openapi)."""
    from server.http.openapi import _token_id

    prop = schemas.get("EmbeddingRequest", {}).get("properties", {}).get("input", {})
    for member in prop.get("anyOf", []):
        if member.get("type") != "array":
            continue
        member["minItems"] = 1
        items = member.get("items", {})
        if items.get("type") == "integer":
            member["maxItems"] = max_model_len
            _token_id(items, vocab_size)
        else:
            member["maxItems"] = MAX_INPUTS
            if items.get("type") == "array":
                items["minItems"] = 1
                items["maxItems"] = max_model_len
                _token_id(items.get("items", {}), vocab_size)


def _encode(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


async def create_embeddings(
    serving: OpenAIServing, req: EmbeddingRequest, http: HTTPRequest
) -> Response:
    model = serving._check_model(req.model)
    limit = serving.card.max_model_len
    for item in req.inputs:  # cheap checks of every input before any is tokenized
        if isinstance(item, str):
            serving.prompts.check_size(item, "input")
        else:
            check_token_ids(item, serving.vocab_size, "input")
    prompts: list[list[int]] = await serving.prompts.run(
        lambda: [
            serving.prompts.encode_now(item, True) if isinstance(item, str) else list(item)
            for item in req.inputs
        ]
    )
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
    pooling = Pooling(serving.card.embedding_pooling)
    gen_id = f"embd-{uuid.uuid4().hex}"
    arrival = time.monotonic()
    client_id = client_identity(http)
    requests = [
        Request(
            ids,
            SamplingParams(max_tokens=0),
            request_id=f"{gen_id}-{i}",
            arrival_time=arrival,
            client_id=client_id,
            pooling=pooling,
        )
        for i, ids in enumerate(prompts)
    ]

    async def run() -> Response:
        stream = await serving.client.submit(requests)
        vectors: dict[str, list[float]] = {}
        try:
            async for out in stream:
                if out.embedding is not None:
                    vectors[out.request_id] = out.embedding
                elif out.finished:
                    raise APIError(503, "an embedding request ended early", code="aborted")
        finally:
            for rid in stream.open_request_ids:
                serving.client.abort(rid)
        n_tokens = sum(len(p) for p in prompts)
        if serving.metrics is not None:
            serving.metrics.prompt_tokens.inc(n_tokens)
        data = [
            {
                "object": "embedding",
                "index": i,
                "embedding": _encode(vectors[r.request_id], req.encoding_format),
            }
            for i, r in enumerate(requests)
        ]
        body: dict[str, Any] = {
            "object": "list",
            "id": gen_id,
            "created": int(time.time()),
            "model": model,
            "data": data,
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
        }
        return JSONResponse(body)

    return await until_disconnect(http, run())
