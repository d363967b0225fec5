"""What completions and chat send back: streamed SSE chunks and whole JSON bodies.

Owns `BodyRender`, the `server.generation.submission.Render` both endpoints share: one stream of
chunks (a prologue, a chunk per output that carried a token or ended a choice, the usage chunk,
an error event if generation failed, `[DONE]`; one write per engine step) and one whole body.
What differs between them (object names, a choice's shape, what is sent before the first token,
logprobs in OpenAI's two shapes) is the subclass: `CompletionRender` (echo and prompt logprobs
included) or `ChatRender`, whose choices' text goes through `server.tooling.output`'s parsers
(reasoning, content and tool calls) when the request has tools or the server a reasoning
parser. Also `models_body`, /v1/models.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import torch

from engine import TokenLogprob
from server.errors import api_error
from server.generation.sse import SSE_DONE, per_step, sse
from server.generation.text import Choice, Generation, Update
from server.openai import logprobs as shown
from server.openai.logprobs import TokenText
from server.openai.protocol import ModelCard
from server.tooling.output import ChoiceParsers, finish_reason
from server.tooling.plan import ToolPlan


class BodyRender:
    """One endpoint's bodies for one run; a fresh one per generation (it keeps state)."""

    object = ""  # of a full body
    chunk_object = ""  # of a streamed chunk
    usage_on_every_chunk = False  # chat: "usage": null on each chunk when usage is requested

    def __init__(self, gen: Generation, tokens: TokenText) -> None:
        self.gen = gen
        self.tokens = tokens

    def head(self, chunk: bool) -> dict[str, Any]:
        g = self.gen
        head: dict[str, Any] = {
            "id": g.id,
            "object": self.chunk_object if chunk else self.object,
            "created": g.created,
            "model": g.model,
        }
        if chunk and g.include_usage and self.usage_on_every_chunk:
            head["usage"] = None  # OpenAI's shape: null on every chunk but the usage chunk
        return head

    def prologue(self) -> list[dict[str, Any]]:
        """Choice entries streamed before any output."""
        return []

    def chunk_choice(self, c: Choice, delta: str, lps: Sequence[TokenLogprob]) -> dict[str, Any]:
        raise NotImplementedError

    def full_choice(self, c: Choice) -> dict[str, Any]:
        raise NotImplementedError

    def stream(self, updates: AsyncIterator[Update]) -> AsyncIterator[str]:
        return per_step(self.gen, self._events(updates))

    async def _events(self, updates: AsyncIterator[Update]) -> AsyncIterator[str]:
        gen = self.gen
        head = self.head(chunk=True)
        try:
            for choice in self.prologue():
                yield sse({**head, "choices": [choice]})
            async for c, delta, lps, new_tokens in updates:
                # A chunk for every step that produced a token, even when its text is empty (a
                # special token, half a character, text held for a stop string): clients see
                # each token's timing, as vLLM streams it. Only token-less outputs are skipped.
                if not delta and not c.finished and not new_tokens:
                    continue
                yield sse({**head, "choices": [self.chunk_choice(c, delta, lps)]})
            if gen.include_usage:
                yield sse({**head, "choices": [], "usage": gen.usage()})
        except Exception as e:
            yield sse(api_error(e, gen.id).body())
        yield SSE_DONE

    async def whole(self, updates: AsyncIterator[Update]) -> dict[str, Any]:
        async for _ in updates:
            pass
        return {
            **self.head(chunk=False),
            "choices": [self.full_choice(c) for c in self.gen.choices],
            "usage": self.gen.usage(),
        }


