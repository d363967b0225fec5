"""A request prepared in one pass: everything the generation loop needs, nothing left to look up.

Owns `Submission`, what a surface (completions, chat, the Responses API, embeddings) makes of a
request before anything reaches the engine: its id and who sends it, the prompts (ids and
text), the sampling parameters of choice j of every prompt, one grammar constraint per choice
(or none), stop strings and stop ids, the engine request fields (cache salt, priority, pooling),
and what to send back (a `Render` made for the run, streamed or whole). `start` builds the
run's text state (a `Generation`, one `Choice` per choice) and one engine `Request` per choice;
`server.generation.loop` runs them.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from engine import Request, SamplingParams
from engine.request import Pooling, TokenConstraint
from models import Tokenizer
from server.generation.text import Choice, Generation, Update


class Render(Protocol):
    """What a surface sends back, made for one run (`Submission.render(gen)`)."""

    def stream(self, updates: AsyncIterator[Update]) -> AsyncIterator[str]:
        """The SSE events of a streamed response, from the loop's updates."""
        ...

    async def whole(self, updates: AsyncIterator[Update]) -> dict[str, Any]:
        """The JSON body of a whole response, once the updates end."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class Submission:
    """One request, prepared (see the module docstring)."""

    id: str
    model: str
    arrival: float
    client_id: str | None  # who asked (X-Client-Id or API key), for fair sharing and limits
    prompts: list[list[int]]
    prompt_texts: list[str]
    params: Sequence[SamplingParams]  # choice j of every prompt samples with params[j]
    constraints: Sequence[TokenConstraint | Any] | None = None  # one per choice, prompt-major
    grammar_param: str | None = None  # the field whose grammar the constraints are
    stops: Sequence[str] = ()
    stop_ids: frozenset[int] = frozenset()  # end the text without being part of it
    # Special tokens whose text stays in a choice's text, for its parsers (a chat format's
    # structure: harmony's channels); other special tokens are dropped from it.
    kept_ids: frozenset[int] = frozenset()
    cache_salt: str | None = None
    priority: int = 0
    pooling: Pooling | None = None  # an embedding request: prefill only
    render: Callable[[Generation], Render]
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    logprobs: int | None = None  # top-N of each generated token, None when not asked

    def start(self, tokenizer: Tokenizer) -> tuple[Generation, list[Request]]:
        """The run's text state and its engine requests: one request (and choice) per prompt
        and choice index, with the choice's params and its own grammar state."""
        choices: list[Choice] = []
        requests: list[Request] = []
        for p, ids in enumerate(self.prompts):
            for j, choice_params in enumerate(self.params):
                index = p * len(self.params) + j
                rid = f"{self.id}-{index}"
                choices.append(
                    Choice(
                        index=index,
                        request_id=rid,
                        prompt_index=p,
                        tokenizer=tokenizer,
                        prompt_ids=ids,
                        stops=self.stops,
                        stop_ids=self.stop_ids,
                        kept_ids=self.kept_ids,
                    )
                )
                requests.append(
                    Request(
                        list(ids),
                        choice_params,
                        request_id=rid,
                        arrival_time=self.arrival,
                        cache_salt=self.cache_salt,
                        priority=self.priority,
                        client_id=self.client_id,
                        constraint=None if self.constraints is None else self.constraints[index],
                        pooling=self.pooling,
                    )
                )
        gen = Generation(
            id=self.id,
            model=self.model,
            created=int(time.time()),
            arrival=self.arrival,
            prompts=self.prompts,
            prompt_texts=self.prompt_texts,
            choices=choices,
            client_id=self.client_id,
            include_usage=self.include_usage,
            echo=self.echo,
            logprobs=self.logprobs,
            grammar_param=self.grammar_param,
            generates=self.pooling is None,
        )
        return gen, requests
