"""Prompt text to token ids without stalling the event loop.

Owns `PromptTokenizer`, a request's one pass from its prompts (completions, embeddings) or its
messages (chat: the chat template rendered here, in the same thread) to token ids: a cheap bound
first (a text longer in UTF-8 bytes than the context could hold even if every token were the
vocabulary's longest is refused before it is tokenized: a 4 MB body costs a length check, not
seconds of tokenizer time), then the tokenizer in a small thread pool, never on the loop. A
`tokenizers` tokenizer holds the GIL in `encode` but not in `encode_batch`, so where the
tokenizer is backed by one (`backend`) a single text goes through `encode_batch`: the same ids,
and the loop (/health, other streams) runs meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from models import Tokenizer
from server.errors import APIError
from server.openai.sampling_params import check_token_ids

if TYPE_CHECKING:
    from server.tooling.chat_template import ChatTemplate
    from server.tooling.plan import ToolPlan

T = TypeVar("T")

# Threads that tokenize at once: enough to overlap two requests; more would only take cores
# from the engine's step on a small machine.
TOKENIZER_THREADS = 2


def longest_token_bytes(tokenizer: Tokenizer) -> int:
    """The most UTF-8 bytes one token stands for (a special token counts its text, which a
    prompt may spell out): a prompt of more bytes than the context times this cannot fit."""
    longest = 1
    for i in range(tokenizer.vocab_size):
        piece = tokenizer.token_bytes(i)
        if not piece:
            try:
                piece = tokenizer.decode([i], skip_special_tokens=False).encode()
            except (IndexError, OverflowError, TypeError, ValueError):
                continue
        longest = max(longest, len(piece))
    return longest


class PromptTokenizer:
    """`encode` off the event loop, within `max_model_len` (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        per_token = 128  # a vocabulary without bytes of its own: a generous stand-in
        if tokenizer.token_bytes(0) is not None:
            per_token = longest_token_bytes(tokenizer)
        self.max_bytes = max_model_len * per_token
        self._pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenize")
        backend = getattr(tokenizer, "backend", None)
        self._batch = None
        if type(backend).__module__.startswith("tokenizers"):  # a tokenizers.Tokenizer
            self._batch = backend.encode_batch

    def check_size(self, text: str, param: str) -> None:
        """400 (context_length_exceeded) for a text that cannot fit the context."""
        # Characters never outnumber UTF-8 bytes: most oversized texts need no encoding.
        size, unit = len(text), "characters"
        if size <= self.max_bytes and not text.isascii():
            size, unit = len(text.encode("utf-8", "surrogatepass")), "bytes"
        if size > self.max_bytes:
            raise self._too_big(param, size, unit)

    def check_parts(self, parts: list[str], param: str) -> None:
        """`check_size` for a text made of `parts` and more (a chat's messages before the
        template renders them): refused when the parts alone are too long."""
        size = sum(len(p) for p in parts)
        if size > self.max_bytes:
            raise self._too_big(param, size, "characters")

    def _too_big(self, param: str, size: int, unit: str) -> APIError:
        return APIError(
            400,
            f"This model's maximum context length is {self.max_model_len} tokens; {param} "
            f"holds {size} {unit} of text, more than {self.max_model_len} tokens can hold. "
            "Please reduce the prompt.",
            param=param,
            code="context_length_exceeded",
        )

    def encode_now(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids, blocking (call it off the loop: `run`)."""
        if self._batch is not None:
            return self._batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    async def encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        """Token ids of `text` (the request field `param`), bounded, off the loop."""
        self.check_size(text, param)
        return await self.run(self.encode_now, text, add_special_tokens)

    async def encode_prompts(
        self,
        prompts: Sequence[str | Sequence[int]],
        param: str,
        vocab_size: int,
        decode_ids: bool = False,
    ) -> tuple[list[list[int]], list[str]]:
        """Each prompt's ids and text (the request field `param`: texts, or token ids within the
        vocabulary), every one checked before any is tokenized. A prompt of ids has its text
        decoded with `decode_ids` (echo), else ""."""
        for p in prompts:
            if isinstance(p, str):
                self.check_size(p, param)
            else:
                check_token_ids(p, vocab_size, param)
        return await self.run(self._encode_prompts, prompts, decode_ids)

    def _encode_prompts(
        self, prompts: Sequence[str | Sequence[int]], decode_ids: bool
    ) -> tuple[list[list[int]], list[str]]:
        ids: list[list[int]] = []
        texts: list[str] = []
        for p in prompts:
            if isinstance(p, str):
                ids.append(self.encode_now(p, True))
                texts.append(p)
            else:
                ids.append(list(p))
                texts.append(self.tokenizer.decode(list(p)) if decode_ids else "")
        return ids, texts

    async def encode_chat(
        self,
        template: ChatTemplate,
        messages: list[Any],
        add_generation_prompt: bool,
        plan: ToolPlan | None = None,
        kwargs: dict[str, Any] | None = None,
        bound_messages: bool = True,
    ) -> tuple[str, list[int]]:
        """The chat prompt `template` renders and its ids, off the loop. With `bound_messages`,
        messages that alone are more than the context holds are refused before any rendering
        (`check_parts`); the rendered text is bounded before it is tokenized."""
        if bound_messages:
            self.check_parts([m.text() for m in messages], "messages")
        return await self.run(
            self._render_and_encode, template, messages, add_generation_prompt, plan, kwargs
        )

    def _render_and_encode(
        self,
        template: ChatTemplate,
        messages: list[Any],
        add_generation_prompt: bool,
        plan: ToolPlan | None,
        kwargs: dict[str, Any] | None,
    ) -> tuple[str, list[int]]:
        text = template.render(messages, add_generation_prompt, plan, kwargs)
        self.check_size(text, "messages")
        return text, self.encode_now(text, False)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in the tokenizer's threads (template rendering and tokenizing together)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