class CompletionRender(BodyRender):
    object = chunk_object = "text_completion"

    def __init__(
        self, gen: Generation, tokens: TokenText, prompt_logprobs: int | None = None
    ) -> None:
        super().__init__(gen, tokens)
        self.offsets = {c.index: 0 for c in gen.choices}  # text_offset of each choice's next token
        self.prompt_logprobs = prompt_logprobs  # vLLM's field: top-N, None when not asked
        self.echoed: set[int] = set()  # choices whose echoed prompt logprobs were streamed

    @property
    def echo_logprobs(self) -> bool:
        """echo with logprobs: the prompt's logprobs come first (server.openai.logprobs)."""
        return self.gen.echo and self.gen.logprobs is not None

    def _prompt_part(self, c: Choice) -> dict[str, Any] | None:
        if not self.echo_logprobs or c.prompt_logprobs is None:
            return None
        ids = self.gen.prompts[c.prompt_index]
        return shown.prompt_part(self.tokens, ids, c.prompt_logprobs, self.gen.logprobs or 0)

    def _vllm_field(self, c: Choice) -> dict[str, Any]:
        if self.prompt_logprobs is None or c.prompt_logprobs is None:
            return {}
        plps = shown.vllm_prompt_logprobs(self.tokens, c.prompt_logprobs, self.prompt_logprobs)
        return {"prompt_logprobs": plps}

    def prologue(self) -> list[dict[str, Any]]:
        # With logprobs the echoed prompt goes with the first chunk, which has its logprobs.
        if not self.gen.echo or self.echo_logprobs:
            return []
        echoed = []
        for c in self.gen.choices:
            text = self.gen.prompt_texts[c.prompt_index]
            self.offsets[c.index] = len(text)
            echoed.append({"index": c.index, "text": text, "logprobs": None, "finish_reason": None})
        return echoed

    def chunk_choice(self, c: Choice, delta: str, lps: Sequence[TokenLogprob]) -> dict[str, Any]:
        first = c.index not in self.echoed
        self.echoed.add(c.index)
        prompt = self._prompt_part(c) if first else None
        if prompt is not None:
            delta = self.gen.prompt_texts[c.prompt_index] + delta
            self.offsets[c.index] = shown.prompt_text_length(prompt)
        lp = None
        if self.gen.logprobs is not None:
            lp = self.tokens.completion_logprobs(lps, self.offsets[c.index])
            self.offsets[c.index] += sum(len(t) for t in lp["tokens"])
            if prompt is not None:
                lp = shown.joined(prompt, lp)
        extra = self._vllm_field(c) if first else {}
        return {
            "index": c.index,
            "text": delta,
            "logprobs": lp,
            "finish_reason": c.finish_reason,
            **extra,
        }

    def full_choice(self, c: Choice) -> dict[str, Any]:
        prefix = self.gen.prompt_texts[c.prompt_index] if self.gen.echo else ""
        prompt = self._prompt_part(c)
        lp = None
        if self.gen.logprobs is not None:
            start = len(prefix) if prompt is None else shown.prompt_text_length(prompt)
            lp = self.tokens.completion_logprobs(c.logprobs, start)
            if prompt is not None:
                lp = shown.joined(prompt, lp)
        return {
            "index": c.index,
            "text": prefix + c.text,
            "logprobs": lp,
            "finish_reason": c.finish_reason,
            "stop_reason": None,
            **self._vllm_field(c),
        }


class ChatRender(BodyRender):
    """Chat bodies. Each choice's text goes through its `ChoiceParsers` (`--reasoning-parser`'s
    split, then the tool plan's parser; without either, the text is the content): deltas with
    `reasoning_content`, `content`, `tool_calls`, and whole messages alike."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    usage_on_every_chunk = True

    def __init__(
        self,
        gen: Generation,
        tokens: TokenText,
        plan: ToolPlan | None = None,
        reasoning: str | None = None,
    ) -> None:
        super().__init__(gen, tokens)
        self.plan = plan
        self.reasoning = reasoning
        self.parsers = {c.index: ChoiceParsers(plan, reasoning) for c in gen.choices}

    def prologue(self) -> list[dict[str, Any]]:
        # The role comes first, before any content, as OpenAI sends it.
        role = {"role": "assistant", "content": ""}
        return [
            {"index": c.index, "delta": role, "logprobs": None, "finish_reason": None}
            for c in self.gen.choices
        ]

    def _logprobs(self, lps: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        if self.gen.logprobs is None:
            return None
        return {"content": self.tokens.chat_logprobs(lps, self.gen.logprobs)}

    def chunk_choice(self, c: Choice, delta: str, lps: Sequence[TokenLogprob]) -> dict[str, Any]:
        p = self.parsers[c.index]
        reasoning, content, calls = p.feed(delta, c.finished)
        d: dict[str, Any] = {}
        if reasoning:
            d["reasoning_content"] = reasoning
        if content:
            d["content"] = content
        if calls:
            d["tool_calls"] = calls
        return {
            "index": c.index,
            "delta": d,
            "logprobs": self._logprobs(lps),
            "finish_reason": finish_reason(c.finish_reason, p.made_calls),
        }

    def full_choice(self, c: Choice) -> dict[str, Any]:
        p = ChoiceParsers(self.plan, self.reasoning)
        reasoning, content, calls = p.feed(c.text, final=True)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["content"] = content or None
            message["tool_calls"] = p.calls
        if self.reasoning:
            message["reasoning_content"] = reasoning or None
        return {
            "index": c.index,
            "message": message,
            "logprobs": self._logprobs(c.logprobs),
            "finish_reason": finish_reason(c.finish_reason, p.made_calls),
        }


def models_body(card: ModelCard) -> dict[str, Any]:
    """/v1/models: one entry per name the model is served under."""
    data = [
        {
            "id": name,
            "object": "model",
            "created": card.created,
            "owned_by": "cbserve",
            "root": card.name,
            "parent": None,
            "max_model_len": card.max_model_len,
            "parameter_count": card.parameter_count,
            "torch_version": torch.__version__,
            "engine": card.engine,
            # What a request gets for the sampling fields it leaves out (vLLM logs these; we
            # show them): the model's generation config or preset, amended by the CLI.
            "default_sampling_params": dict(card.default_sampling_params),
        }
        for name in card.names
    ]
    return {"object": "list", "data": data}
