"""The text state of one submitted request: its choices, and what each has said so far.

A `Generation` is one request's run (completions, chat, a Responses call, or embeddings): its
prompts, its choices (one engine request each), the stream they come back on, and usage counted
from token ids. A `Choice` turns its engine request's outputs into text: incremental
detokenization, stop strings (a match truncates the text before it), text held back while a
stop string may still be forming, timings, and an embedding request's vector. An `Update` is
what the generation loop hands a response per output.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine import StepOutput, TokenLogprob
from models import IncrementalDetokenizer, Tokenizer
from server.engine_client.interface import OutputStream


class Choice:
    """Text state of one choice: detokenizer, stop strings, what has been streamed, timings."""

    __slots__ = (
        "index",
        "request_id",
        "prompt_index",
        "detok",
        "stops",
        "hold",
        "stop_ids",
        "text",
        "sent",
        "num_tokens",
        "num_cached_tokens",
        "logprobs",
        "prompt_logprobs",
        "finish_reason",
        "first_time",
        "last_time",
        "embedding",
    )

    def __init__(
        self,
        *,
        index: int,
        request_id: str,
        prompt_index: int,
        tokenizer: Tokenizer,
        prompt_ids: list[int],
        stops: Sequence[str],
        stop_ids: frozenset[int],
        kept_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.index = index
        self.request_id = request_id
        self.prompt_index = prompt_index
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, keep=kept_ids)
        self.stops = tuple(stops)
        # Streamed text stays this many characters behind, so a stop string that is still being
        # generated is never sent before it is recognised.
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.stop_ids = stop_ids
        self.text = ""
        self.sent = 0
        self.num_tokens = 0
        self.num_cached_tokens = 0
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob | None] | None = None  # when asked for
        self.finish_reason: str | None = None
        self.first_time: float | None = None
        self.last_time: float | None = None
        self.embedding: list[float] | None = None  # an embedding request's vector, at its end

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, out: StepOutput) -> bool:
        """Take one step's output. True if a stop string ended the choice (abort it in the engine)."""
        ids = out.token_ids
        self.num_tokens += len(ids)
        self.num_cached_tokens = out.num_cached_tokens
        if out.logprobs:
            self.logprobs.extend(out.logprobs)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.embedding is not None:
            self.embedding = out.embedding
        text_ids = ids
        if out.finish_reason == "stop" and ids and ids[-1] in self.stop_ids:
            text_ids = ids[:-1]  # EOS / stop_token_ids end the text; they are not part of it
        delta = self.detok.add(text_ids) if text_ids else ""
        if out.finished:
            delta += self.detok.flush()
        if delta:
            search_from = max(len(self.text) - self.hold, 0)
            self.text += delta
            cut = self._find_stop(search_from)
            if cut is not None:
                self.text = self.text[:cut]
                self.finish_reason = "stop"
                return not out.finished
        if out.finished:
            self.finish_reason = out.finish_reason or "stop"
        return False

    def _find_stop(self, start: int) -> int | None:
        best: int | None = None
        for s in self.stops:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best):
                best = i
        return best

    def take_delta(self) -> str:
        """Text that is safe to stream now (all of it once finished)."""
        end = len(self.text) if self.finished else max(len(self.text) - self.hold, self.sent)
        delta = self.text[self.sent : end]
        self.sent = end
        return delta


@dataclass(slots=True, kw_only=True)
class Generation:
    """One submitted request: its choices and usage. Built whole (its choices included); what
    changes afterwards is the run's state: `stream`, `status`, `done`, `counted`."""

    id: str
    model: str
    created: int
    arrival: float
    prompts: list[list[int]]
    prompt_texts: list[str]
    choices: list[Choice]
    client_id: str | None = None  # who asked (X-Client-Id or API key), for fair sharing
    include_usage: bool = False
    echo: bool = False
    logprobs: int | None = None  # top-N, None when not requested
    grammar_param: str | None = None  # the field whose grammar constrains the choices, if any
    # False for a prefill-only request (embeddings): no text, so it holds no client slot and
    # has no token timings or log line.
    generates: bool = True
    by_request: dict[str, Choice] = field(init=False)
    stream: OutputStream | None = None
    status: str = "ok"
    done: bool = False
    counted: bool = False  # holds one of its client's concurrent-request places

    def __post_init__(self) -> None:
        self.by_request = {c.request_id: c for c in self.choices}

    def summary(self) -> str:
        """One log line for the finished request: sizes, timings, finish reasons, status."""
        firsts = [c.first_time for c in self.choices if c.first_time is not None]
        lasts = [c.last_time for c in self.choices if c.last_time is not None]
        ttft = f"{min(firsts) - self.arrival:.3f}s" if firsts else "-"
        e2e = f"{(max(lasts) if lasts else time.monotonic()) - self.arrival:.3f}s"
        reasons = ",".join(sorted({c.finish_reason or "-" for c in self.choices}))
        return (
            f"{self.id} choices={len(self.choices)} "
            f"prompt_tokens={sum(len(p) for p in self.prompts)} "
            f"output_tokens={sum(c.num_tokens for c in self.choices)} "
            f"ttft={ttft} e2e={e2e} finish={reasons} status={self.status}"
        )

    def usage(self) -> dict:
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(c.num_tokens for c in self.choices)
        # Prompt tokens served from the prefix cache, once per prompt (n choices share it).
        cached = sum(
            max((c.num_cached_tokens for c in self.choices if c.prompt_index == i), default=0)
            for i in range(len(self.prompts))
        )
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }


# (choice, text delta safe to send, that output's logprobs, how many tokens it carried)
Update = tuple[Choice, str, Sequence[TokenLogprob], int]
